"""trainer_state.json (grpo_trainer.state): one typed part per component, namespaced; a checkpoint
written before the parts were (one flat dict) still resumes into the same parts."""

import json

import pytest
from pydantic import ValidationError

from grpo_trainer.state import ActorState, MetricsState, RolloutsState, RunState, TrainerState, ValidatorState

# A trainer_state.json as the trainer wrote it before this change (PPO with LoRA, a batch ahead).
FLAT = {
    "step": 4, "policy_version": 4, "sampler": {"epoch": 1, "position": 0},
    "pending_rollouts": {"step": 5, "epoch": 1, "policy_version": 3, "uris": ["file:///r/a.parquet"], "prompts": 2,
                         "sampler_before": {"epoch": 1, "position": 0}, "sampler_after": {"epoch": 1, "position": 1}},
    "kl_coef": 0.0125, "validation_score": 0.5, "trackers": {"wandb": "run-1"},
    "model": {"path": "Qwen/Qwen3-0.6B"}, "job": {"spec": {"model": {"path": "Qwen/Qwen3-0.6B"}}},
    "world_size": 2, "total_steps": 8, "lora_config": {"r": 8}, "best": {"step": 2, "score": 0.75},
    "scheduler": {"last_epoch": 4}, "critic_scheduler": {"last_epoch": 3},
    "rng": {"torch": [1, 2], "torch_by_rank": [[1, 2], [3, 4]]},
}


def test_a_flat_checkpoint_from_before_the_parts_resumes_into_them():
    state = TrainerState.from_json(json.dumps(FLAT))
    assert state.trainer == RunState(step=4, policy_version=4, world_size=2, total_steps=8, job=FLAT["job"],
                                     model=FLAT["model"], lora_config={"r": 8})
    assert state.checkpointer.best == {"step": 2, "score": 0.75}
    # the policy's scheduler was "scheduler", a critic's "critic_scheduler": now by part name
    assert state.checkpointer.schedulers == {"policy": {"last_epoch": 4}, "critic": {"last_epoch": 3}}
    assert state.checkpointer.rng == FLAT["rng"]
    assert state.rollouts == RolloutsState(sampler={"epoch": 1, "position": 0},
                                           pending_rollouts=FLAT["pending_rollouts"])
    assert (state.actor, state.validator, state.metrics) == (
        ActorState(kl_coef=0.0125), ValidatorState(score=0.5), MetricsState(trackers={"wandb": "run-1"}))


def test_the_oldest_flat_checkpoints_lack_keys_that_came_later():
    """Before kl_coef, world_size, the job or trackers were kept: the parts take their defaults
    (the actor keeps its configured KL coefficient, replay counts the RNG states)."""
    old = {k: FLAT[k] for k in ("step", "policy_version", "sampler", "scheduler", "rng")}
    state = TrainerState.from_json(json.dumps(old))
    assert (state.trainer.world_size, state.trainer.job, state.actor.kl_coef, state.metrics.trackers) == (
        None, None, None, {})
    assert state.checkpointer.schedulers == {"policy": {"last_epoch": 4}}


def test_each_component_has_its_namespace_and_the_file_reads_back_the_same():
    state = TrainerState.from_json(json.dumps(FLAT))
    written = json.loads(state.to_json())
    assert set(written) == {"trainer", "checkpointer", "rollouts", "actor", "validator", "metrics"}
    assert written["metrics"] == {"trackers": {"wandb": "run-1"}} and written["trainer"]["step"] == 4
    assert TrainerState.from_json(state.to_json()) == state


def test_a_key_no_component_owns_is_refused_naming_its_part():
    doc = json.loads(TrainerState.from_json(json.dumps(FLAT)).to_json())
    doc["actor"]["kl_coeff"] = 0.1
    with pytest.raises(ValidationError, match=r"actor\.kl_coeff"):
        TrainerState.from_json(json.dumps(doc))
