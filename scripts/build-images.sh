#!/usr/bin/env bash
# Builds the project's three images (Dockerfile.operator, .trainer, .rollout) for the e2e tests'
# node, with buildah (daemonless, from Debian). The production bases (python slim, pytorch/pytorch,
# vllm/vllm-openai) can't be pulled here, so the Dockerfiles get small local bases through their
# base-image build args instead:
#   localhost/grpo-e2e/python:KEY  Debian bookworm (mmdebstrap) with python3, pip and venv
#   localhost/grpo-e2e/torch:KEY   that plus torch from PyPI (it runs on CPU)
# The rollout image is built with ROLLOUT_EXTRAS=rollout,trainer: the node has no GPU, its pods use
# the hf engine (and colocated jobs' trainer pods run in it). Everything else is exactly what the Dockerfiles do with the wheel they build.
#
# Cached by content: each image's tag is a hash of what it is built from (its base, its
# Dockerfile, pyproject.toml and the source roots), and an image whose tag exists is not
# rebuilt. Storage lives in ${GRPO_CACHE:-~/.cache/grpo-operator}/images (overlay driver);
# older tags of the same images are removed. Prints a JSON object {name: image ref} on the last
# line of stdout (tests/e2e reads it); `pause` is the pods' sandbox image (busybox-static
# sleeping: the kubelet kills sandboxes with SIGKILL). Takes a lock, so concurrent runs build once.
#
#   scripts/build-images.sh                  build what is missing, print the refs
#   scripts/build-images.sh --export REF TAR write image REF as a docker-archive (a file or a FIFO)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${GRPO_CACHE:-$HOME/.cache/grpo-operator}
work=$cache/images
mkdir -p "$work"

DEBIAN_SUITE=bookworm
BASE_PACKAGES=python3,python3-pip,python3-venv,python-is-python3,ca-certificates,passwd
TORCH_VERSION=2.11.0       # the production trainer's and rollout's torch (Dockerfile.trainer; vLLM 0.26.0 pins it)

bah() { buildah --root "$work/storage" --runroot "$work/run" --storage-driver overlay "$@"; }
# The host's CA bundle, mounted into every build step (never stored in an image): where HTTPS
# goes through a proxy with its own CA, pip inside the build must trust what the host trusts.
ca=/etc/ssl/certs/ca-certificates.crt
ca_mount=()
[ -f "$ca" ] && ca_mount=(--volume "$ca:$ca:ro")
# Export only reads an image (buildah locks its storage itself): no need to wait for a build.
if [ "${1:-}" = --export ]; then
  bah push --quiet "$2" "docker-archive:$3:$2" >/dev/null
  exit 0
fi
exec 9>"$work/.lock"
flock 9
exists() { bah inspect --type image "$1" >/dev/null 2>&1; }
hash() { sha256sum | cut -c1-16; }
timed() {  # timed LABEL CMD...: runs CMD with its output on stderr, then says how long it took
  local label=$1 t0=$SECONDS; shift
  echo "== building $label" >&2
  "$@" >&2
  echo "== $label: $((SECONDS - t0))s" >&2
}
# Removes the other tags of NAME (older contents), so the storage doesn't grow with each change.
prune() {
  local name=$1 keep=$2 ref
  for ref in $(bah images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep "^$name:" || true); do
    [ "$ref" = "$keep" ] || bah rmi -f "$ref" >/dev/null 2>&1 || true
  done
}

# --- bases ---------------------------------------------------------------------------------------
python_key=$(echo "$DEBIAN_SUITE $BASE_PACKAGES v1" | hash)
python_base=localhost/grpo-e2e/python:$python_key
build_python_base() {
  local rootfs=$work/rootfs.tar c
  # EXTERNALLY-MANAGED goes: like the production bases, this image *is* the environment pip
  # installs into. Docs and man pages are left out to keep it small.
  mmdebstrap --variant=minbase --include="$BASE_PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
    "$DEBIAN_SUITE" "$rootfs"
  c=$(bah from scratch)
  bah add "$c" "$rootfs" /
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$c"
  bah commit --rm "$c" "$python_base"
  rm -f "$rootfs"
}
exists "$python_base" || timed "$python_base" build_python_base

torch_key=$(echo "$python_key torch==$TORCH_VERSION" | hash)
torch_base=localhost/grpo-e2e/torch:$torch_key
build_torch_base() {
  local c
  c=$(bah from "$python_base")
  bah run --isolation chroot "${ca_mount[@]}" "$c" -- python -m pip install --no-cache-dir "torch==$TORCH_VERSION"
  bah commit --rm "$c" "$torch_base"
}
exists "$torch_base" || timed "$torch_base" build_torch_base
prune localhost/grpo-e2e/python "$python_base"
prune localhost/grpo-e2e/torch "$torch_base"

busybox_version=$(dpkg-query -W -f='${Version}' busybox-static)
pause=localhost/grpo-e2e/pause:$(echo "$busybox_version" | hash)
build_pause() {
  local c
  c=$(bah from scratch)
  bah copy "$c" /bin/busybox /busybox
  bah config --entrypoint '["/busybox", "sleep", "2147483647"]' "$c"
  bah commit --rm "$c" "$pause"
}
exists "$pause" || timed "$pause" build_pause
prune localhost/grpo-e2e/pause "$pause"

# --- the project's images ------------------------------------------------------------------------
# What the wheel stage copies (see .dockerignore), by content.
sources_key=$(cd "$repo" && find pyproject.toml api operator trainer_image rollout_image -type f \
  ! -path '*/__pycache__/*' ! -name '*.py[cod]' ! -path '*.egg-info/*' -print0 \
  | sort -z | xargs -0 sha256sum | hash)
declare -A args=(
  [operator]="PYTHON_BASE=$python_base"
  [trainer]="PYTHON_BASE=$python_base TRAINER_BASE=$torch_base"
  [rollout]="PYTHON_BASE=$python_base ROLLOUT_BASE=$torch_base ROLLOUT_EXTRAS=rollout,trainer"
)
json="\"pause\": \"$pause\""
for name in operator trainer rollout; do
  dockerfile=Dockerfile.$name
  key=$( { echo "$sources_key ${args[$name]}"; cat "$repo/$dockerfile" "$repo/.dockerignore"; } | hash)
  ref=localhost/grpo-e2e/$name:$key
  if ! exists "$ref"; then
    build_args=()
    for a in ${args[$name]}; do build_args+=(--build-arg "$a"); done
    timed "$ref" bah bud --isolation chroot --layers=false --pull=never "${ca_mount[@]}" \
      "${build_args[@]}" -f "$repo/$dockerfile" -t "$ref" "$repo"
  fi
  prune "localhost/grpo-e2e/$name" "$ref"
  json+="${json:+, }\"$name\": \"$ref\""
done
bah rmi --prune >/dev/null 2>&1 || true    # dangling intermediate images
echo "{$json}"
