"""Sleep mode of a colocated rollout server (issue 46), in process: the trainer's EngineSleep asks a
real gRPC server (hf engine) to sleep and wake. The hf engine keeps its weights (it frees only
torch's cached GPU blocks; on CPU nothing): it generates the same greedy tokens after waking. An
engine that drops its weights at level 2, as vLLM does, leaves the server at an unknown version:
it refuses to generate until a full weight sync (which wakes it), and then generates the synced
policy's tokens."""

from __future__ import annotations

import secrets

import grpc
import pytest
import torch

from grpo_api.jobfile import load_job
from grpo_api.proto import rollout_pb2 as pb
from grpo_api.rpc import RolloutClients
from grpo_api.storage import Storage
from grpo_rollout.engine import SamplingParams
from grpo_rollout.hf_engine import HFEngine
from grpo_rollout.metrics import RolloutMetrics
from grpo_rollout.rewards import RewardPool
from grpo_rollout.server import RolloutServicer, start_server
from grpo_rollout.worker import RolloutWorker
from grpo_trainer.engine_sleep import EngineSleep
from grpo_trainer.weight_sync import GrpcWeightSender

from .conftest import chat_prompt, prompt_table, write_job

GREEDY_TOKENS = 10


class DroppingHFEngine(HFEngine):
    """Discards its weights at level 2, as vLLM's sleep mode does (they come back as garbage)."""

    def sleep(self, level: int) -> bool:
        if level >= 2:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))
        return level >= 2


class Servers:
    """What rank 0's EngineSleep talks to: RolloutServers' addresses() and clients."""

    def __init__(self, addresses, token):
        self._addresses, self.token, self.clients = addresses, token, RolloutClients(token)

    def addresses(self):
        return self._addresses


@pytest.fixture
def serve(tmp_path, tiny_model):
    started = []

    def make(engine_class):
        job = load_job(write_job(tmp_path / "job.yaml", tiny_model))
        pool = RewardPool(job.spec.reward.function, workers=1, timeout_seconds=5)
        worker = RolloutWorker(spec=job.spec, engine=engine_class(tiny_model), rewards=pool, storage=Storage(),
                               worker_id="w", metrics=RolloutMetrics("j", "ns", "w"))
        token = secrets.token_hex(16)
        server, port = start_server(RolloutServicer(worker), token, host="127.0.0.1", port=0)
        started.append((server, pool))
        spec = job.spec.model_copy(update={"rollout": job.spec.rollout.model_copy(update={"placement": "colocated"})})
        servers = Servers([f"127.0.0.1:{port}"], token)
        return worker, servers, EngineSleep(spec, servers, rank=0)
    yield make
    for server, pool in started:
        server.stop(0)
        pool.close()


def _greedy(servers, tmp_path, tokenizer, version: int, tag: str):
    storage = Storage()
    prompt_uri, output_uri = f"file://{tmp_path}/p-{tag}.parquet", f"file://{tmp_path}/r-{tag}.parquet"
    storage.write_table(prompt_uri, prompt_table([{"prompt_ids": chat_prompt(tokenizer, "copy the digit 4")}]))
    stub = servers.clients(servers.addresses()[0])
    sampling = pb.SamplingParams(n=1, max_tokens=GREEDY_TOKENS, temperature=0.0)
    reply = stub.Generate(pb.GenerateRequest(prompt_uri=prompt_uri, output_uri=output_uri,
                                             expected_policy_version=version, sampling=sampling), timeout=60)
    return storage.read_table(reply.rollout_uri).column("response_ids").to_pylist()


def test_hf_engine_sleeps_and_wakes_with_its_weights(serve, tmp_path, tokenizer):
    worker, servers, sleep = serve(HFEngine)
    before = _greedy(servers, tmp_path, tokenizer, 0, "before")
    timing = sleep.sleep()
    assert set(timing) == {"timing_s/sleep"} and timing["timing_s/sleep"] >= 0
    health = servers.clients.health(servers.addresses()[0])
    # its weights kept, it can serve: a Generate wakes it
    assert health.status == "ready (asleep at level 2: kv_cache, weights)" and health.ready
    assert health.policy_version == 0
    assert set(sleep.wake()) == {"timing_s/wake"}
    health = servers.clients.health(servers.addresses()[0])
    assert health.ready and health.policy_version == 0 and health.status == "ready"
    assert _greedy(servers, tmp_path, tokenizer, 0, "after") == before


def test_a_generate_wakes_a_sleeping_server(serve, tmp_path, tokenizer):
    worker, servers, sleep = serve(HFEngine)
    before = _greedy(servers, tmp_path, tokenizer, 0, "before")
    sleep.sleep()
    assert _greedy(servers, tmp_path, tokenizer, 0, "asleep") == before
    assert not worker.asleep


def test_dropped_weights_need_a_full_sync_before_generating(serve, tmp_path, tokenizer):
    worker, servers, sleep = serve(DroppingHFEngine)
    reference = HFEngine(worker.engine._model_path)
    greedy = SamplingParams(n=1, max_tokens=GREEDY_TOKENS, temperature=0.0)
    expected = [s[0].token_ids for s in reference.generate([chat_prompt(tokenizer, "copy the digit 4")], greedy)]
    sleep.sleep()
    address = servers.addresses()[0]
    health = servers.clients.health(address)
    # what the publisher's re-sync checks (ensure_version): not ready, version unknown
    assert not health.ready and health.policy_version == -1
    sleep.wake()
    with pytest.raises(grpc.RpcError) as refused:
        _greedy(servers, tmp_path, tokenizer, 0, "garbage")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    sender = GrpcWeightSender(servers.clients, bucket_bytes=32 << 10)
    sender.send([address], reference.model.state_dict().items(), 1)
    assert servers.clients.health(address).policy_version == 1
    assert _greedy(servers, tmp_path, tokenizer, 1, "synced") == expected


class WakeRecordingHFEngine(DroppingHFEngine):
    """Records the parts each wake-up takes back (vLLM's memory tags)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.woken: list[list[str]] = []

    def wake_up(self, parts: list[str]) -> None:
        self.woken.append(parts)


def test_a_weight_sync_wakes_the_weights_alone_and_a_generate_the_kv_cache(serve, tmp_path, tokenizer):
    # trainer.paramOffload's order (verl's multi-stage wake-up): the trainer's weights go to the
    # woken weights, then the trainer leaves the GPU, then the KV cache comes back to generate.
    worker, servers, sleep = serve(WakeRecordingHFEngine)
    reference = HFEngine(worker.engine._model_path)
    sleep.sleep()
    address = servers.addresses()[0]
    assert set(sleep.wake(("weights",))) == {"timing_s/wake"}
    assert worker.engine.woken == [["weights"]] and worker.asleep == {"kv_cache"}
    GrpcWeightSender(servers.clients, bucket_bytes=32 << 10).send([address], reference.model.state_dict().items(), 1)
    assert worker.engine.woken == [["weights"]]          # already awake: the sync woke nothing more
    health = servers.clients.health(address)
    assert health.ready and health.policy_version == 1 and "asleep at level 2: kv_cache" in health.status
    _greedy(servers, tmp_path, tokenizer, 1, "woken")
    assert worker.engine.woken == [["weights"], ["kv_cache"]] and not worker.asleep
    with pytest.raises(grpc.RpcError, match="wake-up parts must be among weights, kv_cache"):
        servers.clients(address).WakeUp(pb.WakeUpRequest(parts=["everything"]), timeout=30)


def test_sleep_is_only_for_colocated_synchronous_jobs(tiny_model, tmp_path):
    spec = load_job(write_job(tmp_path / "job.yaml", tiny_model)).spec
    assert not EngineSleep(spec, None, rank=0).enabled and EngineSleep(spec, None, rank=0).sleep() == {}
    stale = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"placement": "colocated",
                                                                               "max_staleness": 1})})
    assert not EngineSleep(stale, None, rank=0).enabled


def test_the_trainer_waits_for_servers_to_answer_not_to_hold_weights(serve, caplog):
    """Before step 1 rank 0 waits for its servers to answer (RolloutServers.wait_until_serving).
    A colocated server asleep at level 2 answers "not ready, version unknown" until the trainer's
    first sync: waiting for *ready* ran to the wait's bound (120 s) on a GPU. A listed address
    where nothing answers is waited for, then named."""
    import logging
    import socket

    from grpo_trainer.rollout_servers import RolloutServers
    worker, servers, sleep = serve(DroppingHFEngine)
    sleep.sleep()
    address = servers.addresses()[0]
    assert not servers.clients.health(address).ready
    with socket.socket() as s:          # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        silent = f"127.0.0.1:{s.getsockname()[1]}"
    def said():
        return [r.getMessage() for r in caplog.records if r.name == "grpo_trainer.rollout_servers"]

    with caplog.at_level(logging.WARNING, logger="grpo_trainer.rollout_servers"):
        RolloutServers(lambda: [address], servers.token).wait_until_serving(wait_seconds=60)
        assert not said()                  # it answered: no wait to the bound
        RolloutServers(lambda: [address, silent], servers.token).wait_until_serving(wait_seconds=1)
    assert said() == [
        f"Rollout server(s) {silent} not answering after 1s; starting anyway (a shard sent to one is retried "
        "elsewhere)"]
