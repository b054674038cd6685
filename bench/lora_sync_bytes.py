"""Bytes per weight sync of a LoRA policy, merged against adapters alone (issue 33, item 3),
computed from the parameter shapes (a meta-device model: nothing allocated, no hub):

    HF_HUB_OFFLINE=1 python bench/lora_sync_bytes.py

Both numbers are the trainer's own plans (grpo_api.weights.plan_buckets, alignment included) of
what it sends each server: the merged weights (grpo_trainer.publisher.rollout_tensors, in the
rollout dtype) and the adapters (grpo_trainer.lora.full_adapter_tensors: every adapted
module's lora_A and lora_B, in their own dtype, float32, as PEFT keeps them).
"""

from __future__ import annotations

import json

import torch

MODELS = {
    # the CPU tests' model (grpo_rollout.tiny), float32 everywhere on CPU; tests/integration/test_lora.py's rank
    "tiny (test_lora.py)": (None, 8, torch.float32),
    # Qwen/Qwen3-1.7B's config.json
    "Qwen3-1.7B-shaped": (dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                               max_position_embeddings=40960), 64, torch.bfloat16),
}


def measure(size: dict | None, rank: int, rollout_dtype: torch.dtype) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    from grpo_api.weights import TensorSpec, plan_buckets
    from grpo_rollout.tiny import DEFAULT_SIZE, build_tokenizer
    from grpo_trainer import lora
    from grpo_trainer.publisher import rollout_tensors
    config = Qwen3Config(**(size or {**DEFAULT_SIZE, "vocab_size": len(build_tokenizer().get_vocab())}))
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=rollout_dtype),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    for p in model.parameters():   # PEFT keeps the adapters in float32 (autocast_adapter_dtype)
        if p.requires_grad:
            assert p.dtype == torch.float32, p.dtype
    dtype = str(rollout_dtype).removeprefix("torch.")
    merged = plan_buckets([TensorSpec(n, tuple(t.shape), dtype) for n, t in rollout_tensors(model)], 512 << 20)
    adapters = plan_buckets([TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                             for n, t in lora.full_adapter_tensors(model)], 512 << 20)
    m, a = sum(b.nbytes for b in merged), sum(b.nbytes for b in adapters)
    return {"rank": rank, "modules": len(lora.adapter_modules(model)), "merged_dtype": dtype, "merged_bytes": m,
            "adapter_bytes": a, "adapter_fraction": round(a / m, 4)}


def main() -> None:
    for name, (size, rank, dtype) in MODELS.items():
        print(json.dumps({"model": name, **measure(size, rank, dtype)}))


if __name__ == "__main__":
    main()
