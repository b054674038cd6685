"""Issue 47 item 3: does GRPO still learn when vLLM generates with FP8 weights?

The quickstart task ("copy the digit", verl's GSM8K rule) run end to end by `grpo run` on one GPU,
vLLM beside the trainer (placement separate on the same GPU, weights over CUDA IPC), once per
variant, the same seed and data:

  bf16       rollouts in model.dtype (bfloat16)
  fp8-tis    rollout.quantization fp8 with token-level TIS (verl's FP8 guide pairs them)
  fp8        rollout.quantization fp8, no correction (the mismatch left in the loss)
  lr0        bf16 with trainer.lr 0: the control, what the reward does when nothing learns

The model is the quickstart's tiny Qwen3 (its 26-word vocabulary) made 256 wide: vLLM's FP8
scheme quantizes 128x128 weight blocks, which the CPU quickstart's 64-wide layers don't have.
Each variant's reward curve comes from the run's metrics.jsonl; per variant one RESULT line: the
first step whose 5-step mean reward reaches 0.8, the mean of the last 10 steps, the mean |log
ratio| between the engine's and the trainer's log-probs where the run measured it (TIS on), the
wall time, and the reward every 10 steps.

  python bench/fp8_learning.py --workdir /tmp/fl                      # on the GPU (vLLM)
  python bench/fp8_learning.py --workdir /tmp/fl --tiny               # CPU check: hf engine, bf16 and lr0, a few steps
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench_common import bench_parser, emit

REPO = Path(__file__).resolve().parent.parent
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)
VARIANTS = {
    "bf16": [],
    "fp8-tis": ["rollout.quantization=fp8", "algorithm.rolloutCorrection.rolloutIs=token"],
    "fp8": ["rollout.quantization=fp8"],
    "lr0": ["trainer.lr=0"],
}


def build(work: Path) -> tuple[Path, Path]:
    from grpo_rollout.quickstart_data import write_quickstart_dataset
    from grpo_rollout.tiny import build_tiny_model
    model = work / "model-256"
    if not (model / "config.json").exists():
        build_tiny_model(model, **WIDE)
    train, _ = write_quickstart_dataset(work / "data")
    return model, train


def job_file(args, work: Path, model: Path, train: Path) -> Path:
    job = yaml.safe_load((REPO / "examples/quickstart.yaml").read_text())
    spec = job["spec"]
    spec["model"].update(path=str(model), dtype="float32" if args.tiny else "bfloat16")
    spec["data"].update(trainFiles=[str(train)], valFiles=[])
    spec["rollout"].update(engine="hf" if args.tiny else "vllm", gpuMemoryUtilization=0.2)
    spec["trainer"].update(device="cpu" if args.tiny else "cuda", totalSteps=args.steps, lr=args.lr,
                           testFreq=-1, saveFreq=-1, valBeforeTrain=False, loggers=["console", "jsonl"])
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_variant(args, job: Path, work: Path, name: str) -> dict:
    run = work / f"run-{name}"
    sets = [f"storage.uri=file://{run}", f"trainer.experimentName={name}", *VARIANTS[name]]
    argv = [sys.executable, "-m", "grpo_api.cli", "run", str(job), *(a for s in sets for a in ("--set", s))]
    log_path = Path(args.log_dir) / f"fp8-learning-{name}.log"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              timeout=args.timeout).returncode
    wall = time.monotonic() - start
    rows = [json.loads(line) for f in run.rglob("metrics.jsonl") for line in f.read_text().splitlines() if line]
    rows.sort(key=lambda r: r["step"])
    if code != 0 or not rows:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        print(f"--- {name}: exit {code}, {len(rows)} steps; log tail ---\n" + "\n".join(tail), flush=True)
    rewards = [r["critic/score/mean"] for r in rows]
    means = [statistics.fmean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
    reached = next((i + 1 for i, m in enumerate(means) if i >= 4 and m >= 0.8), None)
    mismatch = [r["rollout_corr/log_ratio_abs_mean"] for r in rows if "rollout_corr/log_ratio_abs_mean" in r]
    return emit(args, "fp8-learning", variant=name, exit_code=code, steps=len(rows), wall_s=round(wall, 1),
                step_s=round(statistics.median(r["timing_s/step"] for r in rows), 3) if rows else None,
                reward_first=rewards[0] if rewards else None,
                reward_last10=round(statistics.fmean(rewards[-10:]), 4) if rewards else None,
                mean5_ge_0_8_at=reached,
                log_ratio_abs_mean=round(statistics.fmean(mismatch), 4) if mismatch else None,
                every10=[round(rewards[i], 3) for i in range(0, len(rewards), 10)])


def main(argv=None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=2e-3, help="the learning rate (lr0 sets 0)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = p.parse_args(argv)
    if args.tiny:
        args.variants = [v for v in args.variants if not v.startswith("fp8")]
        args.steps = min(args.steps, 4)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model, train = build(work)
    job = job_file(args, work, model, train)
    failed = [name for name in args.variants if run_variant(args, job, work, name)["exit_code"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
