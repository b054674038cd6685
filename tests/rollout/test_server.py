"""A real `grpo rollout` process on loopback, driven over gRPC as the trainer drives it."""

from __future__ import annotations

import json
import secrets
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.records import ROLLOUT_SCHEMA
from grpo_api.storage import Storage
from grpo_rollout.metrics import RolloutMetrics, serve_http
from grpo_rollout.rewards.gsm8k import gsm8k_score

from .conftest import chat_prompt, prompt_table, start_server

pytestmark = pytest.mark.integration

HANGING_REWARD = '''
import time

def compute_score(*, extra_info, solution_str, **kwargs):   # verl calls by keyword: any order, **kwargs
    mode = extra_info["mode"]
    if mode == "raise":
        raise RuntimeError("reward bug")
    if mode == "hang":
        time.sleep(3600)
    if mode == "garbage":
        return "not a number"
    return {"score": 0.25, "length": len(solution_str)}
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("server")
    srv = start_server(tmp, tiny_model, secrets.token_hex(16))
    yield srv
    srv.stop()


def _generate(server, tmp_path, rows, *, version=0, n=3, max_tokens=8, temperature=1.0, seed=11, shard="s0"):
    storage = Storage()
    prompt_uri = f"file://{tmp_path}/prompts/{shard}.parquet"
    output_uri = f"file://{tmp_path}/rollouts/{shard}.parquet"
    storage.write_table(prompt_uri, prompt_table(rows))
    sampling = pb.SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
    reply = server.stub().Generate(pb.GenerateRequest(
        request_id="r1", prompt_uri=prompt_uri, output_uri=output_uri, sampling=sampling,
        expected_policy_version=version, step=3, shard=shard), timeout=120)
    return reply, storage.read_table(reply.rollout_uri)


def test_generate_writes_one_scored_rollout_shard(server, tmp_path, tokenizer):
    prompts = [chat_prompt(tokenizer, "copy the digit 7 then answer"), chat_prompt(tokenizer, "the answer is 3")]
    reply, table = _generate(server, tmp_path, [
        {"prompt_ids": prompts[0], "ground_truth": "7"}, {"prompt_ids": prompts[1], "ground_truth": "3"}])

    assert (reply.num_prompts, reply.num_samples, reply.policy_version) == (2, 6, 0)
    assert table.schema.equals(ROLLOUT_SCHEMA)
    rows = table.to_pylist()
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(2) for s in range(3)]
    assert reply.generated_tokens == sum(len(r["response_ids"]) for r in rows)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in rows:
        assert r["prompt_ids"] == prompts[r["prompt_index"]]
        assert 1 <= len(r["response_ids"]) <= 8
        assert len(r["response_logprobs"]) == len(r["response_ids"])
        assert all(lp <= 0 for lp in r["response_logprobs"])
        assert r["finish_reason"] == ("stop" if r["response_ids"][-1] == eos else "length")
        # The reward is verl's GSM8K rule on the decoded response.
        text = tokenizer.decode(r["response_ids"], skip_special_tokens=True)
        assert r["reward"] == gsm8k_score(text, r["ground_truth"])
        assert r["policy_version"] == 0 and r["worker"] == "w0" and r["data_source"] == "openai/gsm8k"
    # Same request, same seed: the same samples.
    _, again = _generate(server, tmp_path, [
        {"prompt_ids": prompts[0], "ground_truth": "7"}, {"prompt_ids": prompts[1], "ground_truth": "3"}])
    assert again.column("response_ids").to_pylist() == table.column("response_ids").to_pylist()
    assert server.metric("grpo_rollout_generated_tokens_total", job="rollout-test", namespace="default") >= reply.generated_tokens


def test_wrong_policy_version_is_refused(server, tmp_path, tokenizer):
    with pytest.raises(grpc.RpcError) as err:
        _generate(server, tmp_path, [{"prompt_ids": chat_prompt(tokenizer, "copy 1")}], version=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "expects 5" in err.value.details()


def test_bad_requests_get_clear_status_codes(server, tmp_path, tokenizer):
    stub = server.stub()
    missing = pb.GenerateRequest(prompt_uri=f"file://{tmp_path}/nope.parquet", output_uri=f"file://{tmp_path}/o.parquet")
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(missing, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        _generate(server, tmp_path, [{"prompt_ids": chat_prompt(tokenizer, "copy 2")}], temperature=-1.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in err.value.details()
    # The server is still serving.
    assert stub.Health(pb.HealthRequest(), timeout=10).ready


@pytest.mark.parametrize("token", ["", "wrong-token"], ids=["missing", "wrong"])
def test_calls_without_the_right_token_are_refused(server, token):
    if token:
        stub = server.stub(token=token)
    else:
        from grpo_api.proto.rollout_pb2_grpc import RolloutStub
        stub = RolloutStub(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.Health(pb.HealthRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Streaming calls too: weights can't be pushed by whoever reaches the port.
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWeights(iter([pb.WeightChunk(version=9, num_buckets=1, last_in_bucket=True)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.stub().Health(pb.HealthRequest(), timeout=10).policy_version == 0


def test_health_info_metrics_and_readiness(server):
    health = server.stub().Health(pb.HealthRequest(), timeout=10)
    assert (health.ready, health.policy_version, health.status) == (True, 0, "ready")
    info = server.stub().Info(pb.InfoRequest(), timeout=10)
    assert (info.worker_id, info.engine, info.device) == ("w0", "hf", "cpu")
    assert info.num_parameters > 0
    assert urllib.request.urlopen(f"{server.metrics_url}/ready", timeout=10).status == 200
    assert server.metric("grpo_rollout_policy_version", job="rollout-test", namespace="default", worker="w0") == 0


def test_failing_reward_functions_score_zero_and_the_server_survives(tmp_path, tiny_model, tokenizer):
    (tmp_path / "my_reward.py").write_text(HANGING_REWARD)
    srv = start_server(tmp_path, tiny_model, secrets.token_hex(16), worker_id="w-custom",
                       reward={"function": "my_reward.py:compute_score", "timeoutSeconds": 1.5, "workers": 2})
    try:
        ids = chat_prompt(tokenizer, "copy the digit 5")
        modes = ["ok", "raise", "hang", "garbage"]
        started = time.monotonic()
        reply, table = _generate(srv, tmp_path, [{"prompt_ids": ids, "extra_info": {"mode": m}} for m in modes], n=2)
        assert time.monotonic() - started < 30  # the hung calls cost their timeout, not forever
        rows = table.to_pylist()
        by_mode = {m: [r for r in rows if r["prompt_index"] == i] for i, m in enumerate(modes)}
        assert all(r["reward"] == 0.25 for r in by_mode["ok"])
        assert all(json.loads(r["reward_extra"])["length"] >= 0 for r in by_mode["ok"])
        assert [r["reward_error"] for r in by_mode["ok"]] == [None, None]
        for mode, kind in (("raise", "exception"), ("hang", "timeout"), ("garbage", "invalid")):
            assert all(r["reward"] == 0.0 for r in by_mode[mode]), mode
            # the record says how, and what the trainer shows: the function and its error
            assert [r["reward_error"] for r in by_mode[mode]] == [kind, kind]
            assert all(json.loads(r["reward_extra"])["reward_error"].startswith("my_reward.py:compute_score: ")
                       for r in by_mode[mode]), mode
        assert "RuntimeError: reward bug" in json.loads(by_mode["raise"][0]["reward_extra"])["reward_error"]
        assert reply.reward_errors == 6
        labels = dict(job="rollout-test", namespace="default")
        assert srv.metric("grpo_rollout_reward_errors_total", kind="exception", **labels) == 2
        assert srv.metric("grpo_rollout_reward_errors_total", kind="timeout", **labels) == 2
        assert srv.metric("grpo_rollout_reward_errors_total", kind="invalid", **labels) == 2
        # Still serving, and the hung workers were replaced: a second request scores again.
        reply2, table2 = _generate(srv, tmp_path, [{"prompt_ids": ids, "extra_info": {"mode": "ok"}}], n=2, shard="s1")
        assert reply2.reward_errors == 0 and table2.column("reward").to_pylist() == [0.25, 0.25]
        assert srv.log().count("reward bug") == 1  # logged once, then only counted
    finally:
        assert srv.stop() == 0


def test_a_bad_reward_function_stops_the_server_at_startup(tmp_path, tiny_model):
    from .conftest import RolloutProcess, write_job
    job = write_job(tmp_path / "job.yaml", tiny_model, reward={"function": "no_such_file.py:score"})
    with pytest.raises(RuntimeError, match="no_such_file.py"):
        RolloutProcess(job, tmp_path / "bad.log", "t0k3n")


def test_sigterm_stops_the_server_gracefully(tmp_path, tiny_model):
    srv = start_server(tmp_path, tiny_model, "t0k3n", worker_id="w-term")
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{srv.metrics_url}/ready", timeout=2)
    srv.stop()


def test_sigterm_taken_by_another_thread_of_the_server_still_stops_it(tmp_path, tiny_model):
    """The kernel gives a process-wide signal (kill, the launcher's death signal) to any thread
    that doesn't block it, here one of gRPC's: Python runs the handler in the main thread, which
    must wake up for it (an untimed wait there left the server up for good)."""
    import ctypes
    import os

    srv = start_server(tmp_path, tiny_model, "t0k3n", worker_id="w-thread")
    pid = srv.proc.pid

    def takes_sigterm(tid: int) -> bool:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        blocked = int(status.split("SigBlk:")[1].split()[0], 16)
        return not blocked & (1 << (signal.SIGTERM - 1))
    tasks = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    others = {t: Path(f"/proc/{pid}/task/{t}/comm").read_text().strip() for t in tasks if t != pid and takes_sigterm(t)}
    assert others, tasks
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(234, pid, max(others), signal.SIGTERM) == 0     # tgkill(2) on x86_64: to that thread alone
    assert srv.proc.wait(30) == 0
    srv.stop()


def test_liveness_fails_while_a_request_is_stuck_in_the_engine():
    """`/live?stuckAfterSeconds=N`, the rollout pods' liveness probe: 503 once a Generate call has
    been inside the engine (or waiting for it) longer than N seconds, 200 again when it returns."""
    metrics = RolloutMetrics("j", "ns", "w")
    http = serve_http(metrics.registry, 0, ready=lambda: True, host="127.0.0.1")
    url = f"http://127.0.0.1:{http.server_address[1]}"

    def live() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{url}/live?stuckAfterSeconds=1", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
    try:
        assert live() == (200, "live\n")
        with metrics.in_flight():                       # a call the engine doesn't return from
            assert live()[0] == 200
            deadline = time.monotonic() + 30
            while live()[0] == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            status, body = live()
            assert status == 503 and "engine stuck" in body, body
            exported = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
            (line,) = [ln for ln in exported.splitlines() if ln.startswith("grpo_rollout_oldest_request_seconds{")]
            assert float(line.split()[-1]) > 1       # the same number, for an alert
        assert live() == (200, "live\n")
    finally:
        http.shutdown()
