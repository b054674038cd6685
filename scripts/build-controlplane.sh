#!/usr/bin/env bash
# Builds the real Kubernetes control plane used by tests/controlplane from Go modules:
# kube-apiserver and kube-controller-manager (tests/controlplane/k8s), etcd
# (tests/controlplane/etcd) and helm, into ${GRPO_CACHE:-~/.cache/grpo-operator}/bin; and the
# node of tests/e2e: kubelet and kube-scheduler (same wrapper module) and CoreDNS.
# A stamp (hash of the wrapper go.mod/go.sum files and this script) makes a re-run a no-op
# until a pin changes; --force rebuilds anyway. Builds run one after another: each `go build`
# already uses every core, and the machines this runs on are small.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${GRPO_CACHE:-$HOME/.cache/grpo-operator}
bin=$cache/bin
cp=$repo/tests/controlplane

K8S_VERSION=v1.37.2        # must match tests/controlplane/k8s/go.mod
HELM_VERSION=v3.22.0
COREDNS_VERSION=v1.14.7    # tests/e2e's cluster DNS (headless Services)

stamp_inputs=("$cp/k8s/go.mod" "$cp/k8s/go.sum" "$cp/etcd/go.mod" "$cp/etcd/go.sum" "$0")
stamp=$(cat "${stamp_inputs[@]}" | sha256sum | cut -d' ' -f1)
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet helm coredns)

all_present() { for b in "${binaries[@]}"; do [ -x "$bin/$b" ] || return 1; done; }
if [ "${1:-}" != --force ] && all_present && [ "$(cat "$bin/.controlplane.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "control plane binaries up to date in $bin"
  exit 0
fi
mkdir -p "$bin"
rm -f "$bin/.controlplane.stamp"   # written again only when every build has succeeded

# -mod=mod: the committed go.sum is used, missing sums are filled in rather than refused.
# CGO off gives static binaries, as the upstream release builds do. -pgo=off skips the
# profile-guided pass (slow, and default.pgo isn't shipped in module zips anyway).
export CGO_ENABLED=0 GOFLAGS=-mod=mod
buildflags=(-pgo=off -trimpath)

timed() {  # timed LABEL CMD... : runs CMD and prints how long it took
  local label=$1 t0=$SECONDS; shift
  echo "== building $label"
  "$@"
  echo "== $label: $((SECONDS - t0))s"
}

# Without these -X flags /version says v0.0.0-master+$Format:%H$ (hack/lib/version.sh
# sets the same variables in both packages for release builds).
ver=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ver+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=37 -X $pkg.gitTreeState=clean"
done

t_all=$SECONDS
cd "$cp/k8s"
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
  timed "$cmd" go build "${buildflags[@]}" -ldflags "-s -w$ver" -o "$bin/$cmd" "k8s.io/kubernetes/cmd/$cmd"
done
cd "$cp/etcd"
timed etcd go build "${buildflags[@]}" -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3
cd "$repo"
# helm's go.mod has no replace directives, so a plain `go install pkg@version` works.
# The -X flags are what helm's Makefile sets: without them `helm version` says v3.22 and
# `helm template` assumes Kubernetes v1.20 (.Capabilities.KubeVersion, kubeVersion checks)
# instead of the v1.37 of helm's client-go.
hv="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  hv+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=37"
done
timed helm env GOFLAGS= GOBIN="$bin" go install "${buildflags[@]}" -ldflags "-s -w $hv" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"

# coredns' go.mod has no replace directives either.
timed coredns env GOFLAGS= GOBIN="$bin" go install "${buildflags[@]}" -ldflags "-s -w" \
  "github.com/coredns/coredns@$COREDNS_VERSION"

echo "$stamp" > "$bin/.controlplane.stamp"
echo "== control plane built in $((SECONDS - t_all))s into $bin"
