"""Arrow schemas of what crosses object storage, and the run directory layout (docs/ARCHITECTURE.md §5).

A prompt shard is written by trainer rank 0 for one rollout request; a rollout shard, one row
per sample, is written by the rollout server that served it. Readers trust only what a manifest
or a Generate reply names.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

PROMPT_SCHEMA = pa.schema([
    ("uid", pa.string()),               # stable id of the prompt: "<epoch>-<dataset index>"
    ("prompt_index", pa.int64()),       # position in the step's batch
    ("prompt_ids", pa.list_(pa.int32())),
    ("data_source", pa.string()),
    ("ground_truth", pa.string()),
    ("extra_info", pa.string()),        # JSON
    ("raw_prompt", pa.string()),        # JSON: the prompt's chat messages, for reward models' own templates
    ("images", pa.list_(pa.string())),  # URIs of the prompt's images (RunLayout.image), in order; a VL model's
])
PROMPT_OPTIONAL = ("raw_prompt", "images")
"""Prompt shard columns a reader must not require (older shards don't have them)."""

ROLLOUT_SCHEMA = pa.schema([
    ("uid", pa.string()),
    ("prompt_index", pa.int64()),
    ("sample_index", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("response_logprobs", pa.list_(pa.float32())),  # behaviour policy, one per response token
    ("reward", pa.float32()),
    ("reward_extra", pa.string()),      # JSON: the reward function's extra fields, errors
    ("finish_reason", pa.string()),     # "stop" (EOS/stop string) or "length"
    ("policy_version", pa.int64()),
    ("data_source", pa.string()),
    ("ground_truth", pa.string()),
    ("worker", pa.string()),
    # Multi-turn (rollout.multiTurn), null for single-turn samples; shards written before these
    # columns existed read as single-turn (ROLLOUT_OPTIONAL).
    ("response_mask", pa.list_(pa.int8())),  # 1: sampled by the model, 0: a tool's tokens
    ("num_turns", pa.int32()),          # model turns + tool turns
    ("agent", pa.string()),             # JSON: the trajectory's tool calls, errors and latencies
    # How the reward function failed for this sample (it then scored 0; its message is
    # reward_extra's reward_error): one of REWARD_ERROR_KINDS; null: it didn't.
    ("reward_error", pa.string()),
    ("images", pa.list_(pa.string())),  # the prompt's images (RunLayout.image URIs); empty without
])
ROLLOUT_OPTIONAL = ("response_mask", "num_turns", "agent", "reward_error", "images")
REWARD_ERROR_KINDS = ("exception", "timeout", "invalid", "crash")
"""The values of `reward_error`: the function raised; overran spec.reward.timeoutSeconds; returned
something that is not a finite number (a string, None, NaN, a dict without "score"); killed its
worker process."""
"""Columns a reader must not require (older shards don't have them)."""
TOOL_ERROR_KINDS = ("parse", "unknown_tool", "tool_error", "unavailable", "timeout", "crash")
"""The values of a failed tool call's `error` in the `agent` column's tool_calls: the model's call
could not be parsed; named no tool; the tool raised ToolError; couldn't run (no sandbox, every slot
held by hung calls); overran rollout.multiTurn.toolTimeoutSeconds; raised anything else."""


@dataclass(frozen=True)
class RunLayout:
    """Where a job's files live under its root URI (grpo_api.storage.job_root:
    `<storage.uri>/<namespace>/<job>/<uid>` on Kubernetes, `file://<abs>/outputs/<project>/<experiment>`
    locally)."""

    root: str

    def _join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def prompt_shard(self, step: int, shard: str) -> str:
        return self._join("prompts", f"step-{step}", f"{shard}.parquet")

    def rollout_shard(self, step: int, shard: str) -> str:
        return self._join("rollouts", f"step-{step}", f"{shard}.parquet")

    @property
    def rollouts(self) -> str:
        return self._join("rollouts")

    def accepted_rollouts(self, step: int) -> str:
        """The step's record of the rollout shards it trained on (grpo_trainer.rollout_history.AcceptedRollouts)."""
        return self._join("rollouts", f"step-{step}", "accepted.json")

    @property
    def rollouts_retention(self) -> str:
        """The steps storage.keepRolloutsSteps deleted (grpo_trainer.rollout_history.RetentionRecord)."""
        return self._join("rollouts", "retention.json")

    def step_dir(self, kind: str, step: int) -> str:
        """`prompts`, `rollouts`, `checkpoints` or `hf` folder of one step."""
        return self._join(kind, f"step-{step}")

    @property
    def checkpoints(self) -> str:
        return self._join("checkpoints")

    def checkpoint(self, step: int) -> str:
        return self.step_dir("checkpoints", step)

    def hf_export(self, step: int) -> str:
        return self.step_dir("hf", step)

    @property
    def hf_best(self) -> str:
        """trainer.saveBest's export of the best step's policy."""
        return self._join("hf", "best")

    @property
    def progress(self) -> str:
        return self._join("progress.json")

    @property
    def metrics(self) -> str:
        return self._join("metrics.jsonl")

    @property
    def tensorboard(self) -> str:
        return self._join("tensorboard")

    @property
    def lease(self) -> str:
        """Trainer rank 0's lease on the run: the trainer writing it (grpo_trainer.lease)."""
        return self._join("trainer.lease")

    @property
    def job_file(self) -> str:
        """`grpo run`'s copy of the job it ran (on Kubernetes the checkpoints keep it)."""
        return self._join("job.yaml")

    def log(self, name: str) -> str:
        """A process's log, mirrored into the run (a rollout pod's: grpo_rollout.log_mirror)."""
        return self._join("logs", f"{name}.log")

    def image(self, sha256: str) -> str:
        """A prompt image, by the SHA-256 of its encoded bytes: stored once per run, named by the
        prompt and rollout records (data.imageKey)."""
        return self._join("images", sha256)

    def compile_cache(self, name: str) -> str:
        """spec.storage.compileCache's signed archive of one component's compiler caches."""
        return self._join("compile-cache", name)
