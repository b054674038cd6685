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
from controlplane.conftest import admin_client, control_plane, kubectl_bin, namespace  # noqa: F401
from operator_helpers import kubectl, wait_for_garbage_collector
from operator_process import OPERATOR_NS, SERVICE_ACCOUNT, OperatorProcess, render_rbac


@pytest.fixture(scope="session")
def cluster_crds(control_plane, kubectl_bin):
    """The control plane came up with the GRPOJob CRD, the monitoring stubs, scheduler-plugins'
    PodGroup and Kueue's Workload CRDs (cut down: tests/operator/crds) Established
    (controlplane.conftest.CRDS); this checks that its garbage collector knows them."""
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
