"""Builds the e2e images and imports them into the node's cached containerd root, ahead of
tests/e2e: scripts/test.sh runs this in the background while the other tests run (the build is
~9 minutes after a source change, the import ~6), and tests/e2e, collected last, waits for it.
A failure here only costs time: the e2e fixtures build and import whatever is missing themselves.

  python tests/e2e/preimport.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))        # the controlplane package, as conftest.py has it

from e2e.node import Node  # noqa: E402


def exporter(ref: str):
    def export(path: Path) -> subprocess.Popen:
        return subprocess.Popen([str(REPO / "scripts" / "build-images.sh"), "--export", ref, str(path)],
                                stdout=subprocess.DEVNULL)
    return export


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # test.sh ending early: clean up
    if os.geteuid() != 0:
        print("preimport: the e2e node needs root; nothing imported", file=sys.stderr)
        return 0
    built = subprocess.run([str(REPO / "scripts" / "build-images.sh")], stdout=subprocess.PIPE, text=True)
    if built.returncode:
        print(f"preimport: scripts/build-images.sh failed ({built.returncode}); tests/e2e will say why",
              file=sys.stderr)
        return built.returncode
    images = json.loads(built.stdout.strip().splitlines()[-1])
    Node(images={ref: exporter(ref) for ref in images.values()}, pause_image=images["pause"]).preimport()
    print(f"preimport: {len(images)} images in the node's containerd cache", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
