"""DAPO dynamic sampling (`algorithm.filterGroups`): groups whose rewards are all equal are
dropped and replaced by newly generated ones, so the update sees trainBatchSize informative
groups. Real torchrun trainer (2 ranks) and real rollout servers: one run, with rollout.maxStaleness 1
(every generation round of step 2 runs while step 1 trains). The rounds themselves (which groups
are kept, the top-up after the last round, a broken reward function, each round on the batch's
policy) are tested in process: tests/unit/test_dynamic_sampling_rounds.py."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from integration_helpers import read_metrics, read_step_tables, run_root, run_trainer, start_rollout_servers, write_job

pytestmark = pytest.mark.integration
SCORE_SECONDS = 0.1


def test_filter_groups_trains_on_informative_groups_only(tmp_path, tiny_model, quickstart_data, dense_reward,
                                                         token):
    # The dense reward, SCORE_SECONDS per call: timing_s/reward must add up every round's scoring.
    slow = tmp_path / "slow_reward.py"
    slow.write_text(Path(dense_reward.split(":")[0]).read_text() + "\n\nimport time as _time\n_score = compute_score\n\n\n"
                    f"def compute_score(*args, **kwargs):\n    _time.sleep({SCORE_SECONDS})\n"
                    "    return _score(*args, **kwargs)\n")
    job = write_job(tmp_path / "job.yaml", name="dapo", model=tiny_model, train=quickstart_data[0],
                    storage=tmp_path / "store", algorithm={"filterGroups": True},
                    reward={"function": f"{slow}:compute_score"}, rollout={"maxStaleness": 1},
                    trainer={"totalSteps": 2})
    servers = start_rollout_servers(job, token, 2, tmp_path, ready=False)
    try:
        result = run_trainer(job, rollout=",".join(s.address for s in servers), token=token)
    finally:
        for s in servers:
            s.stop()
    assert result.returncode == 0, result.output[-4000:]
    # The console counts steps against the run's steps, and the epoch as training/epoch does.
    assert "Step 1 / 2 (epoch 0): Generating rollouts for 4 prompts" in result.output
    assert "Step 2 / 2 (epoch 0)" in result.output and "Epoch" not in result.output
    root = run_root(tmp_path / "store", "dapo")
    metrics = [m for m in read_metrics(root) if "training/step" in m]
    assert [m["training/step"] for m in metrics] == [1, 2]
    for m in metrics:
        step = m["training/step"]
        # every response generated this step, over all generation rounds
        rows = read_step_tables(root, "rollouts", step, prefix="train").to_pylist()
        assert {r["policy_version"] for r in rows} == {0}   # step 2's rounds too: one update behind
        groups: dict[int, set[float]] = {}
        for r in rows:
            groups.setdefault(r["prompt_index"], set()).add(r["reward"])
        informative = sorted(p for p, rewards in groups.items() if len(rewards) > 1)
        others = sorted(p for p, rewards in groups.items() if len(rewards) == 1)
        assert m["rollout/filtered_groups"] == len(others)
        # the update saw exactly trainBatchSize (4) groups: informative ones first, the rest only
        # as a top-up after the last generation round
        kept = set((informative + others)[:4])
        tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows if r["prompt_index"] in kept)
        assert m["perf/total_num_tokens"] == tokens
        if len(others) and len(informative) >= 4:
            assert len(groups) > 4            # it generated more than one batch to replace them
        # Scoring is part of every round: a round's time is its slowest shard's (one reward
        # worker per server scores its samples one by one).
        shards = {f.name: pq.read_metadata(f).num_rows for f in (root / "rollouts" / f"step-{step}").glob("train*.parquet")}
        rounds = {name.split("-shard")[0] for name in shards}
        least = sum(max(n for name, n in shards.items() if name.startswith(r + "-shard")) for r in rounds) * SCORE_SECONDS
        assert m["timing_s/reward"] >= 0.9 * least, (m["timing_s/reward"], least, sorted(shards))
