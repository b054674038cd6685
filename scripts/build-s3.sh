#!/usr/bin/env bash
# Builds the S3-compatible server the storage tests run against: versitygw (Apache-2.0; its
# posix backend serves a plain directory) from the Go module proxy, into
# ${GRPO_CACHE:-~/.cache/grpo-operator}/bin/versitygw. MinIO is AGPL and is never used.
# A stamp (the pinned version and this script's hash) makes a re-run a no-op until the pin
# changes; --force rebuilds anyway.
set -euo pipefail
cache=${GRPO_CACHE:-$HOME/.cache/grpo-operator}
bin=$cache/bin

VERSITYGW_VERSION=v1.8.0   # tests/conftest.py's s3_server fixture runs this binary

stamp=$( { echo "$VERSITYGW_VERSION"; cat "$0"; } | sha256sum | cut -d' ' -f1)
if [ "${1:-}" != --force ] && [ -x "$bin/versitygw" ] && [ "$(cat "$bin/.versitygw.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "versitygw $VERSITYGW_VERSION up to date in $bin"
  exit 0
fi
mkdir -p "$bin"
rm -f "$bin/.versitygw.stamp"

# versitygw's go.mod has no replace directives, so `go install pkg@version` builds exactly the
# released module graph (go.sum verified against the checksum database). Static, stripped.
t0=$SECONDS
echo "== building versitygw $VERSITYGW_VERSION (a cold build takes several minutes)"
CGO_ENABLED=0 GOBIN=$bin go install -trimpath -ldflags "-s -w" \
  "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION"
echo "== versitygw: $((SECONDS - t0))s"
echo "$stamp" > "$bin/.versitygw.stamp"
