"""trainer_state.json: what a checkpoint keeps beside the weights, one typed part per component,
namespaced by its name (as torchtitan's `Stateful` components): each component's `state_dict()`
returns its part and `load_state_dict()` takes it back; the checkpointer writes and reads the
whole without knowing the parts. `grpo export`, `grpo replay`, `grpo ui` and `grpo rollouts
export` read the `trainer` part (the job, the model, LoRA's config) through the same model.

The parts live here, below every component, so that those readers and checkpoint.py don't load
the components (torch models, the rollout dispatcher) to read a JSON file.

Checkpoints written before the parts were namespaced hold one flat dict; `TrainerState.from_json`
reads them too (users' runs resume across the change).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

FILE = "trainer_state.json"
"""In every checkpoint folder, beside DCP's files (listed in its signed manifest)."""


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunState(_Part):
    """The trainer's own part: where the run is and what it trains."""

    step: int
    policy_version: int
    world_size: int | None = None
    """None in checkpoints older than recording it (replay then counts the RNG states)."""
    total_steps: int | None = None
    job: dict[str, Any] | None = None
    """The resolved job the trainer ran (`grpo replay` retrains a step under it)."""
    model: dict[str, Any] | None = None
    """spec.model as the user wrote it (export and `rollouts export` load its tokenizer)."""
    lora_config: dict[str, Any] | None = None
    """With LoRA: the PEFT config of the adapters the checkpoint holds."""


class CheckpointerState(_Part):
    best: dict[str, Any] | None = None
    """trainer.saveBest: {"step", "score"} of the best step so far."""
    schedulers: dict[str, dict[str, Any]] = {}
    """Each part's ("policy", "critic") learning-rate scheduler."""
    rng: dict[str, Any] = {}
    """`torch`: rank 0's generator; `torch_by_rank`: every rank's."""


class RolloutsState(_Part):
    sampler: dict[str, int] | None = None
    """The epoch sampler before any batch generated ahead (None on ranks other than 0)."""
    pending_rollouts: dict[str, Any] | None = None
    """A batch generated ahead of the checkpoint (maxStaleness >= 1), as RolloutBatch.to_json."""


class ActorState(_Part):
    kl_coef: float | None = None
    """The KL penalty's coefficient (adaptive, it moves); None in checkpoints older than it."""


class ValidatorState(_Part):
    score: float | None = None
    """The last validation score."""


class MetricsState(_Part):
    trackers: dict[str, str] = {}
    """The trackers' run ids (W&B, MLflow): this job's resume continues them."""


class TrainerState(_Part):
    trainer: RunState
    checkpointer: CheckpointerState = CheckpointerState()
    rollouts: RolloutsState = RolloutsState()
    actor: ActorState = ActorState()
    validator: ValidatorState = ValidatorState()
    metrics: MetricsState = MetricsState()

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> TrainerState:
        doc = json.loads(data)
        return cls.model_validate(doc if "trainer" in doc else _from_flat(doc))


def _scheduler_part(key: str) -> str:
    # The flat layout kept the policy's as "scheduler" and another part's as "<part>_scheduler".
    return "policy" if key == "scheduler" else key.removesuffix("_scheduler")


def _from_flat(doc: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint from before the parts were namespaced: every component's keys in one dict."""
    return {
        "trainer": {k: doc.get(k) for k in RunState.model_fields if k in doc},
        "checkpointer": {"best": doc.get("best"), "rng": doc.get("rng", {}),
                         "schedulers": {_scheduler_part(k): v for k, v in doc.items()
                                        if k == "scheduler" or k.endswith("_scheduler")}},
        "rollouts": {"sampler": doc.get("sampler"), "pending_rollouts": doc.get("pending_rollouts")},
        "actor": {"kl_coef": doc.get("kl_coef")},
        "validator": {"score": doc.get("validation_score")},
        "metrics": {"trackers": doc.get("trackers") or {}},
    }
