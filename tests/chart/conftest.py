"""Fixtures for the Helm chart's tests: helm (built by scripts/build-controlplane.sh), rendering,
and the real control plane for `helm install` and server-side dry runs."""

from __future__ import annotations

import os

import pytest

# The control plane's session fixtures, shared with tests/controlplane (tests/ is on sys.path:
# the root conftest.py is not in a package).
from controlplane.conftest import control_plane, kubectl_bin  # noqa: F401
from controlplane.cluster import default_bin_dir


@pytest.fixture(scope="session")
def helm() -> str:
    path = default_bin_dir() / "helm"
    if not os.access(path, os.X_OK):
        msg = f"{path} not built; run scripts/build-controlplane.sh"
        if os.environ.get("GRPO_REQUIRE_CONTROLPLANE"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return str(path)
