"""The trainer's rollout batch (grpo_trainer.rollouts): its JSON form, as broadcast and kept in a
checkpoint (old checkpoints' plain dicts too), and `Prefetch`, the next step's batch generated in
a background thread (rollout.maxStaleness 1)."""

import json
import threading

import pytest

from grpo_trainer.rollouts import Prefetch, RolloutBatch
from grpo_trainer.state import TrainerState


def _batch(step=2, **changes):
    fields = dict(step=step, epoch=0, policy_version=1, uris=["a"], prompts=4, sampler_before={"epoch": 0, "position": 1},
                  sampler_after={"epoch": 0, "position": 2}, off_policy=True)
    return RolloutBatch(**{**fields, **changes})


def test_a_batch_survives_its_json_form_unchanged():
    batch = _batch(keep=[0, 2], filtered_groups=3, rounds=2, reward_s=0.5, generate_s=1.5)
    assert RolloutBatch.from_json(json.loads(json.dumps(batch.to_json()))) == batch
    assert batch.timings() == {"timing_s/rollout": 0.0, "timing_s/reward": 0.5, "timing_s/generate_overlapped": 1.5}


def test_a_pending_batch_of_a_checkpoint_written_before_rollout_batches_still_resumes():
    """Until this class, a checkpoint kept the batch generated ahead as a plain dict: the sampler
    before it was the checkpoint's `sampler`, the one after it the dict's own `sampler`."""
    legacy = {"uris": ["s3://b/r/rollouts/step-3/train-shard-000-attempt-1.parquet"], "epoch": 1, "prompts": 4,
              "reward_s": 0.25, "sampler": {"epoch": 1, "position": 3}, "generate_s": 2.0,
              "keep": [1, 3], "filtered_groups": 2}
    flat = {"step": 2, "policy_version": 2, "sampler": {"epoch": 1, "position": 2}, "pending_rollouts": legacy}
    state = TrainerState.from_json(json.dumps(flat))     # as resume reads that checkpoint
    batch = RolloutBatch.from_checkpoint(state.rollouts.pending_rollouts, state.rollouts, state.trainer)
    assert (batch.step, batch.policy_version, batch.epoch, batch.uris) == (3, 1, 1, legacy["uris"])
    assert batch.sampler_before == {"epoch": 1, "position": 2} and batch.sampler_after == {"epoch": 1, "position": 3}
    assert (batch.keep, batch.filtered_groups, batch.generate_s, batch.off_policy) == ([1, 3], 2, 2.0, True)
    # one written now comes back as it was
    assert RolloutBatch.from_checkpoint(_batch(3).to_json(), state.rollouts, state.trainer) == _batch(3)


def test_the_batch_generates_in_the_background_and_is_taken_by_its_step():
    release = threading.Event()
    prefetch = Prefetch()
    assert prefetch.take(1) is None                       # nothing generated ahead: dispatch now
    prefetch.start(2, lambda: (release.wait(5), _batch(2))[1], sampler_before={"epoch": 0, "position": 1})
    with pytest.raises(RuntimeError, match="still pending"):
        prefetch.start(3, _batch, sampler_before={})
    release.set()
    prefetch.wait()
    # finished: a checkpoint now keeps the sampler before the batch, and the batch
    sampler, pending = prefetch.checkpoint_state({"epoch": 0, "position": 2})
    assert sampler == {"epoch": 0, "position": 1} and pending.uris == ["a"]
    with pytest.raises(RuntimeError, match="for step 2, not 3"):
        prefetch.take(3)
    batch = prefetch.take(2)
    assert batch.uris == ["a"] and batch.generate_s >= 0 and batch.waited_s >= 0
    assert prefetch.take(3) is None
    assert prefetch.checkpoint_state({"epoch": 0, "position": 2}) == ({"epoch": 0, "position": 2}, None)


def test_a_failed_generation_fails_the_step_that_takes_it_and_is_not_checkpointed():
    def fail():
        raise ConnectionError("no rollout server")
    prefetch = Prefetch()
    prefetch.start(5, fail, sampler_before={"epoch": 1, "position": 0})
    prefetch.wait()
    # the prompts it drew are drawn again by a resumed run
    assert prefetch.checkpoint_state({"epoch": 1, "position": 1}) == ({"epoch": 1, "position": 0}, None)
    with pytest.raises(ConnectionError, match="no rollout server"):
        prefetch.take(5)


def test_a_restored_batch_is_the_next_steps():
    prefetch = Prefetch()
    prefetch.restore(_batch(3, generate_s=1.5))
    assert prefetch.take(3) == _batch(3, generate_s=1.5, waited_s=0.0)
