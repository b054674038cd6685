"""RolloutPrefetch: the next step's rollout plan in a background thread (rollout.maxStaleness 1)."""

import threading

import pytest

from grpo_trainer.prefetch import RolloutPrefetch


def test_the_plan_runs_in_the_background_and_is_taken_by_its_step():
    release = threading.Event()
    prefetch = RolloutPrefetch()
    assert prefetch.take(1) is None                       # nothing prefetched: dispatch now
    prefetch.start(2, lambda: (release.wait(5), {"uris": ["a"]})[1], sampler_before={"epoch": 0, "position": 1})
    with pytest.raises(RuntimeError, match="still pending"):
        prefetch.start(3, dict, sampler_before={})
    release.set()
    prefetch.wait()
    # finished: a checkpoint now keeps the sampler before the batch, and the batch
    sampler, pending = prefetch.checkpoint_state({"epoch": 0, "position": 2})
    assert sampler == {"epoch": 0, "position": 1} and pending["uris"] == ["a"]
    with pytest.raises(RuntimeError, match="for step 2, not 3"):
        prefetch.take(3)
    plan = prefetch.take(2)
    assert plan["uris"] == ["a"] and plan["generate_s"] >= 0 and plan["waited_s"] >= 0
    assert prefetch.take(3) is None
    assert prefetch.checkpoint_state({"epoch": 0, "position": 2}) == ({"epoch": 0, "position": 2}, None)


def test_a_failed_plan_fails_the_step_that_takes_it_and_is_not_checkpointed():
    def fail():
        raise ConnectionError("no rollout server")
    prefetch = RolloutPrefetch()
    prefetch.start(5, fail, sampler_before={"epoch": 1, "position": 0})
    prefetch.wait()
    # the prompts it drew are drawn again by a resumed run
    assert prefetch.checkpoint_state({"epoch": 1, "position": 1}) == ({"epoch": 1, "position": 0}, None)
    with pytest.raises(ConnectionError, match="no rollout server"):
        prefetch.take(5)


def test_a_restored_plan_is_the_next_steps():
    prefetch = RolloutPrefetch()
    prefetch.restore(3, {"uris": ["b"], "generate_s": 1.5}, sampler_before={"epoch": 0, "position": 2})
    assert prefetch.take(3) == {"uris": ["b"], "generate_s": 1.5, "waited_s": 0.0}
