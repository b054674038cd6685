"""The operator and the GRPOJob CRD's life (issue 22): `kubectl delete crd` doesn't kill the
operator, /healthz says when it serves nothing, and an operator started before the CRD exists
serves GRPOJobs once the CRD is installed. Real control plane, the chart's RBAC; the CRD is
restored (and the garbage collector made to know it again) for the tests after this one."""

from __future__ import annotations

import signal

import pytest

from controlplane.cluster import retry
from operator_helpers import eventually, kubectl, wait_for_garbage_collector
from operator_process import REPO, OperatorProcess
from test_operator_controlplane import Cluster

pytestmark = pytest.mark.controlplane
CRD = "crd/grpojobs.grpo.dev"


def test_the_operator_follows_the_crd_being_deleted_and_installed(admin_client, namespace, storage_root, operator,
                                                                  operator_kubeconfig, control_plane, kubectl_bin,
                                                                  tmp_path):
    k = Cluster(admin_client, namespace, storage_root)
    late = OperatorProcess(operator_kubeconfig, tmp_path, namespaces=namespace)
    try:
        k.create("before")
        eventually(lambda: all(k.children("before").values()), what="the children of a job")

        earlier = len(operator.logs())          # (other tests' jobs may log tracebacks of their own)
        kubectl(kubectl_bin, control_plane, "delete", CRD, "--timeout=120s")
        # The running operator stays up and says it serves nothing.
        eventually(lambda: operator.health() == 503, what="the running operator's /healthz to say 503")
        # An operator started now waits for the CRD, unhealthy meanwhile.
        late.start(wait=False)
        eventually(lambda: late.health() == 503, what="the late operator's /healthz to say 503")

        kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(REPO / "crds" / "grpojob.yaml"))
        retry(lambda: kubectl(kubectl_bin, control_plane, "wait", "--for=condition=Established", "--timeout=60s", CRD))
        eventually(lambda: operator.health() == 200, timeout=60, what="the running operator serving again")
        eventually(lambda: late.health() == 200, timeout=60, what="the late operator serving")

        operator.kill(signal.SIGTERM)          # the late operator alone serves the namespace now
        k.create("after")
        eventually(lambda: all(k.children("after").values()), timeout=60,
                   what="the late operator to create the children of a new job")
        assert k.wait_phase("Pending", "after")["observedGeneration"] == 1
        for log in (operator.logs()[earlier:], late.logs()):
            assert "Traceback" not in log, log[-3000:]
            assert "the GRPOJob CRD (grpojobs.grpo.dev) is not installed" in log
            assert "The GRPOJob CRD is installed: serving GRPOJobs" in log
    finally:
        late.kill(signal.SIGTERM)
        kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(REPO / "crds" / "grpojob.yaml"))
        retry(lambda: kubectl(kubectl_bin, control_plane, "wait", "--for=condition=Established", "--timeout=60s", CRD))
        if operator.proc.poll() is not None:
            operator.start()
    wait_for_garbage_collector(control_plane, kubectl_bin)
