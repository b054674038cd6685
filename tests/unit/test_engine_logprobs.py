"""Issue 47 item 1: the rollout servers report behaviour log-probs only when training reads them
(`grpo_trainer.rollouts.engine_logprobs_needed`): an off-policy step (maxStaleness 1) takes them
as the old policy, rollout correction weighs, rejects or (bypass) anchors on them; an on-policy
step uses its own log-probs, so vLLM skips its per-token ones (~0.6 s of a 4.4 s generation)
unless rollout.calculateLogProbs keeps them for the records. The engines' side:
tests/rollout/test_hf_engine.py, test_worker.py, test_vllm_adapter.py."""

from __future__ import annotations

import pytest
import torch

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.spec import GRPOJobSpec
from grpo_api.storage import Storage
from grpo_trainer.actor import check_engine_logprobs
from grpo_trainer.batch import Sample, collate
from grpo_trainer.data import PromptRow
from grpo_trainer.rollout_client import ShardResult
from grpo_trainer.rollouts import RolloutSource, engine_logprobs_needed


def spec(rollout: dict | None = None, algorithm: dict | None = None) -> GRPOJobSpec:
    return GRPOJobSpec.model_validate({
        "model": {"path": "/m"}, "data": {"trainFiles": ["/d.parquet"], "trainBatchSize": 2},
        "algorithm": algorithm or {}, "rollout": {"n": 2, **(rollout or {})},
        "trainer": {"miniBatchSize": 2, "microBatchSizePerGPU": 4}, "storage": {"uri": "file:///unused"}})


@pytest.mark.parametrize(("rollout", "algorithm", "needed"), [
    ({}, {}, False),                                                         # on-policy: the trainer's own
    ({}, {"useKLInReward": True, "klCtrl": {"type": "adaptive"}}, False),    # the reward's KL: recomputed
    ({"calculateLogProbs": True}, {}, True),                                 # kept for the records
    ({"maxStaleness": 1}, {}, True),                                         # the old policy
    ({}, {"rolloutCorrection": {"rolloutIs": "token"}}, True),               # TIS: pi_old / pi_rollout
    ({}, {"rolloutCorrection": {"rolloutIs": "token", "rolloutIsThresholdLower": 0.5}}, True),   # IcePop
    ({}, {"rolloutCorrection": {"rolloutRs": ["token_k1"], "rolloutRsThreshold": 2.0}}, True),  # rejection
    ({}, {"rolloutCorrection": {"bypassMode": True}}, True),                 # bypass: the old policy
])
def test_the_engine_reports_logprobs_only_where_training_reads_them(rollout, algorithm, needed):
    assert engine_logprobs_needed(spec(rollout, algorithm)) is needed


class Dispatcher:
    """The rollout servers as RolloutSource.generate reaches them: records each request's sampling."""

    def __init__(self):
        self.servers, self.sampling = self, []

    def addresses(self) -> list[str]:
        return ["a:1"]

    def generate(self, step, tag, shards, sampling, version):
        self.sampling.append(sampling)
        return [ShardResult(name, "w", pb.GenerateReply(rollout_uri=f"file:///{name}")) for name in shards]


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_generate_request_carries_the_decision(max_staleness):
    dispatcher = Dispatcher()
    source = RolloutSource(spec({"maxStaleness": max_staleness}), datasets=None, dispatcher=dispatcher,
                           storage=Storage(), total_steps=1, device=torch.device("cpu"))
    source.generate(1, "train", 0, [PromptRow(0, [1, 2], "d", "7", "{}")], n=2, temperature=1.0, version=0)
    [sampling] = dispatcher.sampling
    # Set explicitly either way: a server takes an unset field as "report them".
    assert sampling.HasField("logprobs") and sampling.logprobs is bool(max_staleness)


def test_rollouts_without_logprobs_train_on_policy_and_are_refused_where_they_are_read():
    samples = [Sample("0-0", 0, i, [11, 12], [21, 22], None, float(i), "stop") for i in range(2)]
    mb = collate([0, 1], samples, None, pad_id=0, device=torch.device("cpu"))
    assert mb.behaviour_logprobs is None and mb.response_mask.tolist() == [[0, 1, 1], [0, 1, 1]]
    with pytest.raises(ValueError, match="carry no behaviour log-probs .*rollout.calculateLogProbs"):
        check_engine_logprobs([mb])
    # A micro-batch whose samples all have them is what an off-policy update reads.
    with_lp = [Sample("0-0", 0, 0, [11, 12], [21, 22], [-0.5, -1.0], 1.0, "stop")]
    check_engine_logprobs([collate([0], with_lp, None, pad_id=0, device=torch.device("cpu"))])
