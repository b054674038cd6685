#!/usr/bin/env bash
# README command 2: install what is needed (once per machine, cached) and run the whole suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -x
set -euo pipefail
cd "$(dirname "$0")/.."
# Real Kubernetes control plane and node (kubelet, scheduler, CoreDNS) and S3 server, built
# from Go modules (cached; rebuilt on pin change). Cold, these builds take ~14 min of both cores,
# while the venv, the node's Debian packages and the e2e images (cached by content) mostly wait
# on downloads and the disk: the two run side by side (the Go toolchain is the machine's own).
( ./scripts/build-controlplane.sh && ./scripts/build-s3.sh ) &
go_builds=$!
venv=$(./scripts/setup.sh | tail -n 1)
export PATH="$venv/bin:$PATH"
./scripts/install-node-packages.sh
# The e2e images (scripts/build-images.sh, cached by content: ~9 min after a source change) are
# built and imported into the node's containerd cache (~6 min) in the background while the other
# tests run; tests/e2e waits for them. A failure there only costs
# time: the e2e fixtures build and import what is missing and say what failed.
preimport_log=${GRPO_CACHE:-$HOME/.cache/grpo-operator}/preimport.log
workers=()
if [ $# -eq 0 ]; then
  mkdir -p "$(dirname "$preimport_log")"
  python tests/e2e/preimport.py >"$preimport_log" 2>&1 &
  preimport=$!
  trap 'kill "$preimport" 2>/dev/null || true' EXIT
  # The whole suite on two workers: tests/e2e (pod starts and restarts) beside the other tests;
  # tests/conftest.py hands out one module at a time (its own xdist scheduler), e2e as one unit,
  # e2e first and unit last.
  # Measured: pytest 29-31 min on two workers against 52-58 min serial (README).
  workers=(-n "${GRPO_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder)
fi
wait "$go_builds" || { echo "error: the control plane or S3 server build failed (above)" >&2; exit 1; }
# Prometheus (Debian's package) evaluates the dashboards' queries; the tests run the binary
# themselves, so the package's service must not start: a policy-rc.d answering 101 ("no daemons")
# covers the install where the machine has none (without systemd, invoke-rc.d would start it).
install_prometheus() {
  local policy=/usr/sbin/policy-rc.d created="" rc=0
  [ -e "$policy" ] || { printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created=1; }
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } || rc=$?
  [ -z "$created" ] || rm -f "$policy"
  return "$rc"
}
command -v prometheus >/dev/null || install_prometheus \
  || echo "warning: could not install prometheus (the dashboard test will fail)" >&2
export GRPO_REQUIRE_CONTROLPLANE=1 GRPO_REQUIRE_S3=1 GRPO_REQUIRE_PROMETHEUS=1 GRPO_REQUIRE_E2E=1
# The slowest tests are listed (the suite has a time budget: keep an eye on them); every test's
# time is kept in the cache's last-run.xml (JUnit XML) for finding what to make faster.
python -m pytest -ra --durations=25 --junitxml="${GRPO_CACHE:-$HOME/.cache/grpo-operator}/last-run.xml" "${workers[@]}" "$@"
