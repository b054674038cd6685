"""Trainer memory on CPU, LoRA against full-parameter training (issue 33, item 6): the policy as the
trainer builds it (grpo_trainer.model.build_policy: FSDP2, one gloo rank), its optimizer, and one
forward, backward and optimizer step; peak resident memory of a fresh process per mode.

    HF_HUB_OFFLINE=1 python bench/lora_memory.py            # both modes, one process each

The model: a Qwen3-shaped random-weight model (hidden 1024, 8 layers, 32k vocabulary, ~170M
parameters, float32) written to a temp folder; no hub. GPU numbers are the lead's (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile


def _model(folder: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=64, vocab_size=32000, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _one(mode: str, folder: str) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from grpo_api.spec import LoRASpec, ModelSpec, TrainerSpec
    from grpo_trainer.lora import wrapper
    from grpo_trainer.model import build_optimizer, build_policy
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    lora = LoRASpec(rank=32, alpha=64) if mode == "lora" else None
    spec = ModelSpec(path=folder, dtype="float32", gradient_checkpointing=False, lora=lora)
    model = build_policy(spec, torch.device("cpu"), wrap=wrapper(spec))
    opt, _ = build_optimizer(model, TrainerSpec(lr=1e-4), total_steps=1)
    ids = torch.randint(0, 32000, (2, 256))
    start = time.perf_counter()
    loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - start
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    states = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    dist.destroy_process_group()
    return {"mode": mode, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "parameters": total, "trainable": trainable, "optimizer_state_elements": states,
            "step_seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["full", "lora"])
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(_one(args.mode, args.model)))
        return
    with tempfile.TemporaryDirectory() as folder:
        _model(folder)
        for mode in ("full", "lora"):
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--model", folder], capture_output=True,
                                 text=True, check=True)
            print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
