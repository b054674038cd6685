"""Fixtures of the fault-injection tests (issue 12; marker `faults`).

The process helpers are the integration tests' (tests/integration/integration_helpers.py: its
folder goes on sys.path here); the control plane is tests/controlplane's session fixture, as
tests/operator imports it.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

# The real kube-apiserver (tests/ is on sys.path: the root conftest.py is not in a package).
from controlplane.conftest import admin_client, control_plane, kubectl_bin, namespace  # noqa: E402,F401
from faults_helpers import S3Process, versitygw_binary  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random-init Qwen3 model and its tokenizer (what `grpo model tiny` writes)."""
    from grpo_rollout.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def train_data(tmp_path_factory) -> Path:
    """The quickstart task's training parquet (verl layout), small."""
    from grpo_rollout.quickstart_data import write_quickstart_dataset
    train, _ = write_quickstart_dataset(tmp_path_factory.mktemp("quickstart-data"), n_train=64, n_val=4, seed=0)
    return train


@pytest.fixture
def token() -> str:
    return secrets.token_hex(16)


@pytest.fixture
def s3(tmp_path):
    """A versitygw server of this test's own, which the test may stop and start again."""
    if not os.access(versitygw_binary(), os.X_OK):
        msg = f"{versitygw_binary()} not built; run scripts/build-s3.sh"
        if os.environ.get("GRPO_REQUIRE_S3"):
            pytest.fail(f"{msg} (GRPO_REQUIRE_S3 is set)", pytrace=False)
        pytest.skip(msg)
    server = S3Process(tmp_path / "s3").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def grpojob_crd(control_plane, kubectl_bin):
    """The generated GRPOJob CRD, applied to this session's control plane and Established."""
    import subprocess
    crd = Path(__file__).resolve().parents[2] / "crds" / "grpojob.yaml"
    for args in (["apply", "--server-side", "-f", str(crd)],
                 ["wait", "--for=condition=Established", "crd/grpojobs.grpo.dev", "--timeout=60s"]):
        out = subprocess.run([kubectl_bin, "--kubeconfig", str(control_plane.kubeconfig), *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    return crd
