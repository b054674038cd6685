"""A broken reward function is never silent on the trainer's side (issue 48 items 1 and 7): every
step's metrics count its failures by kind from the rollout records, the first failure is said once,
and past spec.reward.maxErrorFraction the run stops naming the function and its error."""

from __future__ import annotations

import dataclasses
import json
import logging

import pyarrow as pa
import pytest
import torch

from grpo_api.records import ROLLOUT_SCHEMA
from grpo_trainer import batch as batching
from grpo_trainer.actor import UpdateResult
from grpo_trainer.metrics import step_metrics
from grpo_trainer.reward_checks import RewardFailureCheck, RewardFunctionFailed, ValidationFailureNote
from grpo_trainer.rollouts import RolloutBatch

ROW = {"uid": "u", "prompt_index": 0, "prompt_ids": [1], "response_ids": [2, 3], "response_logprobs": [-0.5, -0.5],
       "finish_reason": "stop", "policy_version": 0, "data_source": "d", "ground_truth": "g", "worker": "w"}
MESSAGE = "rewards.py:compute_score: KeyError: 'answer'"


def records(outcomes: list[tuple[float, str | None, dict]]) -> pa.Table:
    """Rollout rows as a rollout server writes them: (reward, reward_error, reward_extra)."""
    return pa.Table.from_pylist([{**ROW, "sample_index": i, "reward": r, "reward_error": err,
                                  "reward_extra": json.dumps({**extra, **({"reward_error": MESSAGE} if err else {})})}
                                 for i, (r, err, extra) in enumerate(outcomes)], schema=ROLLOUT_SCHEMA)


def metrics_of(samples) -> dict:
    batch = RolloutBatch(step=1, epoch=0, policy_version=0, uris=[], prompts=1, sampler_before={})
    return step_metrics(1, 1, samples, batch, UpdateResult(metrics={}, tokens=0), {"timing_s/step": 1.0},
                        world=1, device=torch.device("cpu"))


def test_every_step_counts_the_reward_functions_failures_by_kind():
    samples = batching.samples_from_table(records([(1.0, None, {}), (0.0, "exception", {}), (0.0, "exception", {}),
                                                   (0.0, "invalid", {}), (0.0, "timeout", {}), (0.5, None, {})]))
    m = metrics_of(samples)
    assert {k: v for k, v in m.items() if k.startswith("reward/errors/")} == {
        "reward/errors/exception": 2, "reward/errors/timeout": 1, "reward/errors/invalid": 1, "reward/errors/crash": 0}
    # a healthy step says 0 for every kind: the console line always shows them
    healthy = metrics_of(batching.samples_from_table(records([(1.0, None, {}), (0.0, None, {})])))
    assert healthy["reward/errors/exception"] == 0 and healthy["reward/errors/invalid"] == 0


def test_every_step_has_the_failed_share_of_its_samples_and_tool_calls():
    """The rates the status shows (Progress.rewardErrorFraction, toolErrorFraction): failed / all."""
    samples = batching.samples_from_table(records([(1.0, None, {}), (0.0, "exception", {}), (0.0, "invalid", {}),
                                                   (0.5, None, {}), (0.2, None, {})]))
    assert metrics_of(samples)["reward/error_fraction"] == pytest.approx(2 / 5)
    assert metrics_of(batching.samples_from_table(records([(1.0, None, {})])))["reward/error_fraction"] == 0.0
    assert "tool_calls/error_fraction" not in metrics_of(samples)          # single-turn: no tool calls to count
    # multi-turn: 4 calls of which 1 timed out and 2 named no tool; a sample without calls counts none
    calls = [[{"name": "lookup", "error": ""}, {"name": "lookup", "error": "timeout"}],
             [{"name": "nosuch", "error": "unknown_tool"}, {"name": "nosuch", "error": "unknown_tool"}], []]
    agents = [dataclasses.replace(s, agent={"num_turns": 2, "tool_calls": c}) for s, c in zip(samples, calls)]
    m = metrics_of(agents)
    assert m["tool_calls/error_fraction"] == pytest.approx(3 / 4) and m["tool_calls/errors"] == 3
    kinds = (m["tool_calls/errors/timeout"], m["tool_calls/errors/unknown_tool"], m["tool_calls/errors/crash"])
    assert kinds == (1, 2, 0)
    no_calls = [dataclasses.replace(s, agent={"num_turns": 1, "tool_calls": []}) for s in samples]
    assert metrics_of(no_calls)["tool_calls/error_fraction"] == 0.0


def test_validation_counts_its_reward_failures_by_kind_and_says_the_first_once(caplog):
    """Validation rollouts score 0 where the function failed, as training's do: counted in
    val/reward_errors/<kind> at every validation, the first failure said once; never the end of the run."""
    note = ValidationFailureNote()
    healthy = batching.samples_from_table(records([(1.0, None, {}), (0.0, None, {})]))
    broken = batching.samples_from_table(records([(0.0, "exception", {}), (0.0, "exception", {}), (0.0, "timeout", {}),
                                                  (1.0, None, {})]))
    with caplog.at_level(logging.WARNING, logger="grpo.trainer"):
        assert note.counts(0, healthy) == {"val/reward_errors/exception": 0, "val/reward_errors/timeout": 0,
                                           "val/reward_errors/invalid": 0, "val/reward_errors/crash": 0}
        assert note.counts(2, broken) == {"val/reward_errors/exception": 2, "val/reward_errors/timeout": 1,
                                          "val/reward_errors/invalid": 0, "val/reward_errors/crash": 0}
        assert note.counts(4, broken)["val/reward_errors/exception"] == 2         # every validation counts
        assert note.counts(6, broken[:1]) == {"val/reward_errors/exception": 1, "val/reward_errors/timeout": 0,
                                              "val/reward_errors/invalid": 0, "val/reward_errors/crash": 0}
    said = [r.getMessage() for r in caplog.records if "reward function failed" in r.getMessage()]
    assert said == [("The reward function failed for 3 of 4 validation samples at step 2 (exception 2, timeout 1; "
                     "each scored 0 in val/score; counted in val/reward_errors/* from now on, not said again); "
                     "the first: " + MESSAGE)]


def test_old_records_without_the_column_read_as_no_failure():
    old_schema = pa.schema([f for f in ROLLOUT_SCHEMA if f.name != "reward_error"])
    table = pa.Table.from_pylist([{**ROW, "sample_index": 0, "reward": 1.0, "reward_extra": "{}"}], schema=old_schema)
    [s] = batching.samples_from_table(table)
    assert s.reward_error is None and s.reward_extra == {}
    assert metrics_of([s])["reward/errors/exception"] == 0


def test_reward_model_and_rule_means_come_from_reward_extra():
    # Two samples of a job with a classifier `rm` and a judge `judge` (whose parser read one of two).
    samples = batching.samples_from_table(records([
        (0.9, None, {"rule_score": 1.0, "rm/rm": 0.8, "rm/judge": 1.0, "rm/judge/parsed": True}),
        (0.1, None, {"rule_score": 0.0, "rm/rm": 0.2, "rm/judge": 0.0, "rm/judge/parsed": False})]))
    m = metrics_of(samples)
    assert m["rule_score/mean"] == pytest.approx(0.5) and m["rm/rm/mean"] == pytest.approx(0.5)
    assert m["rm/judge/mean"] == pytest.approx(0.5) and m["rm/judge/parsed"] == pytest.approx(0.5)
    without_models = metrics_of(batching.samples_from_table(records([(1.0, None, {})])))
    assert not any(k.startswith(("rm/", "rule_score")) for k in without_models)


def test_past_max_error_fraction_the_run_stops_with_the_functions_error(caplog):
    samples = batching.samples_from_table(records([(0.0, "exception", {}), (1.0, None, {}), (1.0, None, {}),
                                                   (1.0, None, {})]))
    # unset (the default): one failure of four is said, not fatal; every sample failed stops the run
    RewardFailureCheck(None, say=False).check(3, samples)
    broken = batching.samples_from_table(records([(0.0, "invalid", {}), (0.0, "exception", {})]))
    with pytest.raises(RewardFunctionFailed, match=r"failed for 2 of 2 samples of step 1 \(exception 1, invalid 1\), "
                       r"more than spec.reward.maxErrorFraction \(unset: all but every sample\) allows"):
        RewardFailureCheck(None, say=False).check(1, broken)
    # maxErrorFraction 0 (verl's crash on an exception): one failure of four stops it
    with pytest.raises(RewardFunctionFailed) as err:
        RewardFailureCheck(0.0, say=True).check(3, samples)
    assert str(err.value) == ("the reward function failed for 1 of 4 samples of step 3 (exception 1), more than "
                              "spec.reward.maxErrorFraction 0 allows; the first: " + MESSAGE)
    # within the allowed share: the first failure is said once (function, exception, message)
    check = RewardFailureCheck(0.25, say=True)
    with caplog.at_level(logging.WARNING, logger="grpo.trainer"):
        check.check(1, samples)
        check.check(2, samples)
    said = [r.getMessage() for r in caplog.records if "reward function failed" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("the first: " + MESSAGE) and "1 of 4 samples of step 1" in said[0]
    RewardFailureCheck(0.99, say=False).check(1, batching.samples_from_table(records([(0.0, "crash", {})] +
                                                                                     [(1.0, None, {})] * 99)))


def test_the_failure_counts_are_prometheus_gauges():
    """On Kubernetes the counts reach Prometheus (grpo_trainer_reward_errors_<kind>), to alert on."""
    from grpo_trainer.metrics import PROMETHEUS_KEYS, prometheus_name
    counts = metrics_of(batching.samples_from_table(records([(1.0, None, {})])))
    keys = [k for k in counts if k.startswith("reward/errors/")]
    assert len(keys) == 4 and set(keys) <= set(PROMETHEUS_KEYS)
    assert prometheus_name("reward/errors/exception") == "grpo_trainer_reward_errors_exception"
