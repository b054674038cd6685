#!/usr/bin/env bash
# README command 1: install what is needed (once per machine) and run the embedded default,
# a real GRPO run on CPU. Extra arguments go to `grpo run`, e.g. --set trainer.totalSteps=10
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(./scripts/setup.sh | tail -n 1)
export PATH="$venv/bin:$PATH"
grpo run examples/quickstart.yaml "$@"
grpo report outputs/quickstart/tiny_qwen3_grpo
