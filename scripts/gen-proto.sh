#!/usr/bin/env bash
# Generates the Python gRPC stubs of api/grpo_api/proto/{rollout,reward,sandbox}.proto with grpcio-tools (the
# version pinned in pyproject's dev extra) and rewrites their imports to be package-relative
# (protoc writes `import rollout_pb2`, which only works with the folder on sys.path).
# The stubs are committed; tests/api/test_proto_stubs.py regenerates them and diffs.
#
# usage: scripts/gen-proto.sh [OUT_DIR]   (default: api/grpo_api/proto, next to the .proto)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
proto_dir=$repo/api/grpo_api/proto
out=${1:-$proto_dir}
python=${PYTHON:-python3}
mkdir -p "$out"
for name in rollout reward sandbox; do
  "$python" -m grpc_tools.protoc -I "$proto_dir" \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "$proto_dir/$name.proto"
  sed -i "s/^import ${name}_pb2 as ${name}__pb2\$/from . import ${name}_pb2 as ${name}__pb2/" "$out/${name}_pb2_grpc.py"
done
