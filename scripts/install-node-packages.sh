#!/usr/bin/env bash
# Installs the Debian packages that the e2e tests' real node and image builds need (tests/e2e):
# containerd + runc + the CNI plugins run pods; iptables/conntrack are what the kubelet and the
# CNI bridge plugin call; buildah builds the Dockerfiles without a daemon; mmdebstrap makes
# the small local base image; chromium and chromium-driver are the headless browser of
# tests/integration/test_ui.py (`grpo ui`; no browser download). A no-op once everything is
# there. Nothing is started: containerd runs from the test fixture's own config, and the
# policy-rc.d below keeps Debian's maintainer scripts from starting its service where there is
# no systemd.
set -euo pipefail
packages=(containerd runc containernetworking-plugins iptables conntrack buildah mmdebstrap
          uidmap fuse-overlayfs busybox-static chromium chromium-driver)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && { echo "node packages present"; exit 0; }
policy=/usr/sbin/policy-rc.d created=""
[ -e "$policy" ] || { printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created=1; }
rc=0
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } || rc=$?
[ -z "$created" ] || rm -f "$policy"
exit "$rc"
