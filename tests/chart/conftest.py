"""Fixtures for the Helm chart's tests: helm (built by scripts/build-controlplane.sh), rendering,
and the real control plane for `helm install` and server-side dry runs."""

from __future__ import annotations

import pytest

# The control plane's session fixtures, shared with tests/controlplane (tests/ is on sys.path:
# the root conftest.py is not in a package).
from controlplane.conftest import control_plane, helm_bin, kubectl_bin  # noqa: F401


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_bin()
