"""Fixtures for the Helm chart's tests: helm (built by scripts/build-controlplane.sh), rendering,
and the real control plane for `helm install` and server-side dry runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

# The control plane's session fixtures, shared with tests/controlplane (tests/ is on sys.path:
# the root conftest.py is not in a package).
from controlplane.conftest import admin_client, control_plane, kubectl_bin, namespace  # noqa: F401
from controlplane.cluster import default_bin_dir

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "grpo-operator"
ALL_VALUES = Path(__file__).parent / "values-all.yaml"
MONITORING_CRDS = Path(__file__).parent / "monitoring-crds.yaml"


@pytest.fixture(scope="session")
def helm() -> str:
    path = default_bin_dir() / "helm"
    if not os.access(path, os.X_OK):
        msg = f"{path} not built; run scripts/build-controlplane.sh"
        if os.environ.get("GRPO_REQUIRE_CONTROLPLANE"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return str(path)


def run(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), input=stdin, capture_output=True, text=True, check=check, timeout=180)


def render(helm: str, *args: str, namespace: str = "grpo-system") -> list[dict]:
    out = run(helm, "template", "grpo", str(CHART), "--namespace", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
