"""DAPO dynamic sampling (`algorithm.filterGroups`), the rounds of `RolloutSource` in process
against hand-worked reward tables: groups whose rewards are all equal are dropped, more prompts
are generated until trainBatchSize informative groups are found (at most MAX_GENERATION_ROUNDS
rounds, then topped up with uninformative ones), and the update sees exactly the kept groups.

Only the rollout servers are replaced (`Servers`: each prompt shard's rollouts written to real
file:// storage with the table's rewards); the sampler, the shard split, the rounds, the reading
back and the kept samples are the trainer's own code. One real run with servers:
tests/integration/test_dynamic_sampling.py."""

from __future__ import annotations

import io
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.records import ROLLOUT_SCHEMA
from grpo_api.spec import GRPOJobSpec
from grpo_api.storage import Storage
from grpo_trainer.data import Datasets, EpochSampler, PromptDataset, PromptRow
from grpo_trainer.reward_checks import RewardFunctionFailed
from grpo_trainer.rollout_client import ShardResult
from grpo_trainer.rollouts import MAX_GENERATION_ROUNDS, RolloutSource

N = 4            # rollout.n
SIZE = 4         # data.trainBatchSize
PROMPTS = 64     # in the dataset


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    """`next` is a collective: a one-rank gloo group (its broadcasts are no-ops)."""
    if dist.is_initialized():      # another in-process test's group, still up
        assert dist.get_world_size() == 1
        yield
        return
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Servers:
    """Two rollout servers as the dispatcher reaches them: each prompt shard comes back as a
    rollout shard in storage, the rewards of global prompt p's samples `rewards(p)`, the shard's
    scoring time `seconds[k]` for shard k of a round; `calls` records (tag, version, prompt
    indices) of every round."""

    def __init__(self, tmp_path, rewards, seconds=(0.25, 0.5), errors=lambda p: None):
        self.root, self.rewards, self.seconds, self.errors = tmp_path, rewards, seconds, errors
        self.calls: list[tuple[str, int, list[int]]] = []
        self.servers = self        # the dispatcher's `servers.addresses()`

    def addresses(self) -> list[str]:
        return ["a:1", "b:1"]

    def generate(self, step, tag, shards, sampling, version):
        assert sampling.n == N
        results, indices = [], []
        for k, (name, data) in enumerate(shards.items()):
            prompts = pq.read_table(io.BytesIO(data)).to_pylist()
            indices += [p["prompt_index"] for p in prompts]
            rows = [{"uid": p["uid"], "prompt_index": p["prompt_index"], "sample_index": i,
                     "prompt_ids": p["prompt_ids"], "response_ids": [100 + p["prompt_index"]] * (i + 1),
                     "response_logprobs": [-0.5] * (i + 1), "reward": self.rewards(p["prompt_index"])[i],
                     "reward_extra": "{}", "finish_reason": "stop", "policy_version": version,
                     "data_source": "d", "ground_truth": "7", "worker": "w",
                     "reward_error": self.errors(p["prompt_index"])}
                    for p in prompts for i in range(N)]
            uri = f"file://{self.root}/step-{step}/{name}.parquet"
            (self.root / f"step-{step}").mkdir(exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA), uri.removeprefix("file://"))
            results.append(ShardResult(name, "w", pb.GenerateReply(rollout_uri=uri, reward_seconds=self.seconds[k])))
        self.calls.append((tag, version, indices))
        return results


def source(servers: Servers, **reward) -> RolloutSource:
    spec = GRPOJobSpec.model_validate({
        "model": {"path": "/m"}, "data": {"trainFiles": ["/d.parquet"], "trainBatchSize": SIZE, "shuffle": False},
        "algorithm": {"filterGroups": True}, "rollout": {"n": N}, "reward": reward,
        "trainer": {"miniBatchSize": SIZE}, "storage": {"uri": "file:///unused"}})
    rows = [PromptRow(i, [1, 2, 3 + i], "d", "7", "{}") for i in range(PROMPTS)]
    datasets = Datasets(PromptDataset(rows), None, EpochSampler(PROMPTS, SIZE, seed=0, shuffle=False))
    return RolloutSource(spec, datasets=datasets, dispatcher=servers, storage=Storage(), total_steps=2,
                         device=torch.device("cpu"))


def tie(p):
    return [0.0] * N


def spread(p):
    return [0.0, 1.0, 0.0, 0.0]


def test_rounds_run_until_enough_groups_are_informative_and_the_update_sees_only_those(tmp_path, caplog):
    # Round 1 (prompts 0-3): 1 and 3 informative. Round 2 (4-7): 4 and 6 too: 4 found, stop.
    informative = {1, 3, 4, 6}
    servers = Servers(tmp_path, lambda p: spread(p) if p in informative else tie(p))
    caplog.set_level(logging.INFO, logger="grpo.trainer")
    batch, samples = source(servers).next(1, version=3)
    assert "Step 1 / 2 (epoch 0): Generating rollouts for 4 prompts" in caplog.text
    # every round on the batch's policy, the later one's prompts numbered after the first's
    assert servers.calls == [("train", 3, [0, 1, 2, 3]), ("train-r1", 3, [4, 5, 6, 7])]
    assert (batch.rounds, batch.prompts, batch.keep, batch.filtered_groups) == (2, 8, [1, 3, 4, 6], 4)
    assert len(batch.uris) == 4               # 2 shards a round
    # scoring runs per round, its time the slowest shard's: 0.5 + 0.5
    assert batch.reward_s == pytest.approx(1.0)
    # the update sees the kept groups alone, renumbered 0..3 in order, every sample of each
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, i) for p in range(4) for i in range(N)]
    assert [s.response_ids[0] - 100 for s in samples[::N]] == [1, 3, 4, 6]
    assert {s.policy_version for s in samples} == {3}


def test_a_first_round_with_enough_informative_groups_is_the_only_one(tmp_path):
    servers = Servers(tmp_path, spread)
    batch, samples = source(servers).next(1, version=0)
    assert (batch.rounds, batch.prompts, batch.keep, batch.filtered_groups) == (1, 4, [0, 1, 2, 3], 0)
    assert batch.reward_s == pytest.approx(0.5) and len(samples) == SIZE * N


def test_after_the_last_round_uninformative_groups_top_up_the_batch(tmp_path, caplog):
    # One informative group (prompt 5) in MAX_GENERATION_ROUNDS rounds: it, then the first three
    # of the others by index.
    servers = Servers(tmp_path, lambda p: spread(p) if p == 5 else tie(p), seconds=(0.1, 0.0))
    batch, samples = source(servers).next(1, version=0)
    generated = SIZE * MAX_GENERATION_ROUNDS
    assert [c[2] for c in servers.calls] == [list(range(k, k + SIZE)) for k in range(0, generated, SIZE)]
    assert (batch.rounds, batch.prompts, batch.keep) == (MAX_GENERATION_ROUNDS, generated, [0, 1, 2, 5])
    assert batch.filtered_groups == generated - 1
    assert batch.reward_s == pytest.approx(0.1 * MAX_GENERATION_ROUNDS)
    assert "1 informative groups after 10 rounds; topping up" in caplog.text
    assert [s.response_ids[0] - 100 for s in samples[::N]] == [0, 1, 2, 5]


def test_a_broken_reward_function_stops_the_rounds_and_the_run(tmp_path):
    # Every sample's reward failed (scored 0: all groups tie): no round more, and the step fails
    # naming the reward function, not after ten rounds of zeros.
    servers = Servers(tmp_path, tie, errors=lambda p: "exception")
    with pytest.raises(RewardFunctionFailed, match="failed for 16 of 16 samples of step 1"):
        source(servers).next(1, version=0)
    assert len(servers.calls) == 1
