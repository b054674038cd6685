"""The rollout worker in-process (no gRPC): request defaults and DAPO overlong shaping."""

from __future__ import annotations

import json

import pytest

from grpo_api.jobfile import load_job
from grpo_api.storage import Storage
from grpo_rollout.hf_engine import HFEngine
from grpo_rollout.metrics import RolloutMetrics
from grpo_rollout.rewards import RewardPool, overlong_penalty
from grpo_rollout.worker import GenerateJob, RolloutWorker, SamplingOverrides, derive_seed, resolve_sampling

from .conftest import chat_prompt, prompt_table, write_job

CONSTANT_REWARD = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


@pytest.fixture
def make_worker(tmp_path, tiny_model):
    made = []

    def make(**spec):
        job = load_job(write_job(tmp_path / "job.yaml", tiny_model, **spec))
        pool = RewardPool(job.spec.reward.function, workers=1, timeout_seconds=5)
        made.append(pool)
        return RolloutWorker(spec=job.spec, engine=HFEngine(tiny_model), rewards=pool, storage=Storage(),
                             worker_id="w", metrics=RolloutMetrics("j", "ns", "w"))
    yield make
    for pool in made:
        pool.close()


def test_requests_fall_back_to_the_jobs_sampling_settings(tmp_path, tiny_model):
    spec = load_job(write_job(tmp_path / "job.yaml", tiny_model, rollout={"n": 3, "temperature": 0.9, "topP": 0.8})).spec
    job = GenerateJob("r", "p", "o", SamplingOverrides(), expected_policy_version=0, step=4, shard="s2")
    params = resolve_sampling(spec, job)
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.top_k) == (3, 12, 0.9, 0.8, -1)
    assert params.seed == derive_seed(7, 4, "s2") != derive_seed(7, 5, "s2")
    greedy = GenerateJob("r", "p", "o", SamplingOverrides(temperature=0.0, n=1), expected_policy_version=0)
    assert resolve_sampling(spec, greedy).greedy  # an explicit 0 is greedy, not "unset"


def test_overlong_responses_are_penalized(make_worker, tmp_path, tokenizer):
    (tmp_path / "const.py").write_text(CONSTANT_REWARD)
    worker = make_worker(reward={"function": f"{tmp_path}/const.py:score",
                                 "overlongBuffer": {"enable": True, "len": 4, "penaltyFactor": 1.0}})
    storage = Storage()
    prompt_uri, out_uri = f"file://{tmp_path}/p.parquet", f"file://{tmp_path}/o.parquet"
    storage.write_table(prompt_uri, prompt_table([{"prompt_ids": chat_prompt(tokenizer, "copy the digit 2")}]))
    worker.generate(GenerateJob("r", prompt_uri, out_uri, SamplingOverrides(n=8, seed=3), expected_policy_version=0))
    rows = storage.read_table(out_uri).to_pylist()
    lengths = {len(r["response_ids"]) for r in rows}
    assert 12 in lengths  # some responses ran to maxResponseLength
    for r in rows:
        penalty = overlong_penalty(len(r["response_ids"]), 12, 4, 1.0)
        assert r["reward"] == pytest.approx(1.0 + penalty)
        extra = json.loads(r["reward_extra"])
        assert extra["overlong_reward"] == pytest.approx(penalty) and extra["overlong"] == (penalty < 0)



def test_a_request_for_no_logprobs_writes_null_ones_that_the_trainer_reads_as_none(make_worker, tmp_path, tokenizer):
    """Issue 47: an on-policy step asks for no behaviour logprobs (GenerateRequest's
    sampling.logprobs false); an older request, without the field, still gets them."""
    from grpo_api.proto import rollout_pb2 as pb
    from grpo_rollout.server import job_from_proto
    from grpo_trainer.batch import samples_from_table
    worker, storage = make_worker(), Storage()
    prompt_uri = f"file://{tmp_path}/p.parquet"
    storage.write_table(prompt_uri, prompt_table([{"prompt_ids": chat_prompt(tokenizer, "copy the digit 2")}]))
    read = {}
    for asked in (None, True, False):
        out_uri = f"file://{tmp_path}/o-{asked}.parquet"
        sampling = pb.SamplingParams(n=4, seed=3) if asked is None else pb.SamplingParams(n=4, seed=3, logprobs=asked)
        job = job_from_proto(pb.GenerateRequest(prompt_uri=prompt_uri, output_uri=out_uri, sampling=sampling))
        assert resolve_sampling(worker.spec, job).logprobs is (asked is not False)
        worker.generate(job)
        read[asked] = samples_from_table(storage.read_table(out_uri))
    for s in read[None] + read[True]:
        assert len(s.behaviour_logprobs) == len(s.response_ids) and all(lp <= 0 for lp in s.behaviour_logprobs)
    assert all(s.behaviour_logprobs is None for s in read[False])
    # The same seed draws the same responses either way.
    assert [s.response_ids for s in read[False]] == [s.response_ids for s in read[True]]
