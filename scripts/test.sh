#!/usr/bin/env bash
# README command 2: install what is needed (once per machine, cached) and run the whole suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -x
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(./scripts/setup.sh | tail -n 1)
export PATH="$venv/bin:$PATH"
# Real Kubernetes control plane and S3 server, built from Go modules (cached; rebuilt on pin change).
for build in scripts/build-controlplane.sh scripts/build-s3.sh; do
  [ -x "$build" ] && "$build"
done
export GRPO_REQUIRE_CONTROLPLANE=1 GRPO_REQUIRE_S3=1
python -m pytest -ra "$@"
