"""FP8 rollouts (verl's `rollout.quantization=fp8`) on vLLM 0.26: generation speed, and whether a
bf16 weight sync lands right in an engine that quantized its bf16 checkpoint at load.

With `LLM(quantization="fp8")` each linear weight is, once loaded, a transposed fp8 tensor and a
scale (Fp8PerTensorOnlineLinearMethod) that a bare `model.load_weights` (grpo_rollout.vllm_engine's
sync) no longer fits. The sync must run inside vLLM's layerwise reload, as vLLM's own weight
transfer does: initialize_layerwise_reload(model); model.load_weights(...);
finalize_layerwise_reload(model, model_config) (vllm/model_executor/model_loader/reload/).

  --parts timing  256 prompts of 256 random ids x 512 tokens (ignore_eos, temperature 1) after a
                  warm-up, per --variants: bf16, fp8 (weights), fp8-kv (weights and KV cache)
  --parts refit   an fp8 engine started on A takes B (every weight + noise x std x N(0,1)), then A,
                  through the layerwise reload: teacher-forced log-probs (prefill), greedy decode
                  (CUDA graphs) and every tensor's bytes against fp8 and bf16 engines started on B
                  and its own start on A; then the negative control, a bare load_weights
Engines run one at a time, each shut down before the next; A and B take turns in one folder,
<workdir>/fp8-check/model (the model path is part of vLLM's compile-cache key). Needs h200_bench's
`build` (run here when missing).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import bench_parser, emit  # noqa: E402

BENCH = "fp8_rollout"
# Engine variants. "fp8": per-tensor weight scales (Fp8PerTensorOnlineLinearMethod; with the KV cache
# in fp8 too, at scale 1.0: no checkpoint scales); "fp8-block": 128x128 blocks, verl's scheme.
VARIANTS = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
            "fp8-block": {"quantization": "fp8_per_block"}}


# Run in vLLM's worker process: collective_rpc ships these functions (cloudpickle).
def _push_weights(worker, files: list[str], requantize: bool) -> float:
    """Checkpoint files -> model.load_weights under Hugging Face names (WeightLoaderExtension._load's
    call); `requantize`: inside vLLM 0.26's layerwise reload. Seconds of the load alone."""
    import time

    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    weights = [kv for f in files for kv in load_file(f, device=str(worker.device)).items()]
    model = worker.model_runner.get_model()   # under the CUDA-graph wrapper, if any
    torch.cuda.synchronize(worker.device)
    t = time.perf_counter()
    if requantize:    # layers back to checkpoint layout; each is quantized again once all its shards are in
        initialize_layerwise_reload(model)
    model.load_weights(weights=weights)
    if requantize:    # layers not complete yet (attention's KV scales, padding) processed, loaders unwrapped
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    torch.cuda.synchronize(worker.device)
    return time.perf_counter() - t


def _fingerprint(worker) -> dict:
    """Every parameter and buffer: (sha1 of its bytes, dtype, shape, storage address)."""
    import hashlib
    import torch
    out = {}
    model = worker.model_runner.get_model()   # under the CUDA-graph wrapper, if any
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        data = b"meta" if t.is_meta else t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        out[name] = (hashlib.sha1(data).hexdigest()[:16], str(t.dtype), list(t.shape), t.data_ptr())
    return out


def _model_info(worker) -> dict:
    model = worker.model_runner.get_model()   # under the CUDA-graph wrapper, if any
    qkv = next(m for n, m in model.named_modules() if n.endswith("qkv_proj"))
    cache = worker.vllm_config.cache_config   # its num_gpu_blocks is set in the worker too
    return {"linear_method": type(qkv.quant_method).__name__,
            "linear_kernel": type(getattr(qkv.quant_method, "fp8_linear", None)).__name__,
            "qkv_weight": f"{qkv.weight.dtype} {list(qkv.weight.shape)}",
            "weights_gb": round(sum(t.numel() * t.element_size() for t in model.parameters()) / 1e9, 3),
            "kv_cache_tokens": (cache.num_gpu_blocks or 0) * (cache.block_size or 0)}


def write_checkpoint(src: Path, dst: Path, noise: float, seed: int) -> list[str]:
    """src's config, tokenizer and weight files into dst; noise > 0: every tensor W becomes
    W + noise x std(W) x N(0,1) (std 1 for vectors: the norms are all ones), seeded by its name."""
    import torch
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for f in sorted(src.iterdir()):
        if not f.is_file():
            continue
        if f.suffix != ".safetensors" or not noise:
            shutil.copyfile(f, dst / f.name)
            continue
        tensors = load_file(str(f), device=dev)
        for name, t in tensors.items():
            g = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            x = t.float()
            std = x.std() if t.dim() > 1 else 1.0
            tensors[name] = (x + noise * std * torch.randn(t.shape, generator=g, device=dev)).to(t.dtype).cpu()
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        del tensors
    torch.cuda.empty_cache()      # a no-op without CUDA
    return [str(f) for f in sorted(dst.glob("*.safetensors"))]


def start(args, model: Path, variant: str):
    import vllm
    kw = dict(model=str(model), dtype="bfloat16", seed=0, gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=1024, enforce_eager=args.enforce_eager)
    t = time.perf_counter()
    llm = vllm.LLM(**kw, **VARIANTS[variant])   # fp8*: the bf16 checkpoint is quantized as it loads
    return llm, round(time.perf_counter() - t, 1)


def stop(llm, free_before: int) -> None:
    """Shut the engine down and wait for its memory: the next one sizes its KV cache on what is free."""
    import torch
    llm.llm_engine.engine_core.shutdown()   # ends the engine's processes: their GPU memory comes back
    gc.collect()
    torch.cuda.empty_cache()
    deadline = time.monotonic() + 60
    while torch.cuda.mem_get_info()[0] < free_before - (2 << 30) and time.monotonic() < deadline:
        time.sleep(1)


def probe(llm, seqs):
    """Teacher-forced log-probs of `seqs` (prefill: no CUDA graph) and greedy decode of 64 tokens
    from their first 128 ids (decode steps of batch 16: CUDA graphs unless --enforce-eager)."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm.reset_prefix_cache()             # KV cached under other weights is stale
    out = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    forced = torch.tensor([[pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(out, seqs)])
    out = llm.generate([TokensPrompt(prompt_token_ids=s[:128]) for s in seqs],
                       SamplingParams(max_tokens=64, temperature=0.0, logprobs=0, ignore_eos=True, detokenize=False),
                       use_tqdm=False)
    greedy = [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
              for c in (o.outputs[0] for o in out)]
    return forced, greedy


def compare(x, y) -> dict:
    """Teacher-forced |delta log-prob|; greedy: identical sequences, the common prefix, and the
    sampled tokens' |delta log-prob| over it."""
    import torch
    (fx, gx), (fy, gy) = x, y
    d = (fx - fy).abs()
    common = [next((i for i, (a, b) in enumerate(zip(tx, ty)) if a != b), len(tx)) for (tx, _), (ty, _) in zip(gx, gy)]
    dg = torch.tensor([abs(a - b) for (_, lx), (_, ly), n in zip(gx, gy, common) for a, b in zip(lx[:n], ly[:n])] or [0.0])
    return {"forced_mean_abs": float(d.nanmean()), "forced_max_abs": float(d.max()), "forced_nan": int(d.isnan().sum()),
            "greedy_identical": sum(n == len(t) for n, (t, _) in zip(common, gx)), "greedy_sequences": len(gx),
            "greedy_mean_common": sum(common) / len(common), "greedy_lp_mean_abs": float(dg.mean()),
            "greedy_lp_max_abs": float(dg.max())}


def part_timing(args, ck: Path, prompts, free: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    for variant in args.variants:
        llm, start_s = start(args, ck / "model", variant)
        llm.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)  # warm-up
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            out = llm.generate(ps, SamplingParams(max_tokens=args.gen_tokens, temperature=1.0, ignore_eos=True,
                                                  detokenize=False), use_tqdm=False)
            times.append(round(time.perf_counter() - t, 3))
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        emit(args, BENCH, part="timing", variant=variant, start_s=start_s, sequences=len(ps), seconds=times,
             tokens=tokens, tokens_per_s=round(tokens / min(times)), **llm.collective_rpc(_model_info)[0])
        stop(llm, free)


def part_refit(args, ck: Path, seqs, free: int) -> None:
    a_files = [str(f) for f in sorted((ck / "model").glob("*.safetensors"))]
    b_files = write_checkpoint(Path(args.workdir) / "model", ck / "b", args.noise, seed=1)
    llm, start_s = start(args, ck / "model", args.refit_variant)
    info = llm.collective_rpc(_model_info)[0]
    fp_a, p_a = llm.collective_rpc(_fingerprint)[0], probe(llm, seqs)
    load_s = llm.collective_rpc(_push_weights, args=(b_files, True))[0]
    fp_upd, p_upd = llm.collective_rpc(_fingerprint)[0], probe(llm, seqs)
    emit(args, BENCH, part="refit", what="fp8 engine A -> B, layerwise reload", variant=args.refit_variant, start_s=start_s, load_s=round(load_s, 3),
         tensors=len(fp_a), tensors_changed=sum(fp_a[n][0] != fp_upd.get(n, ("",))[0] for n in fp_a),
         # a captured CUDA graph reads the old addresses: none may move
         storage_moved=sum(fp_a[n][3] != fp_upd.get(n, (0, 0, 0, -1))[3] for n in fp_a),
         vs_fp8_a=compare(p_upd, p_a), **info)
    # Back to A the same way: every step reloads, and A requantized must be A as loaded, bit for bit.
    load_s = llm.collective_rpc(_push_weights, args=(a_files, True))[0]
    fp_back = llm.collective_rpc(_fingerprint)[0]
    bad = [n for n in fp_a if fp_a[n][:3] != fp_back.get(n, (None,))[:3]]
    emit(args, BENCH, part="refit", what="fp8 engine B -> A again vs its start on A", load_s=round(load_s, 3),
         ok=not bad, tensors_mismatched=len(bad), first_mismatched=bad[:8], **compare(probe(llm, seqs), p_a))
    # Negative control: what grpo_rollout.vllm_engine does today (a bare load_weights), B this time.
    try:
        neg = {"error": None, "load_s": llm.collective_rpc(_push_weights, args=(b_files, False))[0]}
        neg["vs_fp8_b_refit"] = compare(probe(llm, seqs), p_upd)   # had it worked, ~0
    except Exception as exc:          # noqa: BLE001  (the error is the result)
        neg = {"error": f"{type(exc).__name__}: {str(exc)[-400:]}"}
    emit(args, BENCH, part="refit", what="negative control: fp8 engine A -> B, bare load_weights", **neg)
    stop(llm, free)
    for f in b_files:                 # B into the engines' folder: the references start on B
        shutil.copyfile(f, ck / "model" / Path(f).name)
    llm, _ = start(args, ck / "model", args.refit_variant)
    p_fp8_b, fp_b = probe(llm, seqs), llm.collective_rpc(_fingerprint)[0]
    stop(llm, free)
    llm, _ = start(args, ck / "model", "bf16")
    p_bf16_b = probe(llm, seqs)
    bf16_load_s = llm.collective_rpc(_push_weights, args=(b_files, False))[0]   # today's sync, for its time
    stop(llm, free)
    bad = [n for n in fp_b if fp_b[n][:3] != fp_upd.get(n, (None,))[:3]]
    emit(args, BENCH, part="refit", what="refit fp8 engine vs fp8 engine started on B", ok=not bad,
         tensors_mismatched=len(bad), first_mismatched=bad[:8], **compare(p_upd, p_fp8_b))
    emit(args, BENCH, part="refit", what="log-prob distances, for scale", bf16_bare_load_s=round(bf16_load_s, 3),
         refit_fp8_vs_bf16_b=compare(p_upd, p_bf16_b), fp8_b_vs_bf16_b=compare(p_fp8_b, p_bf16_b),
         fp8_a_vs_fp8_b=compare(p_a, p_fp8_b))


def main(argv=None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--parts", type=lambda s: s.split(","), default=["timing", "refit"], help="timing,refit")
    p.add_argument("--variants", type=lambda s: s.split(","), default=["bf16", "fp8", "fp8-kv"],
                   help=f"timing: engines ({', '.join(VARIANTS)})")
    p.add_argument("--refit-variant", default="fp8", choices=[v for v in VARIANTS if v != "bf16"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each engine's share of the GPU")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile (faster starts)")
    p.add_argument("--reps", type=int, default=2, help="timing: timed generations per engine")
    p.add_argument("--gen-tokens", type=int, default=512)
    p.add_argument("--noise", type=float, default=0.01, help="refit: B = A + noise x std x N(0,1)")
    args = p.parse_args(argv)
    if args.tiny:
        return print("--tiny: vLLM needs a GPU; nothing to check on a CPU") or 0
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")       # this process touches CUDA first
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")      # collective_rpc with a function
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")            # none in the carried site (h200_run.sh)
    import torch

    built = Path(args.workdir) / "model"
    if not (built / "config.json").exists():
        import h200_bench as hb
        args.shape = "1.7b"
        hb.cmd_build(args)            # Qwen3-1.7B shape, random bf16 weights, the tiny tokenizer
    ck = Path(args.workdir) / "fp8-check"
    write_checkpoint(built, ck / "model", 0.0, seed=0)                   # A (a refit run left B there)
    vocab = json.loads((built / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (256, 256), generator=g).tolist()
    seqs = torch.randint(0, vocab, (16, 256), generator=g).tolist()
    free = torch.cuda.mem_get_info()[0]
    if "timing" in args.parts:
        part_timing(args, ck, prompts, free)
    if "refit" in args.parts:
        part_refit(args, ck, seqs, free)
    return 0


if __name__ == "__main__":
    sys.exit(main())
