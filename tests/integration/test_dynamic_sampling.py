"""DAPO dynamic sampling (`algorithm.filterGroups`): groups whose rewards are all equal are
dropped and replaced by newly generated ones, so the update sees trainBatchSize informative
groups. Real torchrun trainer (2 ranks) and real rollout servers."""

from __future__ import annotations

import pytest

from integration_helpers import read_metrics, read_step_tables, run_root, run_trainer, start_rollout_servers, write_job

pytestmark = pytest.mark.integration


def test_filter_groups_trains_on_informative_groups_only(tmp_path, tiny_model, quickstart_data, dense_reward,
                                                         token):
    job = write_job(tmp_path / "job.yaml", name="dapo", model=tiny_model, train=quickstart_data[0],
                    storage=tmp_path / "store", algorithm={"filterGroups": True},
                    reward={"function": dense_reward}, trainer={"totalSteps": 2})
    servers = start_rollout_servers(job, token, 2, tmp_path)
    try:
        result = run_trainer(job, rollout=",".join(s.address for s in servers), token=token)
    finally:
        for s in servers:
            s.stop()
    assert result.returncode == 0, result.output[-4000:]
    root = run_root(tmp_path / "store", "dapo")
    metrics = [m for m in read_metrics(root) if "training/step" in m]
    assert [m["training/step"] for m in metrics] == [1, 2]
    for m in metrics:
        step = m["training/step"]
        # every response generated this step, over all generation rounds
        rows = read_step_tables(root, "rollouts", step, prefix="train").to_pylist()
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
