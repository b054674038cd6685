"""grpo_trainer.rollout_history (issue 35): which shard files of a step are the accepted training
ones (the step's accepted.json, else each shard's highest attempt), and the --steps syntax. The
export on a real run: tests/integration/test_rollouts_export.py."""

from __future__ import annotations

import json

import pytest

from grpo_trainer.rollout_history import AcceptedRollouts, RolloutHistory, RunNotFound, parse_steps, spec_digest
from grpo_api.storage import Storage


def test_each_shards_highest_attempt_of_training_shards_only(tmp_path):
    step = tmp_path / "rollouts" / "step-7"
    step.mkdir(parents=True)
    names = ["train-shard-000-attempt-1", "train-shard-000-attempt-3", "train-shard-000-attempt-2",
             "train-shard-001-attempt-1", "train-r0-shard-000-attempt-1", "train-r0-shard-000-attempt-10",
             "val0-shard-000-attempt-1"]
    for name in names:
        (step / f"{name}.parquet").write_bytes(b"")
    (step / ".tmp-train-shard-001-attempt-2.parquet.5").write_bytes(b"")
    (tmp_path / "progress.json").write_text(json.dumps({"step": 7}))
    history = RolloutHistory(str(tmp_path), Storage())
    assert history.steps() == [7] and history.trained_step() == 7
    assert {k: v.rsplit("/", 1)[-1] for k, v in history.accepted_shards(7).items()} == {
        "train-shard-000": "train-shard-000-attempt-3.parquet",
        "train-shard-001": "train-shard-001-attempt-1.parquet",
        "train-r0-shard-000": "train-r0-shard-000-attempt-10.parquet",
    }


def test_the_steps_record_names_its_shards_whatever_the_attempts(tmp_path):
    # A restarted trainer counts attempts from 1 again: attempt 1 is its, attempt 2 a killed one's.
    step = tmp_path / "rollouts" / "step-3"
    step.mkdir(parents=True)
    for name in ("train-shard-000-attempt-1", "train-shard-000-attempt-2", "train-r0-shard-000-attempt-1"):
        (step / f"{name}.parquet").write_bytes(b"")
    shards = ["train-shard-000-attempt-1.parquet", "train-r0-shard-000-attempt-1.parquet"]
    record = AcceptedRollouts(step=3, shards=shards, keep=[0, 2], off_policy=False, world_size=2, spec_sha256="x")
    (step / "accepted.json").write_bytes(record.to_json())
    history = RolloutHistory(str(tmp_path), Storage())
    assert history.accepted(3) == record and history.accepted(4) is None
    assert history.accepted_shards(3) == {"train-shard-000": f"file://{step}/train-shard-000-attempt-1.parquet",
                                          "train-r0-shard-000": f"file://{step}/train-r0-shard-000-attempt-1.parquet"}
    (step / "accepted.json").write_text(json.dumps({**json.loads(record.to_json()), "shards": ["../step-2/x.parquet"]}))
    with pytest.raises(ValueError, match="outside its step's folder"):
        history.accepted(3)
    (step / "accepted.json").write_text("{}")
    with pytest.raises(ValueError, match="accepted.json: not an accepted-rollouts record"):
        history.accepted(3)


def test_spec_digest_is_of_the_content_not_the_key_order():
    assert spec_digest({"a": 1, "b": {"c": [1, 2]}}) == spec_digest({"b": {"c": [1, 2]}, "a": 1})
    assert spec_digest({"a": 1}) != spec_digest({"a": 2})


def test_not_a_run(tmp_path):
    with pytest.raises(RunNotFound, match="not a run"):
        RolloutHistory(str(tmp_path), Storage())


@pytest.mark.parametrize("text,steps", [("2:5", (2, 5)), ("3", (3, 3)), ("4:", (4, None)), (":9", (None, 9))])
def test_steps(text, steps):
    assert parse_steps(text) == steps


@pytest.mark.parametrize("text", ["5:2", "a:b", "1-3"])
def test_bad_steps_name_the_option(text):
    with pytest.raises(ValueError, match="--steps"):
        parse_steps(text)
