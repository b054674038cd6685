"""Where a step's metrics go: console lines (verl-style), metrics.jsonl, TensorBoard, Prometheus,
W&B and MLflow (trackers.py). Rank 0 only."""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections import Counter
from typing import TYPE_CHECKING

from grpo_api.records import TOOL_ERROR_KINDS, RunLayout
from grpo_api.spec import GRPOJob
from grpo_api.storage import Storage
from grpo_trainer.collectives import from_rank0
from grpo_trainer.reward_checks import failure_counts, failure_fraction, score_means
from grpo_trainer.trackers import TrackerError, start_trackers

if TYPE_CHECKING:
    import torch

    from grpo_trainer.actor import UpdateResult
    from grpo_trainer.batch import Sample
    from grpo_trainer.rollouts import RolloutBatch

log = logging.getLogger("grpo.trainer")

# Metric keys (verl names) exported to Prometheus as gauges `grpo_trainer_<key with / as _>`.
PROMETHEUS_KEYS = (
    "training/step", "training/epoch", "training/policy_version",
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/advantages/std",
    "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
    "actor/ppo_kl", "actor/grad_norm", "actor/lr",
    "response_length/mean", "response_length/max", "response_length/clip_ratio",
    "perf/throughput", "perf/mfu", "val/score",
    "timing_s/rollout", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
    "timing_s/update_actor", "timing_s/weight_sync", "timing_s/checkpoint", "timing_s/step",
    "rollout/staleness", "timing_s/generate_overlapped",
    # the reward function's failures by kind (grpo_api.records.REWARD_ERROR_KINDS): something to alert on
    "reward/errors/exception", "reward/errors/timeout", "reward/errors/invalid", "reward/errors/crash",
    "reward/error_fraction", "tool_calls/error_fraction",
)


# Dense bf16 peak FLOP/s for the MFU estimate; GRPO_PEAK_FLOPS overrides.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def prometheus_name(key: str) -> str:
    return "grpo_trainer_" + key.replace("/", "_")


class MetricsLogger:
    def __init__(self, job: GRPOJob, layout: RunLayout, storage: Storage, *, metrics_port: int | None = None,
                 metrics_host: str = "0.0.0.0",
                 tracker_runs: dict[str, str] | None = None):
        """`tracker_runs`: the W&B / MLflow run ids a resumed job continues (from its checkpoint).
        Raises trackers.TrackerError when a tracker can't start its run."""
        self.loggers = set(job.spec.trainer.loggers)
        self.layout, self.storage = layout, storage
        self._jsonl_lines: list[str] = []
        self._tb = None
        self._gauges = {}
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter
            local = layout.tensorboard.removeprefix("file://") if layout.root.startswith("file://") \
                else tempfile.mkdtemp(prefix="grpo-tb-")
            self._tb = SummaryWriter(local)
        if "prometheus" in self.loggers or metrics_port:
            from prometheus_client import Gauge, start_http_server
            # A series appears on its first value: a metric this run never computes (perf/mfu
            # without a known peak FLOP/s, actor/kl_loss without useKLLoss) is absent, not 0.
            self._labels = {"job": job.metadata.name, "namespace": job.metadata.namespace}
            for key in PROMETHEUS_KEYS:
                self._gauges[key] = Gauge(prometheus_name(key), f"verl metric {key}", ["job", "namespace"])
            if metrics_port:
                start_http_server(metrics_port, addr=metrics_host)
        self._trackers = start_trackers(job, tracker_runs or {})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "console" in self.loggers:
            shown = " - ".join(f"{k}:{_fmt(v)}" for k, v in sorted(metrics.items()))
            log.info("step:%d - %s", step, shown)
        if "jsonl" in self.loggers:
            line = json.dumps({"step": step, "time": time.time(), **metrics})
            self._jsonl_lines.append(line)
            # Append by rewriting: object stores have no append; the file stays small (one line/step).
            self.storage.write_bytes(self.layout.metrics, ("\n".join(self._jsonl_lines) + "\n").encode())
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for k, g in self._gauges.items():
            if k in metrics and metrics[k] is not None:
                g.labels(**self._labels).set(metrics[k])
        if self._trackers:
            values = {k: v for k, v in metrics.items() if v is not None}
            for tracker in self._trackers:
                tracker.log(step, values)

    def tracker_runs(self) -> dict[str, str]:
        """The trackers' run ids, for the checkpoint: a resumed job continues these runs."""
        return {t.name: t.run_id for t in self._trackers}

    def resume_from(self, step: int) -> None:
        """Keep metrics.jsonl lines of steps up to `step` (a resumed run rewrites the rest)."""
        if "jsonl" in self.loggers and self.storage.exists(self.layout.metrics):
            lines = self.storage.read_bytes(self.layout.metrics).decode().splitlines()
            self._jsonl_lines = [ln for ln in lines if ln and json.loads(ln).get("step", 0) <= step]

    def close(self, finished: bool = True) -> None:
        """`finished`: the run ended; otherwise it stopped to be resumed (SIGTERM)."""
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close(finished)


def open_metrics(job: GRPOJob, layout: RunLayout, storage: Storage, *, device: torch.device, resumed_step: int,
                 metrics_port: int | None = None, metrics_host: str = "0.0.0.0",
                 tracker_runs: dict[str, str] | None = None) -> MetricsLogger | None:
    """Collective: rank 0's logger (None on the others), continuing a resumed run's metrics.jsonl
    and tracker runs. A tracker that can't start its run stops every rank (SetupError)."""
    logger = None

    def start() -> None:
        nonlocal logger
        logger = MetricsLogger(job, layout, storage, metrics_port=metrics_port, metrics_host=metrics_host,
                               tracker_runs=tracker_runs)
        logger.resume_from(resumed_step)

    from_rank0(start, device, setup_errors=(TrackerError,))
    return logger


def step_metrics(step: int, version: int, samples: list[Sample], batch: RolloutBatch, update: UpdateResult,
                 timings: dict[str, float], *, world: int, device: torch.device) -> dict[str, float]:
    """One step's metrics under verl's names: the rollouts', the update's and the timings."""
    rewards = [s.reward for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    tokens = sum(s.length for s in samples)
    m = {
        "training/step": step, "training/epoch": batch.epoch, "training/policy_version": version,
        "critic/score/mean": statistics.fmean(rewards), "critic/rewards/mean": statistics.fmean(rewards),
        "critic/score/max": max(rewards), "critic/score/min": min(rewards),
        "response_length/mean": statistics.fmean(lengths), "response_length/max": max(lengths),
        "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "prompt_length/mean": statistics.fmean(len(s.prompt_ids) for s in samples),
        "perf/total_num_tokens": tokens,
        "perf/throughput": tokens / timings["timing_s/step"] / world,
        "rollout/staleness": batch.staleness,
    }
    if batch.filtered_groups is not None:
        m["rollout/filtered_groups"] = batch.filtered_groups
    m.update(multi_turn_metrics(samples))
    m.update(failure_counts(samples))       # issue 48: a broken reward function is never silent
    m["reward/error_fraction"] = failure_fraction(samples)
    m.update(score_means(samples))
    if peak := peak_flops(device):
        m["perf/mfu"] = update.flops / update.train_seconds / (peak * world)
    return {**m, **update.metrics, **timings}


def multi_turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """The agent loop's trajectories (rollout.multiTurn): turns per sample (verl's num_turns/*),
    tool calls per sample, and the calls that failed (a parse error, an unknown tool, a crash, a
    timeout): in all, by kind (every kind of TOOL_ERROR_KINDS, 0 too) and as a share of the step's
    calls (0 without calls); {} for single-turn rollouts."""
    agents = [s.agent for s in samples if s.agent is not None]
    if not agents:
        return {}
    turns = [a["num_turns"] for a in agents]
    calls = [c for a in agents for c in a["tool_calls"]]
    errors = Counter(c["error"] for c in calls if c["error"])
    return {"num_turns/mean": statistics.fmean(turns), "num_turns/min": min(turns), "num_turns/max": max(turns),
            "tool_calls/mean": len(calls) / len(agents),
            "tool_calls/errors": errors.total(),
            "tool_calls/error_fraction": errors.total() / len(calls) if calls else 0.0,
            **{f"tool_calls/errors/{kind}": errors.get(kind, 0) for kind in TOOL_ERROR_KINDS}}


def peak_flops(device: torch.device) -> float | None:
    """The accelerator's dense bf16 peak FLOP/s (GRPO_PEAK_FLOPS overrides), None when unknown."""
    if "GRPO_PEAK_FLOPS" in os.environ:
        return float(os.environ["GRPO_PEAK_FLOPS"])
    if device.type != "cuda":
        return None
    import torch
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_FLOPS.items() if k in name), None)


class ProgressBar:
    """step / total, reward and tokens/s on rank 0's terminal (silent when not a tty)."""

    def __init__(self, total: int, initial: int):
        from tqdm import tqdm
        self._bar = tqdm(total=total, initial=initial, desc="GRPO", unit="step", disable=None, dynamic_ncols=True)

    def update(self, metrics: dict[str, float]) -> None:
        self._bar.set_postfix(reward=f"{metrics.get('critic/score/mean', 0):.3f}",
                              tok_s=f"{metrics.get('perf/throughput', 0):.0f}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="[%(levelname)s] %(message)s", force=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
