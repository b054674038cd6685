"""The operator under test: `grpo operator` as a subprocess, and the chart's RBAC for it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from controlplane.conftest import helm_bin
from grpo_operator.metrics import RESYNCS
from operator_helpers import eventually, free_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "grpo-operator"
OPERATOR_NS = "grpo-system"
RELEASE = "grpo"
SERVICE_ACCOUNT = f"{RELEASE}-grpo-operator"


def render_rbac(*set_values: str, release: str = RELEASE) -> str:
    """The chart's ServiceAccount and RBAC, rendered for `release` in grpo-system."""
    args = [helm_bin(), "template", release, str(CHART), "--namespace", OPERATOR_NS,
            "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"]
    for v in set_values:
        args += ["--set", v]
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout


class OperatorProcess:
    """`grpo operator` as a subprocess; restartable (the crash tests kill it)."""

    def __init__(self, kubeconfig: Path, workdir: Path, **settings: str):
        self.workdir = workdir
        self.metrics_port, self.health_port = free_port(), free_port()
        # No S3 credentials of the test's own: as the chart's defaults, the operator has none.
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
                    "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                    "GRPO_OPERATOR_RESYNC_SECONDS": "1",
                    "GRPO_OPERATOR_METRICS_PORT": str(self.metrics_port),
                    "GRPO_OPERATOR_LIVENESS_ENDPOINT": f"http://127.0.0.1:{self.health_port}/healthz",
                    "GRPO_OPERATOR_TRAINER_TERMINATION_GRACE_SECONDS": "30",
                    "GRPO_OPERATOR_MISSING_SECRET_GRACE_SECONDS": "8",
                    **{f"GRPO_OPERATOR_{k.upper()}": v for k, v in settings.items()}}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / f"operator-{self.starts}.log"

    def start(self, wait: bool = True) -> "OperatorProcess":
        self.starts += 1
        grpo = Path(sys.executable).parent / "grpo"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(grpo), "operator", "--verbose"], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.workdir)
        if wait:
            eventually(self.healthy, timeout=60, what="the operator's /healthz")
        return self

    def health(self) -> int | None:
        """/healthz's HTTP status; None while nothing listens. Fails if the operator exited."""
        if self.proc.poll() is not None:
            pytest.fail(f"the operator exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the operator exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def pause(self) -> None:
        """SIGSTOP: the operator does nothing until resume(); the API server queues its watch events."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def resyncs(self) -> int:
        """Resync passes this operator process has completed (grpo_operator_resyncs_total)."""
        found = re.search(rf"^{RESYNCS} (\S+)$", self.metrics(), re.MULTILINE)
        assert found, f"no {RESYNCS} in the operator's metrics"
        return int(float(found.group(1)))

    def wait_for_resyncs(self, passes: int = 2, timeout: float = 60) -> None:
        """Returns once `passes` (>= 2) resync passes have completed after this call. The first
        may have started before the call; the second started after the first ended, so it
        reconciled every job after whatever the caller did before calling (metrics.py: a job
        whose reconcile a watch event was running gets its run from that one instead; the
        tests call this on jobs nothing happens to any more). Instead of sleeping "long enough",
        which on a loaded machine may be shorter than one resync."""
        assert passes >= 2, "the pass under way at the call may have read the state before the change"
        since = self.resyncs()
        eventually(lambda: self.resyncs() >= since + passes, timeout=timeout, interval=0.1,
                   what=f"{passes} resync passes after pass {since}")

    def logs(self) -> str:
        return "".join((self.workdir / f"operator-{i}.log").read_text(errors="replace")
                       for i in range(1, self.starts + 1))

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()
