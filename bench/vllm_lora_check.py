"""Issue 33 item 3: vLLM's own LoRA (grpo_rollout.vllm_engine, `max_lora_rank`) against merged
weights, on the bench's Qwen3-1.7B-shaped model (bench/h200_bench.py `build`), in one engine:

1. correctness: teacher-forced log-probs of fixed sequences (vLLM's prompt_logprobs) with the
   adapters applied by vLLM, against the same engine holding the merged weights
   W + scaling x B @ A (grpo_trainer.lora's float32 merge), against the base. Adapter and merged
   must agree far better than either agrees with the base;
2. cost: 256 x 512 tokens generated with the adapter, with merged weights in a LoRA-enabled
   engine (no adapter active), and the time to load an adapter version (write + add_lora).

    python bench/vllm_lora_check.py --workdir /tmp/grpo-bench --results OUT.jsonl [--tiny]
"""

from __future__ import annotations

import time
from pathlib import Path

import bench_common
from bench_common import bench_parser

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--rank", type=int, default=64)
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    from grpo_rollout.engine import LoraAdapter, SamplingParams
    from grpo_rollout.vllm_engine import VLLMEngine

    def emit(row):
        bench_common.emit(args, "vllm_lora", **row)

    model_dir = Path(args.workdir) / "model"
    base = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        base.update(load_file(str(f)))
    g = torch.Generator().manual_seed(0)
    adapters, scaling = {}, 2.0
    for name, w in base.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rpartition(".")[2] in TARGETS:
            out_f, in_f = w.shape
            # Large enough to move the log-probs well away from the base's.
            adapters[module] = LoraAdapter(torch.randn(args.rank, in_f, generator=g) / in_f ** 0.5,
                                           torch.randn(out_f, args.rank, generator=g) * 0.02, scaling)
    merged = [(f"{m}.weight", (base[f"{m}.weight"].float() + a.scaling * (a.b.float() @ a.a.float()))
               .to(base[f"{m}.weight"].dtype)) for m, a in adapters.items()]
    restore = [(f"{m}.weight", base[f"{m}.weight"]) for m in adapters]
    emit({"what": "adapters", "modules": len(adapters), "rank": args.rank,
          "adapter_mb": round(sum(a.a.numel() + a.b.numel() for a in adapters.values()) * 2 / 1e6, 1)})

    t = time.perf_counter()
    engine = VLLMEngine(str(model_dir), dtype="bfloat16", seed=0, gpu_memory_utilization=0.5,
                        max_lora_rank=args.rank)
    emit({"what": "engine start (enable_lora)", "seconds": round(time.perf_counter() - t, 1)})
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    rng = torch.Generator().manual_seed(1)
    vocab = len(engine.tokenizer)
    sequences = [torch.randint(0, vocab, (256,), generator=rng).tolist() for _ in range(16)]

    def forced_logprobs():
        out = engine._llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                                   VSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                   use_tqdm=False, lora_request=engine._lora)
        return torch.tensor([[pos[tok].logprob for pos, tok in zip(o.prompt_logprobs[1:], seq[1:])]
                             for o, seq in zip(out, sequences)])

    prompts = [torch.randint(0, vocab, (256,), generator=rng).tolist() for _ in range(32)]
    params = SamplingParams(n=8, max_tokens=512, temperature=1.0)

    def timed_generation(label):
        engine.generate(prompts[:2], SamplingParams(n=1, max_tokens=4))
        times = []
        for _ in range(2):
            t = time.perf_counter()
            groups = engine.generate(prompts, params)
            times.append(time.perf_counter() - t)
        tokens = sum(len(s.token_ids) for gr in groups for s in gr)
        emit({"what": f"generate 256 x 512, {label}", "seconds": [round(x, 3) for x in times],
              "tokens": tokens, "tokens_per_s": round(tokens / min(times))})

    lp_base = forced_logprobs()
    timed_generation("LoRA engine, base weights, no adapter")
    t = time.perf_counter()
    engine.load_lora_adapters(adapters)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.load_lora_adapters(adapters)          # a second version replaces the first
    emit({"what": "load adapter version", "first_s": round(load_s, 3), "second_s": round(time.perf_counter() - t, 3)})
    lp_lora = forced_logprobs()
    timed_generation("adapter applied by vLLM")
    t = time.perf_counter()
    engine.load_weights(merged)                  # ends the adapter's use
    emit({"what": "load merged weights (adapted modules)", "seconds": round(time.perf_counter() - t, 3)})
    lp_merged = forced_logprobs()
    timed_generation("merged weights in a LoRA engine")
    d_lm = (lp_lora - lp_merged).abs()
    d_lb = (lp_lora - lp_base).abs()
    emit({"what": "teacher-forced logprobs", "tokens": lp_lora.numel(),
          "adapter_vs_merged_mean_abs": round(float(d_lm.mean()), 5), "adapter_vs_merged_max": round(float(d_lm.max()), 4),
          "adapter_vs_base_mean_abs": round(float(d_lb.mean()), 5),
          "ok": bool(d_lm.mean() < 0.2 * d_lb.mean())})
    engine.load_weights(restore)                 # merged weights went into the base layers: back to the base
    d_rb = (forced_logprobs() - lp_base).abs()
    emit({"what": "base weights loaded back", "vs_base_max": round(float(d_rb.max()), 5), "ok": bool(d_rb.max() < 1e-3)})
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
