"""Fixtures for the operator's control-plane tests: the real control plane (tests/controlplane),
the CRD, the chart's RBAC bound to the operator's ServiceAccount, and `grpo operator` running
as a subprocess with that account's token, as it runs in the cluster.

There is no kubelet: the tests play it by patching pod status (phase, container states), and
the real Job, ReplicaSet and garbage-collector controllers do the rest.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

# The control plane's session fixtures, shared with tests/controlplane (tests/ is on sys.path:
# the root conftest.py is not in a package).
from controlplane.cluster import retry
from controlplane.conftest import admin_client, control_plane, kubectl_bin, namespace  # noqa: F401
from operator_helpers import kubectl, wait_for_garbage_collector
from operator_process import (KUEUE_WORKLOAD_CRD, MONITORING_CRDS, OPERATOR_NS, POD_GROUP_CRD, REPO, SERVICE_ACCOUNT,
                              OperatorProcess, render_rbac)


@pytest.fixture(scope="session")
def cluster_crds(control_plane, kubectl_bin):
    """The GRPOJob CRD, the monitoring stubs, scheduler-plugins' PodGroup and Kueue's Workload
    CRDs (cut down: tests/operator/crds), Established."""
    kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(REPO / "crds" / "grpojob.yaml"))
    kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(MONITORING_CRDS))
    kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(POD_GROUP_CRD))
    kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(KUEUE_WORKLOAD_CRD))
    # kubectl wait errors out (instead of waiting) while a new CRD's status.conditions is still null.
    retry(lambda: kubectl(kubectl_bin, control_plane, "wait", "--for=condition=Established", "--timeout=60s",
                          "crd/grpojobs.grpo.dev", "crd/podmonitors.monitoring.coreos.com",
                          "crd/servicemonitors.monitoring.coreos.com", "crd/podgroups.scheduling.x-k8s.io",
                          "crd/workloads.kueue.x-k8s.io"))
    wait_for_garbage_collector(control_plane, kubectl_bin)


@pytest.fixture(scope="session")
def operator_kubeconfig(control_plane, kubectl_bin, cluster_crds) -> Path:
    """A kubeconfig acting as the chart's ServiceAccount, with exactly the chart's RBAC."""
    kubectl(kubectl_bin, control_plane, "create", "namespace", OPERATOR_NS)
    kubectl(kubectl_bin, control_plane, "apply", "-f", "-", stdin=render_rbac())
    return control_plane.kubeconfig_for_service_account(OPERATOR_NS, SERVICE_ACCOUNT)


@pytest.fixture(scope="session")
def storage_root(tmp_path_factory) -> Path:
    """file:// storage shared by the tests and the operator (progress.json lives there)."""
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="session")
def operator(operator_kubeconfig, tmp_path_factory):
    op = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("operator")).start()
    yield op
    op.kill(signal.SIGTERM)
