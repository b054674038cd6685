#!/usr/bin/env bash
# Issue 14's GPU benchmarks in one go (bench/h200_bench.py does the work; bench/RESULTS.md has
# the numbers). Each phase runs in its own process under its own timeout, bounded by an overall
# deadline, so one failure loses only its own numbers. Results: $OUT/results.jsonl (one JSON
# object per result) and $OUT/log.txt.
#
#   bash bench/h200_run.sh                     # every phase
#   bash bench/h200_run.sh build train step    # some phases (build first: the others need it)
#   TINY=1 bash bench/h200_run.sh              # CPU check at tiny sizes
#
# Env: OUT (default /tmp/grpo-bench-out), DEADLINE_S (default 570), BENCH_ARGS_<phase>.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/grpo-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/api:$PWD/trainer_image:$PWD/rollout_image:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-570}
W=${WORKDIR:-/tmp/grpo-bench}
TINY_FLAG=${TINY:+--tiny}
exec > >(tee -a "$OUT/log.txt") 2>&1

if [ -d .whl ] && [ -z "${TINY:-}" ]; then
  # Missing on the device image (or too old for the committed stubs): carried as wheels.
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH" || echo "wheel install failed"
fi
echo "=== env $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
$PY - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for m in ("torch", "transformers", "grpc", "google.protobuf", "pydantic", "pyarrow", "pebble", "trl", "datasets", "accelerate"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(m, "MISSING", type(exc).__name__, exc)
EOF

phase_timeout() {  # the phase's own limit, cut to what the deadline leaves
  local want=$1 left=$(( DEADLINE_S - ($(date +%s) - START) ))
  (( left < want )) && want=$left
  echo $want
}

run() {  # run NAME LIMIT_S MIN_S ARGS...: skipped when the deadline leaves less than MIN_S
  local name=$1 limit=$2 min=$3; shift 3
  local t; t=$(phase_timeout "$limit")
  if (( t < min )); then echo "=== SKIP $name: the deadline leaves ${t}s (< ${min}s)"; return; fi
  echo "=== $name (timeout ${t}s): $*"
  local s=$(date +%s)
  timeout -k 15 "$t" $PY bench/h200_bench.py "$@" $TINY_FLAG --workdir "$W" --results "$OUT/results.jsonl" \
    --log-dir "$OUT" 2>&1 | grep --line-buffered -v -E 'it/s\]|s/it\]|Loading weights|Writing model shards'
  echo "=== $name rc=$? in $(( $(date +%s) - s ))s (elapsed $(( $(date +%s) - START ))s)"
}

PHASES=${*:-build train gen-baseline gen step sync storage trl}
for phase in $PHASES; do
  extra_var="BENCH_ARGS_${phase//-/_}"
  extra=${!extra_var:-}
  case $phase in
    build)        run build 150 60 build $extra ;;
    train)        run train 200 60 train --max-tokens 16384,24576 --warmup 1 --steps 3 $extra ;;
    train-compile) run train-compile 200 100 train --compile --max-tokens 16384 --warmup 2 --steps 3 $extra ;;
    gen-baseline) run gen-baseline 90 40 gen --variant baseline --prompts 8 --gen-tokens 128 $extra ;;
    gen)          run gen 110 50 gen --variant current --reps 2 $extra ;;
    step)         run step 260 120 step --max-tokens 24576 --warmup 1 --steps 2 $extra ;;
    sync)         run sync 150 60 sync --sync-variants fp32,bf16-dedup --reps 1 $extra ;;
    storage)      run storage 60 20 storage --reps 5 $extra ;;
    trl)          run trl 200 95 trl --warmup 1 --steps 1 $extra ;;
    *) echo "unknown phase $phase" ;;
  esac
done
echo "=== all done in $(( $(date +%s) - START ))s"
$PY - "$OUT/results.jsonl" <<'EOF'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])]
except FileNotFoundError:
    rows = []
for r in rows:
    b = r["bench"]
    if b == "train":
        print(f"train T={r['max_tokens_per_gpu']}: {r['train_s']:.2f}s (ref {r['ref_s']:.2f} upd {r['update_s']:.2f}) "
              f"{r['tokens_per_s']:.0f} tok/s MFU {r['mfu']:.3f} HFU {r['hfu']:.3f} peak {r['peak_tflops']:.0f}TF mem {r['max_mem_gb']}")
    elif b == "gen":
        print(f"gen {r['variant']} batch {r['batch']}: {r['sequences']}x{r['max_tokens']} median {r['median_s']:.2f}s "
              f"{r['tokens_per_s']:.0f} tok/s step {r['step_ms']:.1f}ms est 256x512 {r['est_workload_s']:.1f}s")
    elif b == "step":
        print("step: " + ", ".join(f"{k[7:]}={v:.2f}" for k, v in r.items() if k.startswith("median_") and isinstance(v, float)))
    elif b == "sync":
        print(f"sync {r['payload']}: {r['gbytes']:.2f}GB {r['seconds']:.2f}s {r['gbps']:.2f}GB/s")
    elif b == "storage":
        print(f"storage: total {r['median_total_s']:.3f}s shard {r['median_rollout_shard_mb']:.1f}MB")
    elif b == "trl":
        print(f"trl: steps {[round(x, 2) for x in r['steps_s']]} median {r['median_step_s']}")
    elif b == "sync_cpu_costs":
        print(f"sync cpu/512MB bucket: pack {r['pack_s']:.2f} tobytes {r['tobytes_s']:.2f} sha {r['sha256_s']:.2f}s")
    else:
        print(json.dumps(r)[:300])
EOF
