"""Weight updates from the trainer's senders (grpo_trainer.weight_sync) to real rollout server
processes: afterwards, greedy generation must equal, token for token, what the pushed weights
produce when loaded directly into a fresh model."""

from __future__ import annotations

import itertools
import secrets
import time

import grpc
import pytest
import torch

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.storage import Storage
from grpo_api.weights import bucket_to_proto, plan_buckets
from grpo_rollout.engine import SamplingParams
from grpo_rollout.hf_engine import HFEngine
from grpo_api.rpc import RolloutClients
from grpo_trainer.weight_sync import (CollectiveWeightSender, GrpcWeightSender, WeightSyncError, pack_bucket,
                                      tensor_specs)

from .conftest import chat_prompt, prompt_table, start_server, wait_until
from .test_lora_weights import merged_of, peft_policy, stream

pytestmark = pytest.mark.integration

BUCKET_BYTES = 32 << 10   # the tiny model (~250 KB) spans several buckets
CHUNK_BYTES = 8 << 10     # and a bucket several chunks
GREEDY_TOKENS = 10
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def token():
    return secrets.token_hex(16)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model, token):
    tmp = tmp_path_factory.mktemp("weights")
    started = [start_server(tmp, tiny_model, token, worker_id=f"w{i}") for i in range(2)]
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_prompt(tokenizer, "copy the digit 4"), chat_prompt(tokenizer, "the answer is 9 and 2")]


def trained_weights(tmp_path, seed: int) -> tuple[dict[str, torch.Tensor], HFEngine]:
    """Another random init of the same architecture (as if trained), and an engine holding it.
    A wide init makes greedy decoding depend on the weights (the default narrow one makes a tiny
    random model repeat one token whatever its seed)."""
    from grpo_rollout.tiny import build_tiny_model
    path = build_tiny_model(tmp_path / f"seed{seed}", seed=seed, initializer_range=0.5)
    engine = HFEngine(path)
    return engine.model.state_dict(), engine


def greedy_reference(engine: HFEngine, prompts) -> list[list[int]]:
    out = engine.generate(prompts, SamplingParams(n=1, max_tokens=GREEDY_TOKENS, temperature=0.0))
    return [g[0].token_ids for g in out]


def greedy_from_server(server, prompts, version: int, tmp_path) -> list[list[int]]:
    storage = Storage()
    tag = f"{server.info['worker_id']}-v{version}"
    prompt_uri, output_uri = f"file://{tmp_path}/p-{tag}.parquet", f"file://{tmp_path}/r-{tag}.parquet"
    storage.write_table(prompt_uri, prompt_table([{"prompt_ids": p} for p in prompts]))
    reply = server.stub().Generate(pb.GenerateRequest(
        prompt_uri=prompt_uri, output_uri=output_uri, expected_policy_version=version,
        sampling=pb.SamplingParams(n=1, max_tokens=GREEDY_TOKENS, temperature=0.0)), timeout=60)
    assert reply.policy_version == version
    return storage.read_table(reply.rollout_uri).column("response_ids").to_pylist()


def health(server) -> pb.HealthReply:
    return server.stub().Health(pb.HealthRequest(), timeout=10)


def test_grpc_push_updates_every_worker(servers, prompts, token, tmp_path):
    before = greedy_from_server(servers[0], prompts, 0, tmp_path)
    weights, engine = trained_weights(tmp_path, seed=1)
    expected = greedy_reference(engine, prompts)
    assert expected != before  # the update must be visible

    version = next(_versions)
    sender = GrpcWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, chunk_bytes=CHUNK_BYTES)
    try:
        report = sender.send([s.address for s in servers], weights.items(), version)
    finally:
        sender.close()
    assert report.version == version and report.resent == {}
    assert report.nbytes >= sum(t.numel() * t.element_size() for t in weights.values())
    for server in servers:
        assert health(server).policy_version == version
        assert greedy_from_server(server, prompts, version, tmp_path) == expected
        assert server.metric("grpo_rollout_weight_sync_bytes_total", backend="grpc") >= report.nbytes


class CorruptingSender(GrpcWeightSender):
    """Flips one byte of a bucket on its first trip to one worker: a network or memory fault."""

    def __init__(self, *args, victim_bucket: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.victim_bucket, self.corrupted = victim_bucket, False

    def _chunks(self, version, bucket, num_buckets, data, sha, lora=None):
        for chunk in super()._chunks(version, bucket, num_buckets, data, sha, lora):
            if bucket.index == self.victim_bucket and not self.corrupted and chunk.data:
                self.corrupted = True
                chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
            yield chunk


def test_a_corrupted_bucket_is_rejected_and_sent_again(servers, prompts, token, tmp_path):
    weights, engine = trained_weights(tmp_path, seed=2)
    server = servers[0]
    version = next(_versions)
    rejected_before = server.metric("grpo_rollout_weight_sync_rejected_buckets_total")
    sender = CorruptingSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, chunk_bytes=CHUNK_BYTES, victim_bucket=1)
    try:
        report = sender.send([server.address], weights.items(), version)
    finally:
        sender.close()
    assert report.resent == {server.address: [1]}
    assert server.metric("grpo_rollout_weight_sync_rejected_buckets_total") == rejected_before + 1
    assert greedy_from_server(server, prompts, version, tmp_path) == greedy_reference(engine, prompts)


def test_a_half_applied_update_blocks_generation_until_complete(servers, prompts, token, tmp_path):
    weights, engine = trained_weights(tmp_path, seed=3)
    server = servers[1]
    old = health(server).policy_version
    version = next(_versions)
    buckets = plan_buckets(tensor_specs(weights.items()), BUCKET_BYTES)
    assert len(buckets) >= 3
    # Only the first bucket arrives (the trainer died mid-update, say).
    sender = GrpcWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, chunk_bytes=CHUNK_BYTES)
    data = pack_bucket(buckets[0], iter(weights.items()), torch.device("cpu")).numpy().tobytes()
    import hashlib
    reply = server.stub().UpdateWeights(
        sender._chunks(version, buckets[0], len(buckets), data, hashlib.sha256(data).hexdigest()), timeout=30)
    assert (list(reply.accepted_buckets), reply.committed, reply.version) == ([0], False, -1)
    h = health(server)
    assert (h.ready, h.policy_version, h.status) == (False, -1, "syncing weights")
    with pytest.raises(grpc.RpcError) as err:
        greedy_from_server(server, prompts, old, tmp_path)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A complete update makes it whole again.
    try:
        sender.send([server.address], weights.items(), version)
    finally:
        sender.close()
    assert health(server).ready
    assert greedy_from_server(server, prompts, version, tmp_path) == greedy_reference(engine, prompts)


class WholeVersionEngine(HFEngine):
    """The hf engine taking each version whole, as vLLM with FP8 rollouts does (which needs a GPU:
    bench/RESULTS.md); it records each load_weights call's tensor names."""
    loads_whole_versions = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loads: list[list[str]] = []

    def load_weights(self, weights):
        weights = list(weights)
        self.loads.append([name for name, _ in weights])
        super().load_weights(weights)


def test_an_engine_that_quantizes_what_it_loads_gets_a_version_in_one_call(tiny_model, prompts, tmp_path):
    """FP8 rollouts quantize each layer again once all its shards are in, and a bucket can end in
    the middle of a layer: the receiver keeps the buckets and loads them at the commit."""
    import threading

    from grpo_rollout.weights import UNKNOWN_VERSION, WeightReceiver
    weights, reference = trained_weights(tmp_path, seed=5)
    engine = WholeVersionEngine(tiny_model)
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    receiver = WeightReceiver(engine, threading.Lock())
    chunks = list(stream(list(weights.items()), 1))
    last = max(c.bucket_index for c in chunks)
    assert last >= 2
    first_buckets = [c for c in chunks if c.bucket_index < last]
    resent = [c for c in chunks if c.bucket_index == 0]       # a bucket sent twice counts once
    result = receiver.receive_stream(iter(first_buckets + resent))
    assert (result.committed, engine.policy_version, engine.loads) == (False, UNKNOWN_VERSION, [])
    assert all(torch.equal(t, before[n]) for n, t in engine.model.state_dict().items())   # kept, not loaded
    result = receiver.receive_stream(iter(c for c in chunks if c.bucket_index == last))
    assert (result.committed, engine.policy_version, len(engine.loads)) == (True, 1, 1)
    assert sorted(engine.loads[0]) == sorted(weights)
    assert greedy_reference(engine, prompts) == greedy_reference(reference, prompts)


def test_collective_gloo_push_and_group_reformation(servers, prompts, token, tmp_path):
    addresses = [s.address for s in servers]
    sender = CollectiveWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, master_addr="127.0.0.1", timeout_seconds=60)
    try:
        weights, engine = trained_weights(tmp_path, seed=4)
        v1 = next(_versions)
        report = sender.send(addresses, weights.items(), v1)
        assert report.version == v1
        expected = greedy_reference(engine, prompts)
        for server in servers:
            assert greedy_from_server(server, prompts, v1, tmp_path) == expected

        # Same members: the group is reused.
        weights, engine = trained_weights(tmp_path, seed=5)
        v2 = next(_versions)
        group = sender._group.id
        sender.send(addresses, weights.items(), v2)
        assert sender._group.id == group
        for server in servers:
            assert health(server).policy_version == v2

        # Membership changes (a replica went away): a new group is formed with who is left.
        weights, engine = trained_weights(tmp_path, seed=6)
        v3 = next(_versions)
        sender.send(addresses[:1], weights.items(), v3)
        assert sender._group.id != group
        assert health(servers[0]).policy_version == v3
        assert health(servers[1]).policy_version == v2 and health(servers[1]).ready
        assert greedy_from_server(servers[0], prompts, v3, tmp_path) == greedy_reference(engine, prompts)

        # The replica that missed it catches up alone (over gRPC).
        sender.resync(addresses[1], weights.items(), v3)
        assert greedy_from_server(servers[1], prompts, v3, tmp_path) == greedy_reference(engine, prompts)
        assert servers[0].metric("grpo_rollout_weight_sync_seconds_count", backend="collective") >= 3
    finally:
        sender.close()


# LoRA (issue 33): adapter-only syncs, to the same servers

def lora_update(tiny_model, seed: int):
    """(adapter tensors, their scaling, an engine holding the merged policy) of a random LoRA
    policy on the tiny model: what the trainer's publisher sends, and what it should make."""
    from grpo_trainer import lora
    policy = peft_policy(tiny_model, seed=seed)
    reference = HFEngine(tiny_model)
    reference.load_weights(merged_of(policy).items())
    return list(lora.full_adapter_tensors(policy)), lora.adapter_scaling(policy), reference


def test_adapters_alone_reach_every_worker_over_grpc_and_the_collective(servers, prompts, token, tmp_path,
                                                                       tiny_model):
    """Each server merges the adapters into its base itself and generates what the merged
    policy generates; what crossed the wire is the adapters' bytes (the server's own count)."""
    addresses = [s.address for s in servers]
    adapters, scaling, reference = lora_update(tiny_model, seed=21)
    assert all(s.stub().Info(pb.InfoRequest(), timeout=10).accepts_lora_adapters for s in servers)
    model_bytes = sum(t.numel() * t.element_size() for t in reference.model.state_dict().values())
    before = [s.metric("grpo_rollout_weight_sync_bytes_total", backend="grpc") for s in servers]
    version = next(_versions)
    report = GrpcWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, chunk_bytes=CHUNK_BYTES).send(
        addresses, adapters, version, lora=scaling)
    assert report.nbytes < model_bytes / 4
    expected = greedy_reference(reference, prompts)
    for server, bytes_before in zip(servers, before):
        assert greedy_from_server(server, prompts, version, tmp_path) == expected
        assert server.metric("grpo_rollout_weight_sync_bytes_total", backend="grpc") - bytes_before == report.nbytes

    adapters, scaling, reference = lora_update(tiny_model, seed=22)
    sender = CollectiveWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, master_addr="127.0.0.1",
                                    timeout_seconds=60)
    try:
        version = next(_versions)
        sender.send(addresses, adapters, version, lora=scaling)
    finally:
        sender.close()
    second = greedy_reference(reference, prompts)
    assert second != expected
    for server in servers:
        assert greedy_from_server(server, prompts, version, tmp_path) == second


PUBLISH = r"""
import json, sys, torch, torch.distributed as dist
from safetensors.torch import save_file
from grpo_api.spec import ModelSpec, WeightSyncSpec
from grpo_trainer import lora
from grpo_trainer import lora
from grpo_trainer.model import build_policy
from grpo_trainer.publisher import WeightPublisher
from grpo_trainer.rollout_servers import RolloutServers
model_path, addresses, token, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
spec = ModelSpec.model_validate({"path": model_path, "lora": {"rank": 4, "alpha": 8}})
model = build_policy(spec, torch.device("cpu"), wrap=lora.wrapper(spec))
g = torch.Generator().manual_seed(31)
with torch.no_grad():   # as if trained: B away from zero (FSDP2 on one rank: the local shard is all of it)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.to_local().copy_(torch.randn(p.shape, generator=g) * 0.3)
servers = RolloutServers(lambda: addresses, token)
report = {}
for version, merge in ((int(sys.argv[5]), False), (int(sys.argv[5]) + 1, True)):
    publisher = WeightPublisher(model, WeightSyncSpec(backend="grpc"), dtype=torch.float32, device=torch.device("cpu"),
                                servers=servers, lora_merge=merge)
    publisher.publish(version)
    allocated = publisher.buffer is not None
    final = publisher.final_weights()    # the export's: gathered here when the update went out as adapters
    with torch.no_grad():
        merged = {n: t.clone() for n, t in lora.full_rollout_tensors(model)}
    report[str(merge)] = {"buffer_allocated_by_publish": allocated,
                          "final_is_merged": all(torch.equal(final[n], t) for n, t in merged.items())}
save_file(merged, out + "/merged.safetensors")
print("REPORT " + json.dumps(report))
"""


def test_the_publisher_sends_adapters_to_servers_that_take_them_and_merged_weights_with_lora_merge(
        servers, prompts, token, tmp_path, tiny_model):
    """The trainer's WeightPublisher (one gloo rank, the LoRA policy as build_policy makes it,
    FSDP2): to servers that accept adapters it sends the adapters alone and never allocates the
    merged buffer (the final export gathers it, and it is the merge); with model.lora.merge every
    server gets the merged weights. Either way the servers generate what the merged policy does."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file
    addresses = ",".join(s.address for s in servers)
    version = next(_versions)
    next(_versions)
    before = [s.metric("grpo_rollout_weight_sync_bytes_total", backend="grpc") for s in servers]
    done = subprocess.run([sys.executable, "-c", PUBLISH, str(tiny_model), addresses, token, str(tmp_path),
                           str(version)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    assert report == {"False": {"buffer_allocated_by_publish": False, "final_is_merged": True},
                      "True": {"buffer_allocated_by_publish": True, "final_is_merged": True}}, report
    merged = load_file(tmp_path / "merged.safetensors")
    reference = HFEngine(tiny_model)
    reference.load_weights(merged.items())
    expected = greedy_reference(reference, prompts)
    from grpo_trainer import lora
    adapter_bytes = sum(t.numel() * 4 for _, t in lora.full_adapter_tensors(peft_policy(tiny_model, seed=0)))
    model_bytes = sum(t.numel() * 4 for t in merged.values())
    for server, bytes_before in zip(servers, before):
        assert health(server).policy_version == version + 1
        assert greedy_from_server(server, prompts, version + 1, tmp_path) == expected
        received = server.metric("grpo_rollout_weight_sync_bytes_total", backend="grpc") - bytes_before
        # version: the adapters; version + 1 (lora.merge): the model (64-byte alignment aside)
        assert adapter_bytes + model_bytes <= received < adapter_bytes + model_bytes + 64 * 64, received


def test_a_worker_that_cannot_join_fails_the_update_with_its_name(servers, token, tmp_path):
    weights, _ = trained_weights(tmp_path, seed=7)
    sender = CollectiveWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, master_addr="127.0.0.1", timeout_seconds=20)
    try:
        with pytest.raises(WeightSyncError, match="127.0.0.1:1"):
            sender.send([servers[0].address, "127.0.0.1:1"], weights.items(), next(_versions))
    finally:
        sender.close()


def test_a_cuda_ipc_plan_is_refused_by_a_server_off_the_trainers_gpu(servers):
    """CUDA IPC only works within one GPU: a server elsewhere (here on CPU) says so at once,
    and its weights stay what they were (the trainer picks IPC only for servers that report its
    GPU's UUID in Info, so this is a misconfiguration, not a path the trainer takes)."""
    server = servers[0]
    assert server.stub().Info(pb.InfoRequest(), timeout=10).device_uuid == ""   # on CPU
    before = health(server).policy_version
    layout = plan_buckets(tensor_specs([("model.norm.weight", torch.zeros(4))]), 1 << 20)[0]
    plan = pb.WeightSyncPlan(version=before + 1, backend="cuda_ipc", buckets=[bucket_to_proto(layout)],
                             ipc=pb.CudaIpcBuffer(handle=b"x", size_bytes=4096, device_uuid="GPU-elsewhere",
                                                  bucket_offsets=[0]))
    with pytest.raises(grpc.RpcError) as err:
        server.stub().PrepareWeightSync(plan, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cuda_ipc needs an engine on one GPU" in err.value.details()
    outside = pb.WeightSyncPlan(version=before + 1, backend="cuda_ipc", buckets=[bucket_to_proto(layout)],
                                ipc=pb.CudaIpcBuffer(handle=b"x", size_bytes=8, device_uuid="GPU-elsewhere",
                                                     bucket_offsets=[0]))
    with pytest.raises(grpc.RpcError, match="outside the shared buffer"):
        server.stub().PrepareWeightSync(outside, timeout=30)
    assert health(server).policy_version == before


def _broadcast_then(monkeypatch, after_buckets: int, action):
    """Run `action()` on the trainer side once `after_buckets` buckets were broadcast: a fault
    at a known point of the collective, not at a moment guessed by timing."""
    from grpo_trainer import weight_sync
    real = weight_sync._Group.broadcast
    sent = itertools.count(1)

    def broadcast(self, tensor, deadline, check=None):
        if next(sent) == after_buckets + 1:
            action()
        return real(self, tensor, deadline, check)
    monkeypatch.setattr(weight_sync._Group, "broadcast", broadcast)


def test_a_server_killed_during_the_broadcast_fails_the_update_and_is_resynced_after_restart(
        tiny_model, prompts, token, tmp_path, monkeypatch):
    """The abort path: the server dies between two buckets of a collective update. The trainer
    gives up within weightSync.timeoutSeconds, naming the update; the restarted server (same
    port: what its pod or `grpo run` does) joins a new group and ends up with those weights."""
    timeout = 60
    server = start_server(tmp_path, tiny_model, token, worker_id="doomed")
    sender = CollectiveWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, master_addr="127.0.0.1", timeout_seconds=timeout)
    restarted = None
    try:
        weights, engine = trained_weights(tmp_path, seed=11)
        version = next(_versions)
        _broadcast_then(monkeypatch, 2, lambda: (server.proc.kill(), server.proc.wait()))
        t = time.monotonic()
        with pytest.raises(WeightSyncError, match=f"version {version}"):
            sender.send([server.address], weights.items(), version)
        assert time.monotonic() - t < timeout
        assert sender._group is None          # the next update forms a new group
        monkeypatch.undo()

        restarted = start_server(tmp_path, tiny_model, token, worker_id="reborn")
        sender.send([restarted.address], weights.items(), version)
        assert health(restarted).policy_version == version
        assert greedy_from_server(restarted, prompts, version, tmp_path) == greedy_reference(engine, prompts)
    finally:
        sender.close()
        server.stop()
        if restarted is not None:
            restarted.stop()


def test_a_trainer_gone_in_the_middle_of_a_broadcast_leaves_the_server_ready_for_the_next(
        servers, prompts, token, tmp_path, monkeypatch):
    """The trainer's side of the group goes away between two buckets (its process died: its
    sockets close). The server's half-applied update fails, it refuses to generate with half the
    weights, and the next trainer's update is taken at once. (A NCCL peer that hangs instead
    is aborted when the next plan arrives: bench/x2_bench.py's abort phase, on two GPUs.)"""
    server = servers[1]   # servers[0] may still be forming the group of the test that can't join
    first = CollectiveWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, master_addr="127.0.0.1", timeout_seconds=600)
    second = CollectiveWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, master_addr="127.0.0.1", timeout_seconds=60)
    try:
        weights, _ = trained_weights(tmp_path, seed=12)
        lost = next(_versions)

        def die():
            raise RuntimeError("the first trainer is gone")
        _broadcast_then(monkeypatch, 2, die)
        with pytest.raises(WeightSyncError, match="the first trainer is gone"):
            first.send([server.address], weights.items(), lost)
        monkeypatch.undo()
        wait_until(lambda: health(server).weight_sync_version == lost and health(server).weight_sync_error != "",
                   timeout=60)
        assert health(server).policy_version == -1       # half applied: no generation on it

        weights, engine = trained_weights(tmp_path, seed=13)
        version = next(_versions)
        second.send([server.address], weights.items(), version)
        assert greedy_from_server(server, prompts, version, tmp_path) == greedy_reference(engine, prompts)
    finally:
        first.close()
        second.close()


# LoRA (issue 33): a server killed in the middle of an adapter sync

def test_a_server_killed_in_the_middle_of_an_adapter_sync_is_resynced_with_adapters_after_restart(
        tiny_model, prompts, token, tmp_path, monkeypatch):
    """As for whole weights: the server dies after PrepareWeightSync, between two buckets of
    adapters, before the commit. The trainer gives up within weightSync.timeoutSeconds, naming
    the version; the restarted server (its base read again) takes the same adapters and holds
    the merged policy."""
    timeout, bucket = 60, 8 << 10     # the rank-4 adapters (32 KB) in 4 buckets
    server = start_server(tmp_path, tiny_model, token, worker_id="doomed-lora")
    sender = CollectiveWeightSender(RolloutClients(token), bucket_bytes=bucket, master_addr="127.0.0.1",
                                    timeout_seconds=timeout)
    restarted = None
    try:
        adapters, scaling, reference = lora_update(tiny_model, seed=23)
        assert len(plan_buckets(tensor_specs(adapters), bucket)) >= 2
        version = next(_versions)
        _broadcast_then(monkeypatch, 1, lambda: (server.proc.kill(), server.proc.wait()))
        t = time.monotonic()
        with pytest.raises(WeightSyncError, match=f"version {version}"):
            sender.send([server.address], adapters, version, lora=scaling)
        assert time.monotonic() - t < timeout
        assert sender._group is None
        monkeypatch.undo()

        restarted = start_server(tmp_path, tiny_model, token, worker_id="reborn-lora")
        assert health(restarted).policy_version == 0
        sender.send([restarted.address], adapters, version, lora=scaling)
        assert health(restarted).policy_version == version
        assert greedy_from_server(restarted, prompts, version, tmp_path) == greedy_reference(reference, prompts)
    finally:
        sender.close()
        server.stop()
        if restarted is not None:
            restarted.stop()
