"""`grpo reward` (issue 31) as real processes over real gRPC: a tiny random classifier RM's served
scores equal a direct forward of the same model on the same rendered text; a tiny judge answers
as the hf engine does and its parser reads the answer; a replica killed mid-batch has the batch
scored by the other one, once; with none left the rollout server's Generate fails UNAVAILABLE
(the trainer re-dispatches the shard); the rollout worker keeps each model's score next to the
rule's and combines them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml

import polling

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from grpo_api.jobfile import load_job
from grpo_api.storage import Storage
from grpo_rollout.reward_client import RewardModelClient, RewardModels, RewardModelUnavailable, ScoreItem
from grpo_rollout.reward_models import render_conversation
from grpo_rollout.tiny import build_tiny_reward_model

from .conftest import chat_prompt, prompt_table, write_job

READY = "GRPO_REWARD_READY "   # grpo_rollout.reward_server.READY_PREFIX: the wire contract


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm"), seed=1)


class RewardProcess:
    def __init__(self, job_file, name: str, log_path, token: str):
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_api.cli", "reward", "--spec", str(job_file), "--model", name, "--port", "0",
             "--metrics-port", "-1", "--device", "cpu"],
            stdout=subprocess.PIPE, stderr=self._log, env={**os.environ, "GRPO_RPC_TOKEN": token})
        got: dict = {}

        def read():
            for line in self.proc.stdout:
                if line.decode().startswith(READY):
                    got.update(json.loads(line.decode()[len(READY):]))
                    return
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(180)
        if not got:
            self.proc.kill()
            raise AssertionError(f"grpo reward did not start: {log_path.read_text()[-2000:]}")
        self.address = f"127.0.0.1:{got['port']}"

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)
        self._log.close()


@pytest.fixture
def servers(tmp_path):
    started = []

    def start(job_file, name, token="t0ken"):
        p = RewardProcess(job_file, name, tmp_path / f"reward-{name}-{len(started)}.log", token)
        started.append(p)
        return p
    yield start
    for p in started:
        p.stop(signal.SIGKILL)


def _job(tmp_path, tiny_model, models, **reward):
    return write_job(tmp_path / "job.yaml", tiny_model, reward={"rewardModels": models, **reward})


WORDS = "copy the digit 1 2 3 4 5 6 7 8 9 answer is ####".split()


def _items(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        words = [WORDS[j] for j in torch.randint(len(WORDS), (int(torch.randint(1, 24, (1,), generator=g)),), generator=g)]
        out.append(ScoreItem([{"role": "user", "content": f"copy the digit {i % 10}"}], " ".join(words), str(i % 10)))
    return out


def _direct_scores(tiny_rm, items):
    """The reference: the model's own forward (its own pooling), one unpadded sequence at a time, float64 head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_rm))
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_rm), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for it in items:
            ids = render_conversation(tok, it.messages, it.response, 4096)
            out.append(float(model(input_ids=torch.tensor([ids])).logits[0, -1]))
    return out


def test_served_classifier_scores_equal_a_direct_forward(tmp_path, tiny_model, tiny_rm, servers):
    # A small token budget: several batches, each padded to its longest sequence.
    job = _job(tmp_path, tiny_model, [{"name": "rm", "path": str(tiny_rm), "maxTokensPerBatch": 96}])
    server = servers(job, "rm")
    spec = load_job(job).spec.reward.reward_models[0]
    items = _items(40)
    got = [s.score for s in RewardModelClient(spec, [server.address], "t0ken").score("r1", items)]
    want = _direct_scores(tiny_rm, items)
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(s, 6) for s in got)) > 20     # a random RM still tells texts apart


def test_a_dns_name_as_the_operator_passes_it_scores_the_same(tmp_path, tiny_model, tiny_rm, servers):
    """On Kubernetes a model's address is its headless Service, `dns:///name:port`, dialled with
    round robin over what it resolves to (names.reward_address): the same scores as host:port."""
    job = _job(tmp_path, tiny_model, [{"name": "rm", "path": str(tiny_rm)}])
    server = servers(job, "rm")
    spec = load_job(job).spec.reward.reward_models[0]
    items = _items(6)
    port = server.address.rsplit(":", 1)[1]
    by_name = RewardModelClient(spec, [f"dns:///localhost:{port}"], "t0ken").score("r", items)
    by_ip = RewardModelClient(spec, [server.address], "t0ken").score("r", items)
    assert [s.score for s in by_name] == pytest.approx([s.score for s in by_ip], abs=1e-6)


def test_a_wrong_token_is_refused(tmp_path, tiny_model, tiny_rm, servers):
    job = _job(tmp_path, tiny_model, [{"name": "rm", "path": str(tiny_rm)}])
    server = servers(job, "rm")
    spec = load_job(job).spec.reward.reward_models[0].model_copy(update={"timeout_seconds": 2.0})
    with pytest.raises(RewardModelUnavailable, match="UNAUTHENTICATED"):
        RewardModelClient(spec, [server.address], "wrong", retry_pause=0.1).score("r", _items(2))


def test_unknown_model_name_is_a_clear_start_up_error(tmp_path, tiny_model, tiny_rm):
    job = _job(tmp_path, tiny_model, [{"name": "rm", "path": str(tiny_rm)}])
    out = subprocess.run([sys.executable, "-m", "grpo_api.cli", "reward", "--spec", str(job), "--model", "other"],
                         capture_output=True, text=True, env={**os.environ, "GRPO_RPC_TOKEN": "x"}, timeout=120)
    assert out.returncode == BAD_INPUT_EXIT_CODE and "--model other: not in spec.reward.rewardModels (known: rm)" in out.stderr


def test_tiny_judge_answers_as_the_hf_engine_and_is_parsed(tmp_path, tiny_model, servers):
    from transformers import AutoTokenizer

    from grpo_rollout.engine import SamplingParams
    from grpo_rollout.hf_engine import HFEngine
    from grpo_rollout.reward_models import fill_template, parse_tag_score, token_ids
    from grpo_rollout.reward_models import ScoreInput
    template = "is {response} the answer to {prompt} ? the answer is {ground_truth}"
    job = _job(tmp_path, tiny_model, [{"name": "judge", "kind": "judge", "path": str(tiny_model), "engine": "hf",
                                       "promptTemplate": template, "maxNewTokens": 8, "scoreTag": "score"}])
    server = servers(job, "judge")
    spec = load_job(job).spec.reward.reward_models[0]
    items = _items(6)
    got = RewardModelClient(spec, [server.address], "t0ken").score("r", items)
    tok, engine = AutoTokenizer.from_pretrained(str(tiny_model)), HFEngine(tiny_model)
    prompts = [token_ids(tok.apply_chat_template(
        [{"role": "user", "content": fill_template(template, ScoreInput(it.messages, it.response, it.ground_truth))}],
        add_generation_prompt=True, tokenize=True)) for it in items]
    answers = [engine.decode(g[0].token_ids) for g in engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))]
    assert [s.judge_output for s in got] == answers
    for s, answer in zip(got, answers):
        value = parse_tag_score(answer, "score")
        assert s.parsed == (value is not None) and s.score == (value or 0.0)


def test_replica_killed_mid_batch_the_other_scores_it_once(tmp_path, tiny_model, tiny_rm, servers):
    job = _job(tmp_path, tiny_model, [{"name": "rm", "path": str(tiny_rm), "replicas": 2, "maxTokensPerBatch": 64}])
    first, second = servers(job, "rm"), servers(job, "rm")
    spec = load_job(job).spec.reward.reward_models[0]
    from grpo_rollout.metrics import RolloutMetrics
    metrics = RolloutMetrics("j", "ns", "w")
    client = RewardModelClient(spec, [first.address, second.address], "t0ken", metrics)
    items = _items(800, seed=1)           # long enough on two CPU cores to be killed while scoring
    killer = threading.Timer(0.3, lambda: first.proc.kill())
    killer.start()
    got = client.score("r", items)
    killer.join()
    assert first.proc.wait(30) == -signal.SIGKILL
    assert metrics.registry.get_sample_value("grpo_rollout_reward_model_errors_total", {
        "job": "j", "namespace": "ns", "worker": "w", "model": "rm", "code": "UNAVAILABLE"}) == 1
    # One score per item, the second replica's: the same as scoring the batch there directly.
    assert len(got) == len(items)
    again = RewardModelClient(spec, [second.address], "t0ken").score("r2", items[:200])
    assert [s.score for s in got[:200]] == pytest.approx([s.score for s in again], abs=1e-5)


def test_rollout_worker_combines_and_fails_unavailable_without_replicas(tmp_path, tiny_model, tiny_rm, servers,
                                                                          tokenizer):
    import grpc

    from grpo_rollout.hf_engine import HFEngine
    from grpo_rollout.metrics import RolloutMetrics
    from grpo_rollout.rewards import RewardPool
    from grpo_rollout.server import _status_for
    from grpo_rollout.worker import GenerateJob, RolloutWorker, SamplingOverrides
    (tmp_path / "const.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                       "    return 1.0\n")
    job = _job(tmp_path, tiny_model, [{"name": "rm", "path": str(tiny_rm), "weight": 2.0, "timeoutSeconds": 5}],
               function=f"{tmp_path}/const.py:score", combine="sum")
    server = servers(job, "rm")
    spec = load_job(job).spec
    metrics = RolloutMetrics("j", "ns", "w")
    models = RewardModels(spec.reward.reward_models, {"rm": [server.address]}, "t0ken", metrics)
    pool = RewardPool(spec.reward.function, workers=1, timeout_seconds=5)
    try:
        worker = RolloutWorker(spec=spec, engine=HFEngine(tiny_model), rewards=pool, storage=Storage(),
                               worker_id="w", metrics=metrics, reward_models=models)
        storage = Storage()
        prompt_uri, out_uri = f"file://{tmp_path}/p.parquet", f"file://{tmp_path}/o.parquet"
        messages = [{"role": "user", "content": "copy the digit 3"}]
        storage.write_table(prompt_uri, prompt_table([{"prompt_ids": chat_prompt(tokenizer, "copy the digit 3"),
                                                       "raw_prompt": json.dumps(messages)}]))
        worker.generate(GenerateJob("r", prompt_uri, out_uri, SamplingOverrides(n=4, seed=3), expected_policy_version=0))
        rows = storage.read_table(out_uri).to_pylist()
        items = [ScoreItem(messages, worker.engine.decode(r["response_ids"]), "") for r in rows]
        want = _direct_scores(tiny_rm, items)
        for r, rm in zip(rows, want):
            extra = json.loads(r["reward_extra"])
            assert extra["rule_score"] == 1.0 and extra["rm/rm"] == pytest.approx(rm, abs=1e-5)
            assert r["reward"] == pytest.approx(1.0 + 2.0 * rm, abs=1e-5)       # combine sum, weight 2
        server.stop(signal.SIGKILL)
        with pytest.raises(RewardModelUnavailable) as exc:
            worker.generate(GenerateJob("r2", prompt_uri, f"file://{tmp_path}/o2.parquet", SamplingOverrides(n=4),
                                        expected_policy_version=0))
        assert _status_for(exc.value) == grpc.StatusCode.UNAVAILABLE
        assert not os.path.exists(tmp_path / "o2.parquet")      # nothing written for the failed call
    finally:
        pool.close()
        models.close()
