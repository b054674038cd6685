"""The committed gRPC stubs are exactly what scripts/gen-proto.sh generates from rollout.proto."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "api" / "grpo_api" / "proto"
STUBS = [f"{name}{suffix}" for name in ("rollout", "reward", "sandbox") for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def test_committed_stubs_match_the_proto(tmp_path):
    subprocess.run([str(REPO / "scripts" / "gen-proto.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    stale = [name for name in STUBS if (tmp_path / name).read_text() != (PROTO_DIR / name).read_text()]
    assert not stale, f"{stale} are out of date with rollout.proto: run scripts/gen-proto.sh"


def test_stubs_import_as_part_of_the_package():
    # protoc writes `import rollout_pb2`; the script makes it package-relative.
    assert "from . import rollout_pb2" in (PROTO_DIR / "rollout_pb2_grpc.py").read_text()
    from grpo_api.proto import rollout_pb2_grpc
    assert hasattr(rollout_pb2_grpc, "RolloutStub")
