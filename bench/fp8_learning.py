"""Issue 47 item 3: does GRPO still learn when vLLM generates with FP8 weights?

The quickstart task ("copy the digit", verl's GSM8K rule) run end to end by `grpo run` on one GPU,
vLLM beside the trainer (placement separate on the same GPU, weights over CUDA IPC), once per
variant, the same seed and data:

  bf16       rollouts in model.dtype (bfloat16)
  fp8-tis    rollout.quantization fp8 with token-level TIS (verl's FP8 guide pairs them)
  fp8        rollout.quantization fp8, no correction (the mismatch left in the loss)
  kv-fp8-tis rollout.kvCacheDtype fp8 (bf16 weights, the KV cache in FP8) with token-level TIS
  kv-fp8     rollout.kvCacheDtype fp8, no correction
  lr0        bf16 with trainer.lr 0: the control, what the reward does when nothing learns

The model is the quickstart's tiny Qwen3 (its 26-word vocabulary) made 256 wide: vLLM's FP8
scheme quantizes 128x128 weight blocks, which the CPU quickstart's 64-wide layers don't have.
Each variant's reward curve comes from the run's metrics.jsonl; per variant one RESULT line: the
first step whose 5-step mean reward reaches 0.8, the mean of the last 10 steps, the mean |log
ratio| between the engine's and the trainer's log-probs where the run measured it (TIS on), the
wall time, the reward every 10 steps, and the whole curves (reward and |log ratio| per step).
With --parallel the variants share the GPU (starts staggered, see run_variants); a run stopped by
the phase's timeout still gives its RESULT line (exit_code null, the steps it logged).

  python bench/fp8_learning.py --workdir /tmp/fl                      # on the GPU (vLLM)
  python bench/fp8_learning.py --workdir /tmp/fl --parallel 4         # the four at once, starts staggered
  python bench/fp8_learning.py --workdir /tmp/fl --tiny               # CPU check: hf engine, bf16 and lr0, a few steps
"""

from __future__ import annotations

import json
import os
import signal
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
    "kv-fp8-tis": ["rollout.kvCacheDtype=fp8", "algorithm.rolloutCorrection.rolloutIs=token"],
    "kv-fp8": ["rollout.kvCacheDtype=fp8"],
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


def metrics(work: Path, name: str) -> list[dict]:
    rows = []
    for f in (work / f"run-{name}").rglob("metrics.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:   # the line being written
                pass
    return sorted(rows, key=lambda r: r["step"])


def start_variant(args, job: Path, work: Path, name: str) -> dict:
    run = work / f"run-{name}"
    sets = [f"storage.uri=file://{run}", f"trainer.experimentName={name}", *VARIANTS[name]]
    argv = [sys.executable, "-m", "grpo_api.cli", "run", str(job), *(a for s in sets for a in ("--set", s))]
    log_path = Path(args.log_dir) / f"fp8-learning-{name}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(f"--- {name}: started (pid {proc.pid})", flush=True)
    return dict(name=name, proc=proc, log=log, log_path=log_path, start=time.monotonic())


def stop_variants(running: list[dict], grace: float) -> None:
    """SIGTERM (`grpo run` stops its rollout server and trainer itself), SIGKILL after `grace` s."""
    for v in running:
        if v["proc"].poll() is None:
            v["proc"].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for v in running:
        try:
            v["proc"].wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            v["proc"].kill()
            v["proc"].wait()


def finish_variant(args, work: Path, v: dict, code: int | None) -> dict:
    """One RESULT line from the run's metrics.jsonl (exit_code None: stopped before it ended)."""
    name, wall = v["name"], time.monotonic() - v["start"]
    # the rollout server's log (vLLM) stays in the run folder: its tail goes after the run's own
    for server_log in sorted((work / f"run-{name}").rglob("rollout-*.log")):
        lines = server_log.read_text(errors="replace").splitlines()
        v["log"].write(f"\n=== {server_log.name} (last 80 of {len(lines)} lines)\n".encode()
                       + "\n".join(lines[-80:]).encode() + b"\n")
    v["log"].close()
    rows = metrics(work, name)
    if code != 0 or not rows:
        tail = v["log_path"].read_text(errors="replace").splitlines()[-25:]
        print(f"--- {name}: exit {code}, {len(rows)} steps; log tail ---\n" + "\n".join(tail), flush=True)
    rewards = [r["critic/score/mean"] for r in rows]
    means = [statistics.fmean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
    reached = next((i + 1 for i, m in enumerate(means) if i >= 4 and m >= 0.8), None)
    mismatch = [r["rollout_corr/log_ratio_abs_mean"] for r in rows if "rollout_corr/log_ratio_abs_mean" in r]
    return emit(args, "fp8-learning", variant=name, exit_code=code, steps=len(rows), wall_s=round(wall, 1),
                parallel=args.parallel,
                step_s=round(statistics.median(r["timing_s/step"] for r in rows), 3) if rows else None,
                reward_first=rewards[0] if rewards else None,
                reward_last10=round(statistics.fmean(rewards[-10:]), 4) if rewards else None,
                mean5_ge_0_8_at=reached,
                log_ratio_abs_mean=round(statistics.fmean(mismatch), 4) if mismatch else None,
                every10=[round(rewards[i], 3) for i in range(0, len(rewards), 10)],
                rewards=[round(x, 4) for x in rewards], log_ratio_abs=[round(x, 4) for x in mismatch])


def server_ready(work: Path, name: str) -> bool:
    """The run's rollout server is up: its vLLM has measured its memory (a vLLM counts what other
    processes allocate meanwhile as its own, and fails if they free some), taken its KV cache and
    written the compile cache that the next run of the same engine config reads."""
    return bool(metrics(work, name)) or any(
        b"GRPO_ROLLOUT_READY" in f.read_bytes() for f in (work / f"run-{name}").rglob("rollout-*.log"))


def run_variants(args, job: Path, work: Path) -> list[dict]:
    """The variants, --parallel at a time. A run starts once the one started before it has its
    rollout server up (server_ready) or ended, or after --stagger-max seconds."""
    pending, running, results = list(args.variants), [], []

    def stop(signum, frame):  # the phase's timeout: keep what the runs logged so far
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop)
    try:
        while pending or running:
            for v in list(running):
                code = v["proc"].poll()
                if code is None and time.monotonic() - v["start"] > args.timeout:
                    print(f"--- {v['name']}: over --timeout {args.timeout:.0f}s, stopped", flush=True)
                    stop_variants([v], 20)
                    code = v["proc"].returncode
                if code is not None:
                    running.remove(v)
                    results.append(finish_variant(args, work, v, code))
            last = running[-1] if running else None
            ready = last is None or server_ready(work, last["name"]) or \
                time.monotonic() - last["start"] > args.stagger_max
            if pending and len(running) < args.parallel and ready:
                running.append(start_variant(args, job, work, pending.pop(0)))
            time.sleep(1)
    except KeyboardInterrupt as exc:
        print(f"--- stopped ({exc}): {[v['name'] for v in running]} still running, not started {pending}", flush=True)
        stop_variants(running, 8)   # h200_run.sh's timeout kills us 15 s after its SIGTERM
        for v in running:
            results.append(finish_variant(args, work, v, None))
    return results


def main(argv=None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--variants", type=lambda s: s.split(","), default=["bf16", "fp8-tis", "fp8", "lr0"])
    p.add_argument("--steps", type=int, default=150)
    # 2e-3 (the quickstart's, for its 64-wide float32 model) collapsed even bf16 on this 256-wide
    # model; at 5e-4 all three learn (bench/RESULTS.md, 2026-12-06 evening).
    p.add_argument("--lr", type=float, default=5e-4, help="the learning rate (lr0 sets 0)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--parallel", type=int, default=1,
                   help="variants run at once on the one GPU (each its own vLLM at gpuMemoryUtilization 0.2)")
    p.add_argument("--stagger-max", type=float, default=240,
                   help="with --parallel: start the next run after this long even if the last has logged no step")
    args = p.parse_args(argv)
    if args.tiny:
        args.variants = [v for v in args.variants if "fp8" not in v]   # vLLM only
        args.steps = min(args.steps, 4)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model, train = build(work)
    job = job_file(args, work, model, train)
    failed = [r["variant"] for r in run_variants(args, job, work) if r["exit_code"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
