#!/usr/bin/env bash
# Builds, here (network: package registries only), the two carries that the GPU benchmark calls
# need, into the git-ignored .whl/ and .vchunks/ at the repo root:
#   .whl/      wheels that bench/h200_run.sh installs with `pip install --no-index --no-deps
#              --target /tmp/site .whl/*.whl` (packages the device image lacks or has too old).
#   .vchunks/  vLLM 0.26.0 + its minimal dependencies as a trimmed site/, tar.xz, split into three
#              parts p00 p01 p02, one part per device call, unpacked there with
#              `cat ~/vs/p0* | tar -xJ -C ~` (-> ~/site). p00 (40 MB) fits one call beside .whl/
#              (17 MB) and the tree (~8 MB): the first call installs the wheels and builds the model
#              while bringing p00; p01 and p02 (< 50 MB each) leave a call room for the tree.
# Recipe and the reasons for the choices: ../shared/notes/vllm-on-device.md and bench/RESULTS.md
# ("H200: vLLM for real").
#
#   bash bench/prepare_device_carry.sh            # both (each skipped when already built)
#   bash bench/prepare_device_carry.sh whl        # only .whl/
#   bash bench/prepare_device_carry.sh vchunks    # only .vchunks/
#   FORCE=1 bash bench/prepare_device_carry.sh    # rebuild even if the keys match
#   CLEAN=1 bash bench/prepare_device_carry.sh    # then delete the build dir and the stand-in venv
#
# Idempotent: each carry records a key (the pinned versions and the recipe) and is skipped when the
# key matches and its files check out. Build dirs live under /tmp, never in the repo.
# Cost here (2 busy cores): downloads ~4.5 GB the first time (the stand-in venv's torch is PyPI's
# cu130 build), `tar -cJ` ~7 min.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

# ---- pins -----------------------------------------------------------------------------------
PY312=${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python}  # the device runs CPython 3.12 (3.12.3)
BUILD=${BUILD:-/tmp/grpo-carry}
VENV=${VENV:-/tmp/v312}       # CPU stand-in for the device image, only for the import test

# .whl: what the project's code and the benches import that the device image lacks (KINDS.md's
# package list) or has too old. grpcio/protobuf: the committed stubs need >=1.85.1 / >=7.35.1.
# pydantic 2.14.4 pins pydantic-core 2.50.5 and needs typing_extensions>=4.16. datasets 4.7.0 pins
# dill<0.4.1 and multiprocess<0.70.19. cryptography (+cffi, pycparser): grpo_operator.pki, used by
# bench/tls_weight_sync.py (TLS on the weight path). Not carried, being on the image: pandas,
# xxhash, fsspec, huggingface-hub, httpx, requests, accelerate, psutil, jinja2, pyyaml,
# prometheus-client, tqdm, safetensors. Not carried: math-verify (only the "math" reward; the
# benches use gsm8k's).
WHL_PINS=(
  grpcio==1.85.3 protobuf==7.36.2 pebble==5.2.3
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0
  trl==1.16.0 datasets==4.7.0 multiprocess==0.70.18 dill==0.4.0
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
)
WHL_MAX_MB=25

# .vchunks: vLLM 0.26.0 (the last release that pins the device's torch 2.11.0) and the minimal
# set the import test needs (the note's list, ../shared/notes/vllm-0.26-reqs.txt), plus
# typing_extensions so that the site's pydantic (>=4.16) does not depend on .whl. Never torch,
# transformers, numpy, triton or anything else the image has: installed with --no-deps.
VLLM_PINS=(
  vllm==0.26.0
  annotated-types==0.8.0 apache-tvm-ffi==0.1.10 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2
  cbor2==6.3.0 compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1 fastapi==0.136.3
  httpcore2==2.16.2 httpx2==2.16.2 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 lark==1.2.2
  llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3 msgspec==0.23.0 openai==3.57.0
  openai-harmony==0.0.8 outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1
  pydantic==2.14.4 pydantic-core==2.50.5 python-json-logger==4.2.0 pyzmq==27.3.0
  setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5
  typing-inspection==0.4.5 watchfiles==1.3.0 xgrammar==0.2.7
  typing_extensions==4.16.0
)
# Not needed for dense bf16 models on an H200 (the note, section 2/4): FA2 (FA3 is used on SM90),
# the Rust front end, Blackwell FMHA and DeepGEMM. 698 -> ~384 MiB unpacked.
TRIM=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm)
PARTS=3
FIRST_PART_MB=40   # beside .whl/ and the tree within a call's 64 MiB carry
PART_MAX_MB=50
XZ_LEVEL=-6

# The stand-in venv: torch 2.11.0 (PyPI's is +cu130 like the device's; the CPU index is tried
# first) plus the image's packages that vLLM imports, at the device's versions where known.
# numba unpinned: pip picks one that accepts numpy 2.5 (vLLM's numba==0.65.0 wants numpy<2.4).
# accelerate..xxhash: what trl and datasets need from the image (for the .whl import test).
VENV_PINS=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 transformers==5.17.0 numpy==2.5.2
  tokenizers==0.23.2 safetensors==0.8.0 accelerate==1.15.0 pyarrow==25.0.1 numba regex psutil sentencepiece requests
  tqdm py-cpuinfo "protobuf<7" aiohttp prometheus-client pillow tiktoken filelock pyyaml six
  "setuptools<81" einops cloudpickle ninja msgpack anyio httpx h11 httpcore jinja2 rich click uvloop
  annotated-doc pandas xxhash "fsspec[http]<=2026.2.0")
# The image has no pydantic, but a new typer (a transformers dependency) pulls it in: removed after.
VENV_NOT=(pydantic pydantic-core annotated-types typing-inspection)

# cp312 manylinux x86_64 wheels; pip matches platform tags exactly, so name each glibc level
# (vLLM 0.22+ is 2_28, llguidance 2_31, cryptography 2_34).
PLATFORMS=()
for t in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
         manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do PLATFORMS+=(--platform "${t}_x86_64"); done
download() {  # download DEST PIN...: one wheel per pin, no dependencies
  local dest=$1; shift
  mkdir -p "$dest"
  nice "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$dest" "$@"
}
key_of() { printf '%s\n' "$@" | sha256sum | cut -c1-16; }
mb() { stat -c %s "$@" | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }

# Every pin must match exactly one downloaded wheel, and no wheel may be left over (two versions
# of one name stop the whole install on the device).
check_wheels() {  # check_wheels DIR PIN...
  local dir=$1; shift
  "$PY312" - "$dir" "$@" <<'EOF'
import pathlib, re, sys
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {}
for w in pathlib.Path(sys.argv[1]).glob("*.whl"):
    name, ver = w.name.split("-")[:2]
    have.setdefault(norm(name), []).append(ver)
want = dict(p.split("==") for p in sys.argv[2:])
bad = [f"{n}: want {v}, have {have.get(norm(n))}" for n, v in want.items() if have.get(norm(n)) != [v]]
bad += [f"extra wheel {n} {v}" for n, v in have.items() if n not in {norm(k) for k in want}]
if bad:
    sys.exit("wheel set mismatch:\n  " + "\n  ".join(bad))
EOF
}

# ---- 1. .whl ---------------------------------------------------------------------------------
# Installed as h200_run.sh installs them, then imported with the project's modules that need
# them, in the stand-in venv (section 2; made here if missing). WHL_TEST=0 skips the test.
whl_test() {  # whl_test DIR
  if [ "${WHL_TEST:-1}" = 0 ]; then echo "   (WHL_TEST=0: .whl import test skipped)"; return; fi
  make_venv
  local t="$BUILD/whl-site"
  rm -rf "$t"
  nice "$VENV/bin/pip" install -q --no-index --no-deps --no-compile --no-cache-dir --target "$t" "$1"/*.whl
  (cd /tmp && PYTHONPATH="$t:$ROOT/api:$ROOT/trainer_image:$ROOT/rollout_image:$ROOT/operator" \
    nice "$VENV/bin/python" -c '
import importlib
for m in ("grpc", "google.protobuf", "pydantic", "pebble", "trl", "datasets", "multiprocess", "dill",
          "cryptography.x509", "grpo_api.spec", "grpo_api.rpc", "grpo_operator.pki", "grpo_trainer.weight_sync",
          "grpo_rollout.serve", "grpo_rollout.rewards.pool", "trl.trainer.grpo_trainer"):
    mod = importlib.import_module(m)
import grpc, google.protobuf, pydantic, trl, datasets
print("whl import test OK: grpc", grpc.__version__, "protobuf", google.protobuf.__version__, "pydantic",
      pydantic.__version__, "trl", trl.__version__, "datasets", datasets.__version__)
')
  rm -rf "$t"
}

build_whl() {
  local key; key=$(key_of "${WHL_PINS[@]}")
  if [ -z "${FORCE:-}" ] && [ "$(cat .whl/KEY 2>/dev/null)" = "$key" ] && check_wheels .whl "${WHL_PINS[@]}" 2>/dev/null; then
    echo "== .whl: up to date (key $key)"; return
  fi
  echo "== .whl: downloading ${#WHL_PINS[@]} wheels"
  rm -rf "$BUILD/whl"
  download "$BUILD/whl" "${WHL_PINS[@]}"
  check_wheels "$BUILD/whl" "${WHL_PINS[@]}"
  local size; size=$(mb "$BUILD"/whl/*.whl)
  if awk -v s="$size" -v m="$WHL_MAX_MB" 'BEGIN {exit !(s > m)}'; then echo "== .whl: ${size} MiB > ${WHL_MAX_MB}" >&2; exit 1; fi
  whl_test "$BUILD/whl"
  rm -rf .whl && mkdir -p .whl   # replaced only once the new set passed
  cp "$BUILD"/whl/*.whl .whl/
  printf '%s\n' "${WHL_PINS[@]}" > .whl/MANIFEST.txt
  echo "$key" > .whl/KEY   # last: marks the carry complete
}

# ---- 2. .vchunks -----------------------------------------------------------------------------
make_venv() {  # the device image's stand-in, for the CPU import test
  local key; key=$(key_of "${VENV_PINS[@]}" "${VENV_NOT[@]}")
  [ -f "$VENV/.standin-$key" ] && return
  echo "== venv $VENV (torch 2.11.0 etc.; large download the first time)"
  [ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -c 'import torch' 2>/dev/null \
    || nice "$VENV/bin/pip" install -q --no-cache-dir --retries 0 --timeout 15 \
         --index-url https://download.pytorch.org/whl/cpu torch==2.11.0 2>/dev/null \
    || echo "   (CPU index unreachable: PyPI's torch 2.11.0, cu130, ~3.5 GB with its CUDA libraries)"
  nice "$VENV/bin/pip" install -q --no-cache-dir "${VENV_PINS[@]}"
  "$VENV/bin/pip" uninstall -q -y "${VENV_NOT[@]}"
  touch "$VENV/.standin-$key"
}

# The modules a bench run reaches before the engine starts: the LLM entry point, engine core and
# client, both executors, the V1 and V2 GPU workers/runners and samplers, FA (3) and Triton
# attention, the dense models, the loader, torch.compile's backend, the adapter's TokensPrompt and
# TRL's weight-transfer client. Lazy imports inside load_model are not covered (FlashInfer's sampler
# was one: VLLM_USE_FLASHINFER_SAMPLER=0, which h200_run.sh sets).
IMPORT_TEST='
import importlib, vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
mods = """vllm.v1.engine.core vllm.v1.engine.core_client vllm.v1.engine.llm_engine
vllm.v1.executor vllm.v1.executor.multiproc_executor vllm.v1.executor.uniproc_executor
vllm.v1.worker.gpu_worker vllm.v1.worker.gpu_model_runner vllm.v1.worker.gpu.model_runner
vllm.v1.worker.gpu.sample.sampler vllm.v1.sample.sampler vllm.v1.sample.ops.topk_topp_sampler
vllm.v1.attention.backends.flash_attn vllm.v1.attention.backends.triton_attn
vllm.model_executor.models.qwen3 vllm.model_executor.models.qwen2 vllm.model_executor.models.llama
vllm.model_executor.model_loader vllm.compilation.backends vllm.entrypoints.llm
vllm.distributed.weight_transfer.nccl_engine""".split()
for m in mods:
    importlib.import_module(m)
print("import test OK: vllm", vllm.__version__, "from", vllm.__file__, "-", len(mods) + 3, "imports")
'
import_test() {  # import_test SITE
  (cd /tmp && PYTHONPATH="$1" VLLM_USE_FLASHINFER_SAMPLER=0 nice "$VENV/bin/python" -c "$IMPORT_TEST")
}
# Here, without a GPU, vLLM picks no CUDA platform and its kernel libraries cannot load (they need
# libcuda.so.1, the driver). So check instead that every other NEEDED library of every .so in the
# site resolves against torch 2.11's CUDA 13 libraries (which torch preloads on the device) and the
# site itself.
so_check() {  # so_check SITE
  local sp; sp=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local lp; lp=$( { ls -d "$sp"/torch/lib "$sp"/nvidia/*/lib; find "$1" -name '*.so*' -printf '%h\n'; } | sort -u | paste -sd:)
  local missing; missing=$(find "$1" -name '*.so*' -type f | while read -r f; do
    LD_LIBRARY_PATH=$lp ldd "$f" 2>&1 | grep 'not found' | grep -v 'libcuda\.so\.1 ' | sed "s|^|  ${f#"$1"/}: |" || true; done)
  if [ -n "$missing" ]; then echo "unresolved libraries:"$'\n'"$missing" >&2; exit 1; fi
  echo "so check OK: $(find "$1" -name '*.so*' -type f | wc -l) shared objects, all NEEDED found but libcuda.so.1"
}

build_vchunks() {
  local key; key=$(key_of "${VLLM_PINS[@]}" "${TRIM[@]}" "$PARTS" "$FIRST_PART_MB" "$XZ_LEVEL")
  if [ -z "${FORCE:-}" ] && [ "$(cat .vchunks/KEY 2>/dev/null)" = "$key" ] \
     && (cd .vchunks && sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1); then
    echo "== .vchunks: up to date (key $key)"; return
  fi
  local vb="$BUILD/v"
  if [ "$(cat "$vb/wheels.key" 2>/dev/null)" != "$(key_of "${VLLM_PINS[@]}")" ]; then
    echo "== .vchunks: downloading ${#VLLM_PINS[@]} wheels (~311 MiB)"
    rm -rf "$vb/whl"
    download "$vb/whl" "${VLLM_PINS[@]}"
    check_wheels "$vb/whl" "${VLLM_PINS[@]}"
    key_of "${VLLM_PINS[@]}" > "$vb/wheels.key"
  fi
  echo "== .vchunks: site/ (--no-deps --no-compile --target), trim"
  rm -rf "$vb/site" "$vb/v.tar.xz"
  nice "$PY312" -m pip install -q --no-deps --no-compile --no-index --target "$vb/site" "$vb"/whl/*.whl
  for p in "${TRIM[@]}"; do rm -rf "${vb:?}/site/$p"; done
  find "$vb/site" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$vb/site"

  make_venv
  import_test "$vb/site"
  so_check "$vb/site"
  find "$vb/site" -name __pycache__ -prune -exec rm -rf {} +   # the test wrote some

  echo "== .vchunks: tar -cJ (several minutes on 2 cores)"
  # Top folder site/: the device unpacks with `tar -xJ -C ~`. Fixed owner and order: the same
  # inputs give the same listing.
  (cd "$vb" && XZ_OPT="$XZ_LEVEL -T2" nice tar --sort=name --owner=0 --group=0 --numeric-owner -cJf v.tar.xz site)
  xz -t "$vb/v.tar.xz"
  rm -rf .vchunks && mkdir -p .vchunks
  head -c $(( FIRST_PART_MB * 1000 * 1000 )) "$vb/v.tar.xz" > .vchunks/p00
  tail -c +$(( FIRST_PART_MB * 1000 * 1000 + 1 )) "$vb/v.tar.xz" > "$vb/rest"
  split -n $(( PARTS - 1 )) -d --numeric-suffixes=1 "$vb/rest" .vchunks/p
  rm "$vb/rest"
  for f in .vchunks/p*; do
    if (( $(stat -c %s "$f") >= PART_MAX_MB * 1000 * 1000 )); then echo "$f is >= $PART_MAX_MB MB" >&2; exit 1; fi
  done
  # The parts must put back the tarball exactly.
  cmp <(cat .vchunks/p*) "$vb/v.tar.xz"
  (cd .vchunks && sha256sum p* > SHA256SUMS)
  { echo "# vLLM site for the device: cat ~/vs/p0* | tar -xJ -C ~  (-> ~/site; PYTHONPATH=~/site)"
    echo "# trimmed: ${TRIM[*]}"
    printf '%s\n' "${VLLM_PINS[@]}"; } > .vchunks/MANIFEST.txt
  echo "$key" > .vchunks/KEY   # last: marks the carry complete
}

# ---- main ------------------------------------------------------------------------------------
WHAT=${*:-whl vchunks}
for w in $WHAT; do
  case $w in
    whl) build_whl ;;
    vchunks) build_vchunks ;;
    *) echo "unknown target $w (whl, vchunks)" >&2; exit 2 ;;
  esac
done

echo "== summary"
if [ -f .whl/KEY ]; then
  echo ".whl: $(ls .whl/*.whl | wc -l) wheels, $(mb .whl/*.whl) MiB"
  for f in .whl/*.whl; do printf '  %8s  %s\n' "$(stat -c %s "$f")" "${f#.whl/}"; done
fi
if [ -f .vchunks/KEY ]; then
  echo ".vchunks: $(grep -vc '^#' .vchunks/MANIFEST.txt) wheels, $(mb .vchunks/p*) MiB in $(ls .vchunks/p* | wc -l) parts"
  for f in .vchunks/p*; do printf '  %10s B  %s\n' "$(stat -c %s "$f")" "$f"; done
fi
if [ -n "${CLEAN:-}" ]; then rm -rf "$BUILD" "$VENV"; echo "removed $BUILD $VENV"; fi
