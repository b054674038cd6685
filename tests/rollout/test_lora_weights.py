"""Adapter-only weight sync (issue 33), the receiving side: a real HFEngine and WeightReceiver fed
the chunks of the trainer's own GrpcWeightSender, in-process. After a sync the engine's weights
must be exactly what the merged path sends (grpo_trainer.lora.full_rollout_tensors, bitwise) and
PEFT's merge_and_unload (an independent implementation, to float32 rounding), however many syncs
came before; bad adapters and a server that takes merged weights only are refused, clearly."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from grpo_api.rpc import RolloutClients
from grpo_api.weights import lora_to_proto
from grpo_rollout.hf_engine import HFEngine
from grpo_rollout.weights import UNKNOWN_VERSION, WeightReceiver
from grpo_trainer import lora
from grpo_trainer.weight_sync import GrpcWeightSender, _plan, pack_bucket

BUCKET_BYTES = 16 << 10   # the tiny model's rank-4 adapters (~32 KB) span several buckets


def peft_policy(tiny_model, seed: int, rank: int = 4, alpha: float = 8.0):
    """The tiny model under PEFT with random adapters, as if trained (B away from zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def stream(named, version: int, scaling=None):
    """The UpdateWeights chunks GrpcWeightSender sends for `named` (adapters when `scaling`)."""
    sender = GrpcWeightSender(RolloutClients("unused"), bucket_bytes=BUCKET_BYTES, chunk_bytes=4096)
    buckets, tensors = _plan(named, BUCKET_BYTES)
    for bucket in buckets:
        data = pack_bucket(bucket, tensors, torch.device("cpu")).numpy().tobytes()
        yield from sender._chunks(version, bucket, len(buckets), data, None, lora_to_proto(scaling))


def adapter_sync(receiver, policy, version: int):
    return receiver.receive_stream(stream(list(lora.full_adapter_tensors(policy)), version,
                                          lora.adapter_scaling(policy)))


def merged_of(policy) -> dict[str, torch.Tensor]:
    """What the trainer's merged path sends."""
    with torch.no_grad():
        return {name: t.clone() for name, t in lora.full_rollout_tensors(policy)}


def assert_holds(engine, merged: dict[str, torch.Tensor]) -> None:
    state = engine.model.state_dict()
    assert set(merged) <= set(state)
    different = [n for n, t in merged.items() if not torch.equal(state[n], t)]
    assert not different, different[:5]


@pytest.fixture
def engine(tiny_model):
    return HFEngine(tiny_model)


def test_an_adapter_sync_leaves_the_engine_holding_the_merged_policy_bit_for_bit(engine, tiny_model):
    receiver = WeightReceiver(engine, threading.Lock())
    assert receiver.accepts_lora_adapters
    first, second = peft_policy(tiny_model, seed=1), peft_policy(tiny_model, seed=2)
    result = adapter_sync(receiver, first, 1)
    assert (result.committed, result.version, result.rejected) == (True, 1, [])
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in lora.full_adapter_tensors(first))
    assert adapter_bytes <= result.nbytes < adapter_bytes + 64 * 2 * len(lora.adapter_scaling(first))
    assert_holds(engine, merged_of(first))
    # PEFT's own merge: the same weights to float32 rounding
    peft = copy.deepcopy(first).merge_and_unload().state_dict()
    for name, weight in engine.model.state_dict().items():
        torch.testing.assert_close(weight, peft[name], msg=lambda m, n=name: f"{n}: {m}")

    # The next version is merged from the base again, not onto the last one: no drift.
    assert adapter_sync(receiver, second, 2).committed
    assert_holds(engine, merged_of(second))
    # Whole weights in between (every tensor other than the base's), then adapters again: every
    # tensor is the base's or the adapters' merge once more.
    noise = {n: t + 0.5 for n, t in merged_of(second).items()}
    assert receiver.receive_stream(stream(list(noise.items()), 3)).committed
    assert adapter_sync(receiver, first, 4).committed
    assert_holds(engine, merged_of(first))
    assert engine.policy_version == 4


def test_a_server_that_takes_merged_weights_only_refuses_adapters_and_keeps_its_weights(engine, tiny_model):
    receiver = WeightReceiver(engine, threading.Lock(), lora_adapters=False)
    assert not receiver.accepts_lora_adapters
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="takes merged weights only, not LoRA adapters .grpo rollout --no-lora"):
        adapter_sync(receiver, peft_policy(tiny_model, seed=1), 1)
    assert engine.policy_version == 0 and not receiver.syncing   # never started: still whole
    assert_holds(engine, before)
    assert receiver.receive_stream(stream(list(merged_of(peft_policy(tiny_model, seed=1)).items()), 1)).committed


def test_adapters_that_do_not_fit_are_refused_naming_the_module(engine, tiny_model):
    receiver = WeightReceiver(engine, threading.Lock())
    policy = peft_policy(tiny_model, seed=3)
    base = {n: t.clone() for n, t in engine.model.state_dict().items()}
    scaling = lora.adapter_scaling(policy)
    module = "model.layers.1.mlp.down_proj"
    transposed = [(n, t.T.contiguous() if n == f"{module}.lora_A.weight" else t)
                  for n, t in lora.full_adapter_tensors(policy)]
    with pytest.raises(ValueError, match=f"LoRA adapter for '{module}': A .* don't fit its weight"):
        receiver.receive_stream(stream(transposed, 1, scaling))
    assert engine.policy_version == UNKNOWN_VERSION   # a sync that failed: no generation until one succeeds
    assert_holds(engine, base)                        # and nothing was copied
    only_a = [(n, t) for n, t in lora.full_adapter_tensors(policy) if ".lora_A." in n]
    with pytest.raises(ValueError, match="came without its lora_B"):
        receiver.receive_stream(stream(only_a, 2, scaling))
    unknown = {**scaling, "model.layers.9.mlp.down_proj": 2.0}
    extra = [*lora.full_adapter_tensors(policy), ("model.layers.9.mlp.down_proj.lora_A.weight", torch.zeros(4, 128)),
             ("model.layers.9.mlp.down_proj.lora_B.weight", torch.zeros(64, 4))]
    with pytest.raises(ValueError, match="'model.layers.9.mlp.down_proj': .* has no linear layer of that name"):
        receiver.receive_stream(stream(extra, 3, unknown))
    assert adapter_sync(receiver, policy, 4).committed
    assert_holds(engine, merged_of(policy))
