"""The package layers of docs/ARCHITECTURE.md §2: grpo_api imports none of ours; operator, trainer and
rollout never import each other, and grpo_api imports no torch, transformers, vllm or kopf; inside
grpo_trainer and grpo_rollout, a module imports only from the layers below its own, so no two
modules import each other (import-linter contracts in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    out = subprocess.run([exe], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 kept, 0 broken" in out.stdout
