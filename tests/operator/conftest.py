"""Fixtures for the operator's control-plane tests: the real control plane (tests/controlplane),
the CRD, the chart's RBAC bound to the operator's ServiceAccount, and `grpo operator` running
as a subprocess with that account's token, as it runs in the cluster.

There is no kubelet: the tests play it by patching pod status (phase, container states), and
the real Job, ReplicaSet and garbage-collector controllers do the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# The control plane's session fixtures, shared with tests/controlplane (tests/ is on sys.path:
# the root conftest.py is not in a package).
from controlplane.conftest import admin_client, control_plane, kubectl_bin, namespace  # noqa: F401
from controlplane.cluster import default_bin_dir
from operator_helpers import eventually, free_port, kubectl

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "grpo-operator"
OPERATOR_NS = "grpo-system"
RELEASE = "grpo"
SERVICE_ACCOUNT = f"{RELEASE}-grpo-operator"

MONITORING_CRDS = REPO / "tests" / "chart" / "monitoring-crds.yaml"


def helm_bin() -> str:
    helm = default_bin_dir() / "helm"
    if not os.access(helm, os.X_OK):
        msg = f"{helm} not built; run scripts/build-controlplane.sh"
        if os.environ.get("GRPO_REQUIRE_CONTROLPLANE"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return str(helm)


@pytest.fixture(scope="session")
def cluster_crds(control_plane, kubectl_bin):
    """The GRPOJob CRD and the monitoring stubs, Established."""
    kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(REPO / "crds" / "grpojob.yaml"))
    kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(MONITORING_CRDS))
    kubectl(kubectl_bin, control_plane, "wait", "--for=condition=Established", "--timeout=60s",
            "crd/grpojobs.grpo.dev", "crd/podmonitors.monitoring.coreos.com", "crd/servicemonitors.monitoring.coreos.com")
    _wait_for_garbage_collector(control_plane, kubectl_bin)


def _wait_for_garbage_collector(cp, kubectl_bin) -> None:
    """The garbage collector learns about a new CRD at its next discovery sync (every 30 s in
    kube-controller-manager); until then children of a deleted GRPOJob stay. A real cluster has
    had the CRD for long; here, delete a probe owner until its dependent goes."""
    ns = "gc-probe"
    kubectl(kubectl_bin, cp, "create", "namespace", ns)
    owner = json.loads(kubectl(kubectl_bin, cp, "-n", ns, "create", "-o", "json", "-f", "-", stdin=json.dumps({
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "probe"},
        "spec": {"model": {"path": "m"}, "data": {"trainFiles": ["t"]}}})).stdout)
    kubectl(kubectl_bin, cp, "-n", ns, "create", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dependent", "ownerReferences": [{
            "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "name": "probe", "uid": owner["metadata"]["uid"]}]}}))
    kubectl(kubectl_bin, cp, "-n", ns, "delete", "grpojob", "probe")
    eventually(lambda: kubectl(kubectl_bin, cp, "-n", ns, "get", "configmap", "dependent", check=False).returncode,
               timeout=90, interval=1, what="the garbage collector to know GRPOJobs")
    kubectl(kubectl_bin, cp, "delete", "namespace", ns, "--wait=false")


def render_rbac(*set_values: str) -> str:
    """The chart's ServiceAccount and RBAC, rendered for release `grpo` in grpo-system."""
    args = [helm_bin(), "template", RELEASE, str(CHART), "--namespace", OPERATOR_NS,
            "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"]
    for v in set_values:
        args += ["--set", v]
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout


@pytest.fixture(scope="session")
def operator_kubeconfig(control_plane, kubectl_bin, cluster_crds) -> Path:
    """A kubeconfig acting as the chart's ServiceAccount, with exactly the chart's RBAC."""
    kubectl(kubectl_bin, control_plane, "create", "namespace", OPERATOR_NS)
    kubectl(kubectl_bin, control_plane, "apply", "-f", "-", stdin=render_rbac())
    return control_plane.kubeconfig_for_service_account(OPERATOR_NS, SERVICE_ACCOUNT)


class OperatorProcess:
    """`grpo operator` as a subprocess; restartable (the crash tests kill it)."""

    def __init__(self, kubeconfig: Path, workdir: Path):
        self.workdir = workdir
        self.metrics_port, self.health_port = free_port(), free_port()
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                    "GRPO_OPERATOR_RESYNC_SECONDS": "1",
                    "GRPO_OPERATOR_METRICS_PORT": str(self.metrics_port),
                    "GRPO_OPERATOR_LIVENESS_ENDPOINT": f"http://127.0.0.1:{self.health_port}/healthz",
                    "GRPO_OPERATOR_TRAINER_TERMINATION_GRACE_SECONDS": "30"}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / f"operator-{self.starts}.log"

    def start(self) -> "OperatorProcess":
        self.starts += 1
        grpo = Path(sys.executable).parent / "grpo"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(grpo), "operator", "--verbose"], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.workdir)
        eventually(self.healthy, timeout=60, what="the operator's /healthz")
        return self

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

    def logs(self) -> str:
        return "".join((self.workdir / f"operator-{i}.log").read_text(errors="replace")
                       for i in range(1, self.starts + 1))

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()


@pytest.fixture(scope="session")
def storage_root(tmp_path_factory) -> Path:
    """file:// storage shared by the tests and the operator (progress.json lives there)."""
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="session")
def operator(operator_kubeconfig, tmp_path_factory):
    op = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("operator")).start()
    yield op
    op.kill(signal.SIGTERM)
