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
# Env: OUT (default /tmp/grpo-bench-out), DEADLINE_S (default 570), BENCH_ARGS_<phase>, TRAINER_TREE
# (below), VLLM_SITE (a folder holding vLLM 0.26 and its small dependencies, bench/RESULTS.md says
# how it is carried; put first on PYTHONPATH when it exists).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/grpo-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# TRAINER_TREE: another trainer_image (an earlier commit's, carried in the git-ignored .ab/) for an
# A/B of trainer code on the same machine: `git archive REV trainer_image | tar -x -C .ab/base`.
TRAINER_TREE=${TRAINER_TREE:-$PWD/trainer_image}
export PYTHONPATH="$PWD/api:$TRAINER_TREE:$PWD/rollout_image:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
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
VLLM_SITE=${VLLM_SITE:-$HOME/site}
if [ -d "$VLLM_SITE/vllm" ]; then
  # No FlashInfer in the carried site: vLLM 0.26's sampler must not try it (TRL's in-process
  # engine needs this too; grpo_rollout's adapter sets it itself).
  export PYTHONPATH="$VLLM_SITE:$PYTHONPATH" HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
fi
# `grpo` finds its subcommands as entry points (importlib.metadata); the device has the packages
# on PYTHONPATH, not installed, so `grpo run` (fp8-learning) and the `grpo rollout` / `grpo trainer`
# it starts with `python -m grpo_api.cli` would find none: give them a dist-info holding
# pyproject.toml's entry points (skipped where the project is installed, as in its venv).
if ! $PY -c 'import sys; from importlib.metadata import entry_points as e; sys.exit(not e(group="grpo.commands"))' 2>/dev/null; then
  EP_DIR=/tmp/grpo-entry-points
  $PY - "$EP_DIR" <<'EOF' && export PYTHONPATH="$EP_DIR:$PYTHONPATH" || echo "entry points not written"
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"grpo_operator-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) + "\n" for group, eps in groups.items()))
print(f"entry points: {sum(map(len, groups.values()))} in {info}")
EOF
fi
# NVLink multicast stays off on shared hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "=== env $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
$PY - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for m in ("torch", "transformers", "grpc", "google.protobuf", "pydantic", "pyarrow", "pebble", "trl", "datasets", "accelerate", "vllm"):
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
  local name=$1 limit=$2 min=$3 script=${SCRIPT:-bench/h200_bench.py}; shift 3
  local t; t=$(phase_timeout "$limit")
  if (( t < min )); then echo "=== SKIP $name: the deadline leaves ${t}s (< ${min}s)"; return; fi
  echo "=== $name (timeout ${t}s): $*"
  local s=$(date +%s)
  timeout -k 15 "$t" $PY "$script" "$@" $TINY_FLAG --workdir "${RUN_W:-$W}" --results "$OUT/results.jsonl" \
    --log-dir "$OUT" 2>&1 | grep --line-buffered -v -E 'it/s\]|s/it\]|Loading weights|Writing model shards'
  echo "=== $name rc=$? in $(( $(date +%s) - s ))s (elapsed $(( $(date +%s) - START ))s)"
}

# Issue 47 item 5: an MPS server for this command alone (its own pipe directory; the card's compute
# mode and settings are untouched), so that the trainer's and the rollout server's kernels can run
# at the same time instead of in time slices. Only processes started with these variables use it.
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/grpo-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/grpo-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "=== MPS control daemon started"
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control
  sleep 2
  echo "=== MPS stopped; its log:"; tail -n 20 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

PHASES=${*:-build train gen-baseline gen step sync storage trl}
for phase in $PHASES; do
  extra_var="BENCH_ARGS_${phase//-/_}"
  extra=${!extra_var:-}
  case $phase in
    build)        run build 150 60 build $extra ;;
    # Issue 47: model.sharePrompts' attention (flash, fewer queries than keys) against float32,
    # forward and backward, on the workload's shared layout; no model, seconds.
    attention)    run attention 90 20 attention $extra ;;
    train)        run train 200 60 train --max-tokens 16384,24576 --warmup 1 --steps 3 $extra ;;
    train-compile) run train-compile 200 100 train --compile --max-tokens 16384 --warmup 2 --steps 3 $extra ;;
    # Issue 47 item 4: the compiled reference forward per token budget of its own micro-batches
    # (trainer.logProbMaxTokensPerGPU); the first budget is the update's layout (needs build).
    ref-budget)   run ref-budget 240 90 ref --compile --max-tokens 16384,32768,65536,131072 --warmup 1 --steps 3 $extra ;;
    # Issue 34: the fused LM head against the logits, packed against padded micro-batches, and
    # realistic (skewed) lengths with the same tokens per step.
    train-fused)  run train-fused 150 60 train --max-tokens 16384 --heads fused,logits --warmup 1 --steps 2 $extra ;;
    train-packed) run train-packed 150 60 train --max-tokens 16384 --layouts padded,packed --warmup 1 --steps 2 $extra ;;
    # Issue 47: model.sharePrompts (each prompt once per micro-batch) against packed rows, compiled as
    # the trainer runs; the check line is the log-prob difference of each layout against padded rows.
    train-shared) run train-shared 300 120 train --compile --max-tokens 16384 --layouts packed,shared \
                    --warmup 1 --steps 2 $extra ;;
    # Issue 47: what the trainer still holds after empty_cache, where a colocated engine's wake
    # needs it back: the shared layout without checkpointing (held 20 GB more than packed rows in
    # the 12-07 colocated step) with plain segments, then with engine_sleep's expandable segments.
    train-allocator) for a in plain sleep; do run train-allocator-$a 150 60 train --compile --max-tokens 16384 \
                    --layouts shared --warmup 1 --steps 2 --allocator $a \
                    --set spec.model.gradientCheckpointing=false $extra; done ;;
    train-skewed) run train-skewed 150 60 train --lengths skewed --max-tokens 16384 --layouts padded,packed \
                    --warmup 1 --steps 2 $extra ;;
    gen-baseline) run gen-baseline 90 40 gen --variant baseline --prompts 8 --gen-tokens 128 $extra ;;
    gen)          run gen 110 50 gen --variant current --reps 2 $extra ;;
    # The hf engine against a previous one (BENCH_ARGS_hf_check="--previous FILE"), bench/hf_engine_check.py.
    hf-check)     SCRIPT=bench/hf_engine_check.py run hf-check 200 60 $extra ;;
    step)         run step 260 120 step --max-tokens 24576 --warmup 1 --steps 2 $extra ;;
    step-vllm)    run step-vllm 330 150 step --engine vllm --max-tokens 24576 --warmup 2 --steps 2 $extra ;;
    step-async)   run step-async 330 150 step --engine vllm --max-staleness 1 --max-tokens 24576 --warmup 2 --steps 2 $extra ;;
    step-async-mps) mps_start && run step-async-mps 330 150 step --engine vllm --max-staleness 1 --max-tokens 24576 \
                    --warmup 2 --steps 2 --label mps $extra; mps_stop ;;
    # Issue 33 / 30: the same step with LoRA (merged-weight sync), and PPO (gae, a critic).
    step-lora)    run step-lora 330 150 step --engine vllm --max-staleness 1 --max-tokens 24576 --warmup 2 --steps 2 \
                    --label lora-r64 --set model.lora.rank=64 --set model.lora.alpha=128 --set trainer.lr=1e-5 $extra ;;
    step-gae)     run step-gae 330 150 step --engine vllm --max-staleness 1 --max-tokens 24576 --warmup 2 --steps 2 \
                    --label ppo-gae --set algorithm.advEstimator=gae --set critic.lr=1e-5 $extra ;;
    # Qwen3-8B-shaped policy with LoRA and vLLM on one GPU (its own workdir, $W-8b).
    build-8b)     RUN_W=$W-8b run build-8b 200 100 build --shape 8b $extra ;;
    step-8b-lora) RUN_W=$W-8b run step-8b-lora 420 200 step --engine vllm --max-staleness 1 --max-tokens 16384 --warmup 1 \
                    --steps 2 --gpu-memory-utilization 0.3 --label 8b-lora-r64 --set model.lora.rank=64 \
                    --set model.lora.alpha=128 --set trainer.lr=1e-5 $extra ;;
    # Issue 32: the agent loop's tests (token-in/token-out, masks, turn limits) on vLLM.
    agent-loop-vllm) echo "=== agent-loop-vllm"; GRPO_TEST_ENGINE=vllm timeout -k 10 "$(phase_timeout 240)" \
                    $PY -m pytest -x -q --tb=short -p no:cacheprovider tests/rollout/test_agent_loop.py 2>&1 \
                    | grep -v -E "Warning|warn" | tail -150 ;;
    # Issue 32 item 8: the agent loop (4 turns x 128 tokens, a tool call scripted in each) against one
    # 512-token turn, on vLLM (bench/agent_loop_bench.py). Issue 31: an LLM judge on vLLM.
    agent-loop-bench) SCRIPT=bench/agent_loop_bench.py run agent-loop-bench 240 90 $extra ;;
    judge-vllm)   SCRIPT=bench/reward_model_bench.py run judge-vllm 240 90 --judge $extra ;;
    # Issue 33: vLLM's own LoRA against merged weights (bench/vllm_lora_check.py; needs build).
    vllm-lora)    SCRIPT=bench/vllm_lora_check.py run vllm-lora 240 120 $extra ;;
    # Issue 45 items 3 and 8: vLLM with images on a Qwen2.5-VL-3B-shaped model (needs no build).
    vl-vllm)      SCRIPT=bench/vl_vllm_check.py run vl-vllm 420 200 $extra ;;
    # Issue 45: the VL update's micro-batch, images per row against shared, sdpa against varlen vision attention (no vLLM).
    vl-update)    SCRIPT=bench/vl_update_profile.py run vl-update 360 150 $extra ;;
    # BENCH_ARGS_vl_write_job="--shape qwen3-vl-2b": another model (bench/vl_vllm_check.py SHAPES).
    # vl-job writes the model and job alone (a call of its own for a large shape); vl-step then uses them.
    vl-job)       RUN_W=$W-vl SCRIPT=bench/vl_vllm_check.py run vl-write-job 240 60 --write-job ${BENCH_ARGS_vl_write_job:-} ;;
    vl-step)      [ -f "$W-vl/job.yaml" ] || RUN_W=$W-vl SCRIPT=bench/vl_vllm_check.py run vl-write-job 120 60 --write-job ${BENCH_ARGS_vl_write_job:-}
                  RUN_W=$W-vl run vl-step 480 200 step --engine vllm --steps 2 --warmup 1 \
                    --gpu-memory-utilization 0.3 --label vl-3b $extra ;;
    # Issue 47 item 3: FP8 rollouts on vLLM 0.26 (bench/fp8_rollout_check.py, bench/fp8_notes.md): generation
    # bf16 / fp8 / fp8 + fp8 KV cache, and a bf16 weight sync re-quantized through vLLM's layerwise reload.
    fp8-timing|fp8-refit) SCRIPT=bench/fp8_rollout_check.py run $phase 420 200 --parts ${phase#fp8-} $extra ;;
    # Issue 34 item 4: generation inside `grpo rollout` against the same engine called directly.
    server-gen)   SCRIPT=bench/server_gen_profile.py run server-gen 420 200 $extra ;;
    # Issue 34 item 5 (storage.compileCache): the trainer's first steps (hf engine: no vLLM carry)
    # with an empty cache, then as a new machine (an empty local folder of its own) that restores
    # what the first run saved in the job's run, signed with its key.
    compile-cache) find "$W/run" -type d -name compile-cache -prune -exec rm -rf {} + 2>/dev/null || true
                  for n in 1 2; do GRPO_COMPILE_CACHE_DIR=$W/compile-cache-$n run compile-cache-$n 270 150 step \
                    --warmup 0 --steps 3 --label compile-cache-$n $extra; done ;;
    vllm-check)   SCRIPT=bench/vllm_check.py run vllm-check 330 150 $extra ;;
    # Issue 46: colocated with vLLM's sleep mode (level 2) against vLLM at a fixed 0.35 the whole
    # step (bench/colocated_sleep.py; needs build). The sleep run also takes the rollout-correction
    # metrics: the woken engine's log-probs against the trainer's (its weights are the trainer's).
    colocated-fixed) SCRIPT=bench/colocated_sleep.py run colocated-fixed 280 150 --mode fixed \
                    --gpu-memory-utilization 0.35 --steps 3 $extra ;;
    colocated-sleep) SCRIPT=bench/colocated_sleep.py run colocated-sleep 280 150 --mode sleep \
                    --gpu-memory-utilization 0.6 --steps 3 --set spec.algorithm.rolloutCorrection.rolloutIs=token \
                    --set spec.algorithm.rolloutCorrection.rolloutIsThreshold=2.0 $extra ;;
    # Issue 47 item 1 with issue 46 item 3: the 12-03 sleep run's best settings (gradient checkpointing
    # off, 32 K tokens a micro-batch) without rollout correction, so on-policy: vLLM computes no
    # behaviour log-probs; then the same with the policy and its optimizer state in CPU memory
    # while vLLM generates at 0.85 of the GPU.
    colocated-gc-off) SCRIPT=bench/colocated_sleep.py run colocated-gc-off 230 120 --mode sleep \
                    --gpu-memory-utilization 0.6 --steps 3 --max-tokens 32768 \
                    --set spec.model.gradientCheckpointing=false $extra ;;
    colocated-offload) SCRIPT=bench/colocated_sleep.py run colocated-offload 260 120 --mode sleep \
                    --gpu-memory-utilization 0.85 --steps 3 --max-tokens 32768 --set spec.model.gradientCheckpointing=false \
                    --set spec.trainer.paramOffload=true --set spec.trainer.optimizerOffload=true $extra ;;
    # Issue 47: the synchronous colocated step with what shortens it at once: sleep mode, gradient
    # checkpointing off (16 K tokens a micro-batch: 32 K needs ~104 GB), the reference on 128 K-token
    # micro-batches of its own; FP8 rollouts with
    # BENCH_ARGS_colocated_best="--set spec.rollout.quantization=fp8" (without: bf16). One run took 348 s
    # on an H100 on 12-06 (vLLM up in 82 s with its compile cache warm, 111-126 s cold; ~2 min before the
    # first wake; a 50 s and a 32 s compiling step): 260 s cut both earlier tries, so the limit is 420 s
    # (COLOCATED_BEST_LIMIT_S overrides it), one run a call.
    colocated-best) SCRIPT=bench/colocated_sleep.py run colocated-best ${COLOCATED_BEST_LIMIT_S:-420} 120 --mode sleep \
                    --gpu-memory-utilization 0.6 --steps 3 --max-tokens 16384 --set spec.model.gradientCheckpointing=false \
                    --set spec.trainer.logProbMaxTokensPerGPU=131072 $extra ;;
    # Issue 47 item 3: does GRPO still learn with FP8 rollouts? The quickstart task on a 256-wide tiny
    # Qwen3 through `grpo run` on the GPU: bf16, fp8 + TIS, fp8, an lr=0 control (bench/fp8_learning.py).
    # One after another they don't fit the 580 s: BENCH_ARGS_fp8_learning="--parallel 4" (438 s on 12-06).
    fp8-learning) RUN_W=$W-fl SCRIPT=bench/fp8_learning.py run fp8-learning 580 120 $extra ;;
    trl-vllm)     run trl-vllm 280 150 trl --vllm --warmup 1 --steps 2 $extra ;;
    # Issue 20, two GPUs (bench/x2_bench.py): the link, the nccl weight path and its abort, FSDP2
    # on 2 ranks, and the step with the rollout server on GPU 1 (disaggregated).
    link)         SCRIPT=bench/x2_bench.py run link 120 30 link $extra ;;
    x2-sync)      SCRIPT=bench/x2_bench.py run x2-sync 300 60 sync $extra ;;
    x2-train)     SCRIPT=bench/x2_bench.py run x2-train 420 100 train --max-tokens 24576 --steps 4 $extra ;;
    step-disagg)  run step-disagg 300 150 step --engine vllm --rollout-gpu 1 --gpu-memory-utilization 0.85 \
                    --max-tokens 24576 --warmup 2 --steps 2 $extra ;;
    step-disagg-async) run step-disagg-async 300 150 step --engine vllm --rollout-gpu 1 --gpu-memory-utilization 0.85 \
                    --max-staleness 1 --max-tokens 24576 --warmup 2 --steps 2 $extra ;;
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
        print(f"train T={r['max_tokens_per_gpu']} {r.get('head', 'logits')} {r.get('layout', 'padded')} "
              f"{r.get('lengths', 'fixed')} {r.get('attention', 'sdpa')} {' '.join(r.get('sets', []))} x{r['micro_batches']}: {r['train_s']:.2f}s "
              f"(ref {r['ref_s']:.2f} upd {r['update_s']:.2f}) packed-vs-padded {r.get('packed_vs_padded_logp_max_diff')} "
              f"shared-attention-vs-reference {r.get('shared_attention_vs_reference_max_diff')} "
              f"{r['tokens_per_s']:.0f} tok/s MFU {r['mfu']:.3f} HFU {r['hfu']:.3f} peak {r['peak_tflops']:.0f}TF mem {r['max_mem_gb']}")
        if r.get("allocator"):
            print(f"  allocator {r['allocator']}: held after empty_cache, per step: "
                  + ", ".join(f"{s.get('held_gb', 0):.1f} GB ({s.get('tensors_gb', 0):.1f} in tensors)" for s in r["steps"]))
    elif b == "attention":
        print(f"attention {r['lengths']} {r['micro_batch_samples']} samples, {r['row_tokens']} queries, {r['key_tokens']} keys: "
              f"out {r['out_rel']:.2e} dq {r['dq_rel']:.2e} dk {r['dk_rel']:.2e} dv {r['dv_rel']:.2e} "
              f"(control, mask aligned to the first query: {r['control_out_rel']:.2e})")
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
        print(f"trl (vllm={r.get('vllm')}): steps {[round(x, 2) for x in r['steps_s']]} median {r['median_step_s']}")
    elif b == "sync_cpu_costs":
        print(f"sync cpu/512MB bucket: pack {r['pack_s']:.2f} tobytes {r['tobytes_s']:.2f} sha {r['sha256_s']:.2f}s")
    else:
        print(json.dumps(r)[:400])
steps = {f"{r.get('engine', 'hf')}, maxStaleness {r.get('max_staleness', 0)} {r.get('label', '')}": r["median_step"]
         for r in rows if r["bench"] == "step" and "median_step" in r}
trl = {bool(r.get("vllm")): r["median_step_s"] for r in rows if r["bench"] == "trl"}
for engine, ours in steps.items():
    for vllm, theirs in trl.items():
        print(f"RATIO ours ({engine}) / TRL (vllm={vllm}): {ours:.2f}s / {theirs:.2f}s = {ours / theirs:.2f}")
EOF
