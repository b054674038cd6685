"""storage.keepRolloutsSteps (issue 35 item 4) on real local storage: which step folders the
trainer deletes after a step, what it records, and that readers skip them. On a real run (the
trainer deleting, replay and export after it): tests/integration/test_replay.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_api.records import ROLLOUT_SCHEMA, RunLayout
from grpo_trainer.rollout_history import Filters, RolloutHistory
from grpo_api.storage import Storage
from grpo_trainer.retention import prune_rollouts, steps_to_delete


def make_run(root, steps) -> None:
    for step in steps:
        for kind in ("rollouts", "prompts"):
            (root / kind / f"step-{step}").mkdir(parents=True)
            (root / kind / f"step-{step}" / "train-shard-000-attempt-1.parquet").write_bytes(b"x")
    (root / "progress.json").write_text(json.dumps({"step": max(steps)}))


def left(root, kind="rollouts") -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (root / kind).iterdir() if p.is_dir())


def test_the_last_n_steps_and_each_checkpoints_next_step_stay(tmp_path):
    # After step 10, keep 3: steps 8-10 stay, and 5 and 9 (checkpoints 4 and 8: a resume from
    # them trains 5 or 9 next, replay of 5 or 9 starts from them). By hand: 1-4, 6, 7 go.
    make_run(tmp_path, range(1, 11))
    layout, storage = RunLayout(f"file://{tmp_path}"), Storage()
    assert prune_rollouts(layout, storage, step=10, keep=3, checkpoints=[4, 8]) == [1, 2, 3, 4, 6, 7]
    assert left(tmp_path) == left(tmp_path, "prompts") == [5, 8, 9, 10]
    history = RolloutHistory(f"file://{tmp_path}", storage)
    record = history.retention()
    assert record.deleted == [[1, 4], [6, 7]]
    assert record.describe() == "steps 1-4, 6-7 deleted by storage.keepRolloutsSteps (3)"
    assert record.describe(2, 5) == "steps 2-4 deleted by storage.keepRolloutsSteps (3)"
    assert record.describe(6, 6) == "step 6 deleted by storage.keepRolloutsSteps (3)"
    assert record.describe(8, 10) == ""

    # Step 11; trainer.keepCheckpoints has removed checkpoint 4, so step 5 goes now too.
    make_run(tmp_path, [11])
    assert prune_rollouts(layout, storage, step=11, keep=3, checkpoints=[8, 11]) == [5, 8]
    assert left(tmp_path) == [9, 10, 11]
    assert history.retention().deleted == [[1, 8]]
    assert prune_rollouts(layout, storage, step=11, keep=3, checkpoints=[8, 11]) == []     # nothing more


def test_a_step_being_deleted_is_not_read(tmp_path):
    # The record is written before the folders go: a reader in between skips the step whose
    # shard may be half gone (here: not parquet at all), and reads the others.
    make_run(tmp_path, [1, 2])
    row = {"uid": "0-3", "prompt_index": 0, "sample_index": 0, "prompt_ids": [1, 2], "response_ids": [3],
           "response_logprobs": [-0.5], "reward": 1.0, "reward_extra": "{}", "finish_reason": "stop",
           "policy_version": 1, "data_source": "d", "ground_truth": "7", "worker": "w"}
    pq.write_table(pa.Table.from_pylist([row], schema=ROLLOUT_SCHEMA),
                   tmp_path / "rollouts" / "step-2" / "train-shard-000-attempt-1.parquet")
    (tmp_path / "rollouts" / "retention.json").write_text(json.dumps({"keepRolloutsSteps": 1, "deleted": [[1, 1]]}))
    tables = list(RolloutHistory(f"file://{tmp_path}", Storage()).tables(Filters()))
    assert [t["step"].to_pylist() for t in tables] == [[2]]


def test_steps_to_delete_never_touches_the_newest_steps():
    assert steps_to_delete([1, 2, 3], step=3, keep=3, checkpoints=[]) == []
    assert steps_to_delete([1, 2, 3, 4], step=3, keep=1, checkpoints=[]) == [1, 2]    # 4: generated ahead
    assert steps_to_delete([1, 2, 3], step=3, keep=1, checkpoints=[1]) == [1]           # 2: after checkpoint 1
