"""Issue 46 item 6: the 1.7B-shaped GRPO step colocated on one H200, with vLLM's sleep mode against
today's colocated step (vLLM held at a fixed share of the GPU the whole time).

The workload and the model are bench/h200_bench.py's (build them first: `python bench/h200_bench.py
build --workdir W`; `--shape 8b` for the 8B shape). One `grpo rollout` server (vLLM) runs beside
the trainer on the same GPU, and Trainer.train_step runs as in h200_bench's `step`:

  --mode fixed   rollout.placement separate, vLLM at --gpu-memory-utilization (0.35: today's
                 colocated step, bench/RESULTS.md) the whole time; weights through CUDA IPC
  --mode sleep   rollout.placement colocated: vLLM built with sleep mode; trainer rank 0 puts it
                 to sleep (level 2: KV cache and weights freed) once the rollouts are in and wakes
                 it before the weight sync, so vLLM may take a larger share while it generates
                 (--gpu-memory-utilization 0.6, say) and the update has the GPU to itself

Per step it records every timing_s/* (generation, update, sleep, wake, weight sync, the step) and,
per phase (generate, sleep, update, wake, sync), the device's peak used memory (all processes:
torch.cuda.mem_get_info sampled every 20 ms) and the trainer process's own peak
(torch.cuda.max_memory_allocated, reset at each phase). With --max-staleness 1 generation
overlaps the update, so the engine never sleeps (EngineSleep is off): --mode sleep then measures
only the larger vLLM share. One JSON line per step and one summary (median of the timed steps)
go to --results; nothing here was run on this branch yet (the device runs it).

  python bench/h200_bench.py build --workdir /tmp/b
  python bench/colocated_sleep.py --workdir /tmp/b --mode fixed --gpu-memory-utilization 0.35
  python bench/colocated_sleep.py --workdir /tmp/b --mode sleep --gpu-memory-utilization 0.6
  python bench/colocated_sleep.py --workdir /tmp/b --mode sleep --gpu-memory-utilization 0.6 --max-staleness 1
  # the policy and its optimizer state in CPU memory while vLLM generates at 0.85 (issue 46 item 3):
  python bench/colocated_sleep.py --workdir /tmp/b --mode sleep --gpu-memory-utilization 0.85 \
      --set spec.trainer.paramOffload=true --set spec.trainer.optimizerOffload=true
  # the 8B shape, full-parameter, offloaded where the trainer allows it (if it fits):
  python bench/h200_bench.py build --workdir /tmp/b8 --shape 8b
  python bench/colocated_sleep.py --workdir /tmp/b8 --mode sleep --set spec.trainer.refCpuOffload=true
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import bench_parser  # noqa: E402
import h200_bench as hb  # noqa: E402  (the workload, the server launcher, emit)

PHASES = ("offload", "generate", "sleep", "onload", "update", "wake", "sync")


class PhaseMemory:
    """The device's used memory, sampled in a thread, and the trainer's own peak, per phase."""

    def __init__(self, dev):
        import torch
        self.torch, self.dev = torch, dev
        self.phase: str | None = None
        self.device_peak: dict[str, float] = {}
        self.trainer_peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _used(self) -> float:
        free, total = self.torch.cuda.mem_get_info(self.dev)
        return (total - free) / 1e9

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            if (phase := self.phase) is not None:
                self.device_peak[phase] = max(self.device_peak.get(phase, 0.0), self._used())

    def wrap(self, phase: str, fn):
        def run(*a, **k):
            self.torch.cuda.synchronize(self.dev)
            self.torch.cuda.reset_peak_memory_stats(self.dev)
            self.phase = phase
            self.device_peak[phase] = max(self.device_peak.get(phase, 0.0), self._used())
            try:
                return fn(*a, **k)
            finally:
                self.torch.cuda.synchronize(self.dev)
                self.device_peak[phase] = max(self.device_peak[phase], self._used())
                self.trainer_peak[phase] = self.torch.cuda.max_memory_allocated(self.dev) / 1e9
                self.phase = None
        return run

    def take(self) -> dict[str, float]:
        out = {f"peak_gb_device/{p}": self.device_peak.get(p) for p in PHASES}
        out |= {f"peak_gb_trainer/{p}": self.trainer_peak.get(p) for p in PHASES}
        self.device_peak, self.trainer_peak = {}, {}
        return out

    def close(self) -> None:
        self._stop.set()


def run(args) -> None:
    import torch
    import torch.distributed as dist
    import yaml

    from grpo_api import signing
    from grpo_api.rpc import ClientAuth
    from grpo_trainer.trainer import Trainer
    dev = hb.device()
    if dev.type != "cuda":
        raise SystemExit("colocated_sleep measures GPU memory: run it on the device")
    torch.cuda.set_device(dev)
    overrides = {"spec.rollout.engine": "vllm", "spec.rollout.gpuMemoryUtilization": args.gpu_memory_utilization,
                 "spec.rollout.maxStaleness": args.max_staleness, "spec.weightSync.backend": "nccl",
                 "spec.trainer.maxTokensPerGPU": args.max_tokens,
                 "spec.rollout.placement": "colocated" if args.mode == "sleep" else "separate",
                 "spec.rollout.replicas": 1}
    overrides.update(kv.split("=", 1) for kv in args.set)
    job = hb.load_bench_job(args, **overrides)
    job_path = Path(args.workdir) / f"job-colocated-{args.mode}.yaml"
    job_path.write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True)))
    token = secrets.token_hex(16)
    log_path = Path(args.log_dir) / f"colocated-{args.mode}-rollout-server.log"
    started = time.perf_counter()
    proc, address = hb.start_rollout_server(args, str(job_path), token, log_path)
    hb.log(f"rollout server (vLLM at {args.gpu_memory_utilization}, {args.mode}) ready in "
           f"{time.perf_counter() - started:.1f}s")
    memory = PhaseMemory(dev)
    try:
        hb.init_dist(dev)
        key = bytes.fromhex(signing.key_file(Path(args.workdir) / signing.KEY_FILE, create=True))
        trainer = Trainer(job, rollout_addresses=address, auth=ClientAuth(token), checkpoint_key=key, local=True)
        trainer.rollouts.next = memory.wrap("generate", trainer.rollouts.next)
        trainer.rollouts.engines.sleep = memory.wrap("sleep", trainer.rollouts.engines.sleep)
        trainer.actor.train_on = memory.wrap("update", trainer.actor.train_on)
        # trainer.paramOffload / optimizerOffload: the policy off the GPU around generation
        trainer.actor.offloader.offload = memory.wrap("offload", trainer.actor.offloader.offload)
        trainer.actor.offloader.onload = memory.wrap("onload", trainer.actor.offloader.onload)
        trainer.rollouts.engines.wake = memory.wrap("wake", trainer.rollouts.engines.wake)
        trainer.publisher.publish = memory.wrap("sync", trainer.publisher.publish)
        # as Trainer.train: the engines slept at setup (their weights dropped), the policy goes out first
        trainer.publisher.catch_up(trainer.state.policy_version, force=False)
        rows = []
        for step in range(1, args.steps + args.warmup + 1):
            trainer.state.step = step
            m = trainer.train_step(step)
            row = {k: m[k] for k in m if k.startswith(("timing_s/", "rollout_corr/"))} | memory.take()
            row["response_length_mean"] = m["response_length/mean"]
            rows.append(row)
            hb.emit(args, "colocated_step_row", mode=args.mode, step=step, warmup=step <= args.warmup, **row)
            hb.log(f"step {step}: " + ", ".join(f"{k}={v:.2f}" for k, v in row.items() if isinstance(v, float)))
        timed = rows[args.warmup:]
        keys = [k for k in timed[0] if all(isinstance(r.get(k), (int, float)) for r in timed)]
        hb.emit(args, "colocated_step", mode=args.mode, gpu_memory_utilization=args.gpu_memory_utilization,
                max_staleness=args.max_staleness, sleeps=trainer.rollouts.engines.enabled, sets=args.set,
                steps=len(timed), **{f"median_{k}": hb.median([r[k] for r in timed]) for k in keys})
        dist.destroy_process_group()
    finally:
        memory.close()
        hb.stop_server(proc)
        hb.dump_server_log(log_path)


def main(argv=None) -> int:
    p = bench_parser(__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["fixed", "sleep"], required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--max-staleness", type=int, default=0, choices=[0, 1])
    p.add_argument("--max-tokens", type=int, default=16384, help="trainer.maxTokensPerGPU")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a job override")
    args = p.parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
