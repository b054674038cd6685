"""Issue 14: GRPO benchmarks of a Qwen3-1.7B-shaped model on one GPU (the lent H200).

Workload: a Qwen3-1.7B-shaped model built from `transformers.Qwen3Config` (random bf16 weights,
nothing from a hub), GRPO with 32 prompts x n=8, prompts of 256 tokens, responses of 512 tokens,
KL loss (0.001), gradient checkpointing, one optimizer step per rollout batch.

Each measurement is a subcommand, run in its own process by bench/h200_run.sh; each appends one
JSON object per result to `--results` (JSON lines). `--tiny` shrinks everything so that every
subcommand runs on a CPU in seconds (the local check before the GPU run).

  build    model dir (config + random weights + the tiny word-level tokenizer), dataset, job yaml
  matmul   bf16 8192^3 matmul rate (the MFU denominator)
  train    training phase with our code: build_policy/build_reference (FSDP2, world size 1),
           actor.compute_logprobs (reference) + actor.update_policy, per maxTokensPerGPU, LM head
           (--heads fused,logits: model.useFusedKernels) and layout (--layouts padded,packed:
           model.useRemovePadding); --lengths skewed: realistic lengths, the same tokens (issue 34)
  ref      issue 47 item 4: the reference forward alone (compute_logprobs, forward-only) per token
           budget of its micro-batches (trainer.logProbMaxTokensPerGPU), and the cost of mapping
           its log-probs into the update's 16 K layout, checked against that layout's own forward
  gen      generation with the hf engine: the pre-issue-14 engine ("baseline", a copy in
           bench/hf_engine_baseline.py) and the current one
  sync     gRPC weight sync of the full model to a `grpo rollout` server subprocess (hf, GPU)
  storage  object-storage exchange of one step (file://): prompt shard, rollout shard, read back
  step     the whole GRPO step: grpo_trainer.trainer.Trainer.train_step with a `grpo rollout`
           server subprocess (hf engine) on the same GPU, gRPC weight sync
  trl      TRL GRPOTrainer on the same model and data, for comparison
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import bench_parser, emit  # noqa: F401  (emit: the other bench scripts call hb.emit)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

FULL = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
            max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TINY = dict(FULL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=512)
# Qwen3-8B's shape (the tutorial's model size), for LoRA on one GPU (issue 33): build --shape 8b.
SHAPE_8B = dict(FULL, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
WORKLOAD = dict(prompts=32, n=8, prompt_len=256, response_len=512)
TINY_WORKLOAD = dict(prompts=4, n=4, prompt_len=24, response_len=8)


def workload(args) -> dict:
    return TINY_WORKLOAD if args.tiny else WORKLOAD


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def device():
    import torch
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median(xs):
    return statistics.median(xs) if xs else None


# --- build ---------------------------------------------------------------------------------------

def prompt_text(tokenizer, length: int, k: int) -> str:
    """A chat prompt that tokenizes (with the chat template) to exactly `length` tokens."""
    from grpo_rollout.tiny import TASK_WORDS
    words = [str(k % 10)]
    while True:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words)}],
                                            add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else list(ids["input_ids"])
        if len(ids) == length:
            return " ".join(words)
        if len(ids) > length:
            raise ValueError(f"can't make a {length}-token prompt")
        words.append(TASK_WORDS[(len(words) + k) % len(TASK_WORDS)])


def cmd_build(args) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import yaml
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from grpo_rollout.tiny import IM_END, PAD, build_tokenizer
    out = Path(args.workdir)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    w = workload(args)
    tok = build_tokenizer()
    tok.model_max_length = 4096
    size = TINY if args.tiny else SHAPE_8B if args.shape == "8b" else FULL
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = Qwen3Config(pad_token_id=tok.convert_tokens_to_ids(PAD), bos_token_id=None,
                         eos_token_id=tok.convert_tokens_to_ids(IM_END), dtype=str(dtype).removeprefix("torch."),
                         **size)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device()):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                                               do_sample=True, temperature=1.0, top_p=1.0)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    build_s = time.perf_counter() - t0
    del model

    # Dataset: 4 batches' worth of prompts of exactly prompt_len tokens (verl layout, GSM8K rule).
    rows = []
    for i in range(w["prompts"] * 4):
        text = prompt_text(tok, w["prompt_len"], i)
        rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": text}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i % 10)},
                     "extra_info": {"index": i}})
    data = out / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)

    job = job_dict(args, model_dir, data, out / "run")
    (out / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    emit(args, "build", params=n_params, seconds=round(build_s, 2), model_dir=str(model_dir),
         bytes_on_disk=sum(f.stat().st_size for f in model_dir.iterdir()))


def job_dict(args, model_dir: Path, data: Path, storage: Path, max_tokens: int | None = None) -> dict:
    w = workload(args)
    cuda = not args.tiny
    return {
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "bench-h200"},
        "spec": {
            "model": {"path": str(model_dir), "dtype": "bfloat16" if cuda else "float32",
                      "gradientCheckpointing": True},
            "data": {"trainFiles": [str(data)], "trainBatchSize": w["prompts"],
                     "maxPromptLength": w["prompt_len"], "maxResponseLength": w["response_len"]},
            "algorithm": {"advEstimator": "grpo", "useKLLoss": True, "klLossCoef": 0.001,
                          "klLossType": "low_var_kl"},
            "rollout": {"engine": "hf", "n": w["n"], "replicas": 1, "temperature": 1.0},
            "trainer": {"projectName": "bench", "experimentName": "h200", "device": "cuda" if cuda else "cpu",
                        "nprocPerNode": 1, "miniBatchSize": w["prompts"], "microBatchSizePerGPU": w["prompts"] * w["n"],
                        "maxTokensPerGPU": max_tokens or (16384 if cuda else 64), "lr": 1e-6,
                        "totalSteps": 1000, "saveFreq": -1, "valBeforeTrain": False, "loggers": ["console"]},
            "storage": {"uri": f"file://{storage}"},
            "weightSync": {"backend": "grpc"},
            "resume": "never",
        },
    }


def load_bench_job(args, **overrides):
    from grpo_api.jobfile import load_job
    sets = [f"{k}={v}" for k, v in overrides.items()]
    return load_job(str(Path(args.workdir) / "job.yaml"), sets)


# --- matmul ----------------------------------------------------------------------------------------

def matmul_rate(dev, n: int | None = None) -> float:
    """bf16 n^3 matmul FLOP/s: median of 10 timed products after 3 warm-ups, random data."""
    import torch
    n = n or (8192 if dev.type == "cuda" else 512)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        sync(dev)
        t = time.perf_counter()
        a @ b
        sync(dev)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / median(times)


def cmd_matmul(args) -> None:
    import torch
    dev = device()
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__}
    import transformers
    info["transformers"] = transformers.__version__
    emit(args, "matmul", tflops=matmul_rate(dev) / 1e12, n=8192 if dev.type == "cuda" else 512, **info)


# --- training phase ----------------------------------------------------------------------------------

def model_flops(config, seq_len: int) -> dict:
    """Matmul FLOPs of one forward pass, per token: 2 x (projections + MLP + LM head) plus causal
    attention (QK^T and AV over the S^2/2 visible pairs). Embedding lookups and norms are free."""
    d, L = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * config.intermediate_size
    dense = 2 * (L * per_layer + config.vocab_size * d)
    attn = 2 * L * q * seq_len   # 2 matmuls x 2 FLOP x (S/2 keys on average) x q dims, per token
    return {"dense_per_token": dense, "attn_per_token": attn, "fwd_per_token": dense + attn}


def synthetic_samples(w: dict, vocab: int, seed: int = 0):
    import random

    from grpo_trainer.batch import Sample
    rng = random.Random(seed)
    samples = []
    for p in range(w["prompts"]):
        prompt = [rng.randrange(vocab) for _ in range(w["prompt_len"])]
        for i in range(w["n"]):
            resp = [rng.randrange(vocab) for _ in range(w["response_len"])]
            samples.append(Sample(f"u{p}", p, i, prompt, resp, [-1.0] * len(resp), float(rng.random() < 0.5), "length"))
    return samples


def skewed_samples(w: dict, vocab: int, total_tokens: int, seed: int = 0):
    """Realistic lengths (issue 34): prompts of 100-400 tokens, responses log-normal around a
    median of a third of the response limit (~250 of 768 at full size), cut at 4/3 of the fixed
    workload's response length (1024), and as many groups of n as make `total_tokens` (the fixed
    workload's), so both have the same tokens per step."""
    import math
    import random

    from grpo_trainer.batch import Sample
    rng = random.Random(seed)
    cap, median = w["response_len"] * 4 // 3, w["response_len"] * 250 // 512
    low, high = w["prompt_len"] * 100 // 256, w["prompt_len"] * 400 // 256
    samples, tokens, p = [], 0, 0
    while tokens < total_tokens:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(low, high))]
        for i in range(w["n"]):
            n = max(1, min(cap, round(math.exp(rng.gauss(math.log(median), 0.8)))))
            resp = [rng.randrange(vocab) for _ in range(n)]
            samples.append(Sample(f"u{p}", p, i, prompt, resp, [-1.0] * n, float(rng.random() < 0.5), "stop"))
            tokens += len(prompt) + n
        p += 1
    return samples


def set_lm_head(model, fused: bool) -> None:
    """The LM head as model.useFusedKernels true or false makes it (a class swap, the same weight)."""
    import torch

    from grpo_trainer.lm_head import FusedLMHead
    model.get_output_embeddings().__class__ = FusedLMHead if fused else torch.nn.Linear


def model_attention(spec, dev) -> str:
    import torch

    from grpo_trainer.attention import attn_implementation
    return attn_implementation(dev, spec.model.use_remove_padding, getattr(torch, spec.model.dtype.value),
                               spec.model.share_prompts)


def packed_check(model, group, samples, adv, dev, temperature: float, shared: bool = False) -> float:
    """The largest |difference| of the policy's log-probs on one micro-batch's response tokens,
    packed (`shared`: with each prompt once, model.sharePrompts) against padded (attention kernels
    and layouts: only rounding may differ)."""
    import torch

    from grpo_trainer import actor, batch as batching
    with torch.no_grad():
        packed = batching.collate(group, samples, adv, 0, dev, pack=True, share_prompts=shared)
        padded = batching.collate(group, samples, adv, 0, dev)
        diff = (actor.forward_logprobs(model, packed, temperature)[0]
                - actor.forward_logprobs(model, padded, temperature)[0])
    return float(diff[padded.response_mask.bool()].abs().max())


def attention_check(mb, dev, heads: int = 16, kv_heads: int = 8, dim: int = 128) -> float | None:
    """A shared row's attention (VARLEN: flash's varlen kernel on a GPU in bf16) against the
    float32 reference, sample by sample (`_per_sample`), on random queries, keys and values of
    the micro-batch's layout: the largest |difference| (bf16 rounding, ~1e-2; a causal mask
    aligned otherwise than to each sample's end would differ by ~1)."""
    import torch

    from grpo_trainer import attention
    packed = mb.packed
    if packed is None or packed.key_index is None:
        return None

    class Layer:
        is_causal = True
    m = packed.input_ids.shape[1]
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, m, dim, device=dev, generator=gen) for h in (heads, kv_heads, kv_heads))
    with torch.no_grad():
        got, _ = attention._attention(Layer(), *(t.bfloat16() for t in (q, k, v)), None, scaling=dim ** -0.5,
                                      **attention.packed_kwargs(packed))
        expected = attention._per_sample(*(t[0].transpose(0, 1) for t in (q, k[:, :, packed.key_index],
                                                                          v[:, :, packed.key_index])),
                                         packed.cu_seqlens_q, packed.cu_seqlens_k, True, dim ** -0.5)
    return float((got[0].float() - expected).abs().max())


def cmd_attention(args) -> None:
    """model.sharePrompts' attention on this device against the float32 reference, forward and
    backward, on the first micro-batches of the workload's shared layout (fixed and skewed
    lengths; no model needed, seconds): flash's varlen kernel in bf16 with fewer queries than
    keys must align each sample's causal mask to its end. Relative errors ||got - ref|| / ||ref||
    of the output and of dq, dk, dv (bf16 operands: 1e-3 to 1e-2), and the same for a mask
    aligned to each sample's first query (the control: what a wrong alignment reads)."""
    import torch

    from grpo_trainer import attention, batch as batching
    dev = device()
    w = workload(args)
    heads, kv_heads, dim, scale = 16, 8, 128, 128 ** -0.5

    class Layer:
        is_causal = True

    def rel(a, b):
        return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())

    def misaligned(q, k, v, cu_q, cu_k):      # sdpa with the mask aligned to each sample's first query
        outs = []
        for (a, b), (c, d) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]), zip(cu_k.tolist(), cu_k.tolist()[1:])):
            mask = torch.ones(b - a, d - c, dtype=torch.bool, device=q.device).tril()
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1), attn_mask=mask,
                scale=scale, enable_gqa=True))
        return torch.cat(outs, dim=1).transpose(0, 1)

    for lengths in ("fixed", "skewed"):
        samples = synthetic_samples(w, 1000)
        if lengths == "skewed":
            samples = skewed_samples(w, 1000, sum(s.length for s in samples))
        groups = batching.micro_batches(list(range(len(samples))), samples, packed=True, share_prompts=True,
                                        max_count=len(samples), max_tokens=args.max_tokens[0])
        for g in groups[:2]:
            packed = batching.collate(g, samples, None, 0, dev, pack=True, share_prompts=True).packed
            m, idx = packed.input_ids.shape[1], packed.key_index
            gen = torch.Generator(device=dev).manual_seed(len(g))
            q, k, v = (torch.randn(1, h, m, dim, device=dev, generator=gen) for h in (heads, kv_heads, kv_heads))
            grad_out = torch.randn(1, m, heads, dim, device=dev, generator=gen)
            q16, k16, v16 = (t.bfloat16().requires_grad_() for t in (q, k, v))
            got, _ = attention._attention(Layer(), q16, k16, v16, None, scaling=scale, **attention.packed_kwargs(packed))
            got.backward(grad_out.bfloat16())
            q32, k32, v32 = (t.clone().requires_grad_() for t in (q, k, v))
            as_rows = [t[0].transpose(0, 1) for t in (q32, k32[:, :, idx], v32[:, :, idx])]
            ref = attention._per_sample(*as_rows, packed.cu_seqlens_q, packed.cu_seqlens_k, True, scale)
            ref.backward(grad_out[0])
            with torch.no_grad():
                control = misaligned(*as_rows, packed.cu_seqlens_q, packed.cu_seqlens_k)
            emit(args, "attention", lengths=lengths, micro_batch_samples=len(g), row_tokens=m,
                 key_tokens=int(idx.numel()), out_rel=rel(got[0], ref), dq_rel=rel(q16.grad, q32.grad),
                 dk_rel=rel(k16.grad, k32.grad), dv_rel=rel(v16.grad, v32.grad),
                 control_out_rel=rel(control, ref), device=str(dev))


def init_dist(dev) -> None:
    import socket

    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                           rank=0, world_size=1)


def cmd_train(args) -> None:
    import torch
    from transformers import AutoConfig

    from grpo_trainer import actor, batch as batching
    from grpo_trainer.engine_sleep import expandable_segments
    from grpo_trainer.lora import wrapper
    from grpo_trainer.model import build_optimizer, build_policy, build_reference
    if set(args.heads) - {"fused", "logits"} or set(args.layouts) - {"padded", "packed", "shared"}:
        raise SystemExit(f"--heads: fused, logits; --layouts: padded, packed, shared (got {args.heads}, {args.layouts})")
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    init_dist(dev)
    w = workload(args)
    # With packed rows the models get model.useRemovePadding's attention (varlen on a GPU; padded
    # rows then run sdpa as before).
    sets = dict(kv.split("=", 1) for kv in args.set)      # --set KEY=VALUE: e.g. model.dtype on a tiny run
    # shared: model.sharePrompts, each prompt once in a packed row (the same model serves every layout)
    layout_sets = {"spec.model.useRemovePadding": "true"} if {"packed", "shared"} & set(args.layouts) else {}
    if "shared" in args.layouts:
        layout_sets["spec.model.sharePrompts"] = "true"
    job = load_bench_job(args, **layout_sets, **sets)
    spec = job.spec
    config = AutoConfig.from_pretrained(spec.model.path)
    log(f"attention: {model_attention(spec, dev)}")
    peak = matmul_rate(dev)
    log(f"matmul peak {peak / 1e12:.0f} TFLOP/s")
    t0 = time.perf_counter()
    model = build_policy(spec.model, dev, compile=args.compile, wrap=wrapper(spec.model))
    ref = build_reference(spec.model, dev, cpu_offload=False, compile=args.compile)
    opt, sched = build_optimizer(model, spec.trainer, total_steps=1000)
    log(f"policy + reference built in {time.perf_counter() - t0:.1f}s")
    samples = synthetic_samples(w, config.vocab_size)
    if args.lengths == "skewed":
        samples = skewed_samples(w, config.vocab_size, sum(s.length for s in samples))
    adv = batching.advantages_per_sample(samples, "grpo", norm_adv_by_std=True, gamma=1.0)
    seq = w["prompt_len"] + w["response_len"]
    flops = model_flops(config, seq)
    tokens = sum(s.length for s in samples)
    log(f"{len(samples)} samples, {tokens} tokens ({args.lengths} lengths, longest {max(s.length for s in samples)})")
    variants = [(t, head, layout) for t in args.max_tokens for head in args.heads for layout in args.layouts]
    for k, (max_tokens, head, layout) in enumerate(variants):
        for m in (model, ref):
            set_lm_head(m, head == "fused")
        packed, shared = layout != "padded", layout == "shared"
        spec_k = load_bench_job(args, **{"spec.trainer.maxTokensPerGPU": max_tokens}, **sets).spec
        groups = batching.micro_batches(list(range(len(samples))), samples, packed=packed, share_prompts=shared,
                                        max_count=spec_k.trainer.micro_batch_size_per_gpu, max_tokens=max_tokens)
        mbs = [batching.collate(g, samples, adv, 0, dev, pack=packed, share_prompts=shared) for g in groups]
        steps = args.steps + args.warmup    # each variant warms up: its own shapes and memory
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        rows = []
        for step in range(steps):
            if args.allocator == "sleep":
                expandable_segments(True)
            sync(dev)
            t1 = time.perf_counter()
            ref_logp = dict(zip(map(id, mbs), actor.compute_logprobs(ref, mbs, spec_k.rollout.temperature)))
            sync(dev)
            t2 = time.perf_counter()
            result = actor.update_policy(model, opt, sched, spec_k, [mbs], {}, ref_logp, 1, dev)
            sync(dev)
            t3 = time.perf_counter()
            rows.append({"ref_s": t2 - t1, "update_s": t3 - t2, "train_s": t3 - t1,
                         "kl_loss": result.metrics.get("actor/kl_loss"), "grad_norm": result.metrics.get("actor/grad_norm")})
            if args.allocator and dev.type == "cuda":   # what the engines' wake would find taken
                if args.allocator == "sleep":
                    expandable_segments(False)
                torch.cuda.empty_cache()
                rows[-1].update(held_gb=torch.cuda.memory_reserved(dev) / 1e9,
                                tensors_gb=torch.cuda.memory_allocated(dev) / 1e9)
            log(f"maxTokensPerGPU={max_tokens} {head} head {layout} step {step}: ref {t2 - t1:.2f}s "
                f"update {t3 - t2:.2f}s "
                f"kl {result.metrics.get('actor/kl_loss'):.3g} gn {result.metrics.get('actor/grad_norm'):.3g}")
        check = packed_check(model, groups[0], samples, adv, dev, spec_k.rollout.temperature, shared) if packed else None
        attention_diff = attention_check(mbs[0], dev) if shared else None
        timed = rows[args.warmup:]
        train_s = median([r["train_s"] for r in timed])
        ref_s, upd_s = median([r["ref_s"] for r in timed]), median([r["update_s"] for r in timed])
        mfu_flops = tokens * flops["fwd_per_token"] * 4          # ref fwd + policy fwd/bwd (3x)
        hfu_flops = tokens * flops["fwd_per_token"] * 5          # + the checkpointed recompute
        emit(args, "train", max_tokens_per_gpu=max_tokens, head=head, layout=layout, lengths=args.lengths, sets=args.set,
             allocator=args.allocator,
             packed_vs_padded_logp_max_diff=check, attention=model_attention(spec, dev),
             shared_attention_vs_reference_max_diff=attention_diff,
             model_tokens=sum((mb.packed or mb).input_ids.numel() for mb in mbs),   # padding included
             compiled=args.compile, micro_batches=len(mbs),
             micro_batch_rows=[len(g) for g in groups], tokens=tokens, steps=rows, warmup=args.warmup,
             ref_s=ref_s, update_s=upd_s, train_s=train_s, tokens_per_s=tokens / train_s,
             update_tokens_per_s=tokens / upd_s, ref_tokens_per_s=tokens / ref_s,
             mfu=mfu_flops / train_s / peak, hfu=hfu_flops / train_s / peak,
             mfu_update=tokens * flops["fwd_per_token"] * 3 / upd_s / peak,
             mfu_ref=tokens * flops["fwd_per_token"] / ref_s / peak,
             peak_tflops=peak / 1e12, flops_per_token_fwd=flops["fwd_per_token"],
             params=sum(p.numel() for p in model.parameters()),
             max_mem_gb=torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None)
        del mbs


def cmd_ref(args) -> None:
    import torch
    from transformers import AutoConfig

    from grpo_trainer import actor, batch as batching
    from grpo_trainer.model import build_reference
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    init_dist(dev)
    w = workload(args)
    spec = load_bench_job(args, **dict(kv.split("=", 1) for kv in args.set)).spec
    config = AutoConfig.from_pretrained(spec.model.path)
    peak = matmul_rate(dev)
    ref = build_reference(spec.model, dev, cpu_offload=False, compile=args.compile)
    samples = synthetic_samples(w, config.vocab_size)
    tokens = sum(s.length for s in samples)
    flops = model_flops(config, w["prompt_len"] + w["response_len"])
    temperature = spec.rollout.temperature
    everyone = list(range(len(samples)))

    def collated(budget):
        groups = batching.micro_batches(everyone, samples, max_count=len(samples), max_tokens=budget)
        return [batching.collate(g, samples, None, 0, dev) for g in groups]
    update = collated(args.max_tokens[0])           # the update's layout; its own forward is the check
    own = actor.compute_logprobs(ref, update, temperature)
    width = max(len(s.response_ids) for s in samples)
    for budget in args.max_tokens:
        forward = collated(budget)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        times = []
        for _ in range(args.warmup + args.steps):
            sync(dev)
            t0 = time.perf_counter()
            logp = actor.compute_logprobs(ref, forward, temperature)
            sync(dev)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        per_sample = batching.gather_response_values(forward, logp, samples, width)
        mapped = [batching.scatter_response_values(mb, per_sample, samples, like=mb.response_mask.float())
                  for mb in update]
        sync(dev)
        map_s = time.perf_counter() - t0
        diff = max(float(((m - o.float()) * mb.response_mask).abs().max()) for m, o, mb in zip(mapped, own, update))
        ref_s = median(times[args.warmup:])
        log(f"ref forward, {budget} tokens a micro-batch ({len(forward)}): {ref_s:.3f}s, map {map_s:.3f}s, "
            f"max |diff| against the {args.max_tokens[0]} layout {diff:.3g}")
        emit(args, "ref", log_prob_max_tokens_per_gpu=budget, micro_batches=len(forward), compiled=args.compile,
             tokens=tokens, steps=times, warmup=args.warmup, ref_s=ref_s, map_s=map_s,
             mfu_ref=tokens * flops["fwd_per_token"] / ref_s / peak, max_abs_diff_vs_update_layout=diff,
             update_layout_tokens=args.max_tokens[0], peak_tflops=peak / 1e12,
             max_mem_gb=torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None)


# --- generation ------------------------------------------------------------------------------------

def load_engine(args, variant: str, model_dir: str):
    import torch
    dev = device()
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    if variant == "baseline":
        sys.path.insert(0, str(HERE))
        from hf_engine_baseline import HFEngine
        engine = HFEngine(model_dir, dtype=dtype, device=dev.type, seed=0)
    else:
        from grpo_rollout.hf_engine import HFEngine
        engine = HFEngine(model_dir, dtype=dtype, device=dev.type, seed=0)
    engine._eos = {-1}   # the workload: EOS suppressed (no token is -1), every response is max_tokens long
    return engine, torch.device(dev)


def bench_prompts(args, count: int) -> list[list[int]]:
    from grpo_api.storage import Storage
    from grpo_trainer.data import load_prompts
    from grpo_trainer.model import load_tokenizer
    job = load_bench_job(args)
    tok = load_tokenizer(job.spec.model)
    rows = load_prompts(job.spec.data.train_files, job.spec.data, tok, Storage(job.spec.storage)).rows
    return [r.prompt_ids for r in rows[:count]]


def cmd_gen(args) -> None:
    from grpo_rollout.engine import SamplingParams
    w = workload(args)
    model_dir = str(Path(args.workdir) / "model")
    engine, dev = load_engine(args, args.variant, model_dir)
    prompts = bench_prompts(args, args.prompts or w["prompts"])
    max_tokens = args.max_tokens or w["response_len"]
    assert all(len(p) == w["prompt_len"] for p in prompts)
    # Warm-up: one short call of the same batch shape (kernels, allocator, cache).
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(n=w["n"], max_tokens=4, seed=1))
    sync(dev)
    log(f"{args.variant}: warm-up {time.perf_counter() - t:.1f}s")
    times = []
    for rep in range(args.reps):
        sync(dev)
        t = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(n=w["n"], max_tokens=max_tokens, seed=100 + rep))
        sync(dev)
        times.append(time.perf_counter() - t)
        lengths = [len(s.token_ids) for g in groups for s in g]
        assert all(n == max_tokens for n in lengths), set(lengths)
        log(f"{args.variant}: {len(lengths)} x {max_tokens} tokens in {times[-1]:.2f}s")
    seqs = len(prompts) * w["n"]
    secs = median(times)
    tok_s = seqs * max_tokens / secs
    target = WORKLOAD["prompts"] * WORKLOAD["n"] * WORKLOAD["response_len"] if not args.tiny else seqs * w["response_len"]
    emit(args, "gen", variant=args.variant, sequences=seqs, max_tokens=max_tokens, batch=engine._max_batch,
         seconds=times, median_s=secs, tokens_per_s=tok_s, step_ms=1000 * secs / max_tokens / -(-seqs // engine._max_batch),
         est_workload_s=target / tok_s)


# --- rollout server subprocess -----------------------------------------------------------------------

def start_rollout_server(args, job_path: str, token: str, log_path: Path, gpu: int | None = None):
    """`grpo rollout` (via its module: the package may not be installed) on a free port; on GPU
    `gpu` alone when given (CUDA_VISIBLE_DEVICES, as a pod of its own sees it)."""
    env = {**os.environ, "GRPO_RPC_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    if os.environ.get("BENCH_ROLLOUT_MPS_PERCENTAGE"):   # the server's share of the SMs under MPS, apart from the trainer's
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = os.environ["BENCH_ROLLOUT_MPS_PERCENTAGE"]
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    code = "import sys; from grpo_rollout.serve import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "--spec", job_path, "--port", "0", "--metrics-port", "-1",
            "--worker-id", "bench-rollout", "--device", "cuda" if not args.tiny else "cpu"]
    logf = open(log_path, "ab")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=logf)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rollout server exited ({proc.wait()}); see {log_path}")
        if line.startswith(b"GRPO_ROLLOUT_READY "):
            info = json.loads(line.split(b" ", 1)[1])
            return proc, f"127.0.0.1:{info['port']}"
    proc.kill()
    raise RuntimeError("rollout server not ready in 300s")


def stop_server(proc) -> None:
    import signal
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def dump_server_log(path: Path, lines: int = 15) -> None:
    if path.exists():
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print("--- rollout server log (tail) ---\n" + "\n".join(tail) + "\n---", flush=True)


# --- weight sync -----------------------------------------------------------------------------------

def cmd_sync(args) -> None:
    import hashlib
    import secrets

    import torch
    from safetensors.torch import load_file

    from grpo_api.weights import plan_buckets
    from grpo_api.rpc import RolloutClients
    from grpo_trainer.weight_sync import GrpcWeightSender, pack_bucket, tensor_specs
    job_path = str(Path(args.workdir) / "job.yaml")
    model_dir = Path(args.workdir) / "model"
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    # The trainer sends what get_model_state_dict(full_state_dict, cpu_offload) gives: the fp32
    # master weights (tied embeddings appear under both names, as in the HF state dict).
    if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    # fp32: what the trainer sends today (fp32 masters, tied embedding twice); bf16: the rollout
    # engine's dtype; -dedup: the tied lm_head.weight left out (the engine's lm_head is the
    # embedding: loading one loads both).
    variants = {"fp32": {k: v.float() for k, v in weights.items()},
                "bf16": {k: v.to(torch.bfloat16) for k, v in weights.items()},
                "bf16-dedup": {k: v.to(torch.bfloat16) for k, v in weights.items() if k != "lm_head.weight"}}
    variants = {k: v for k, v in variants.items() if k in args.sync_variants}
    token = secrets.token_hex(16)
    log_path = Path(args.log_dir) / "sync-rollout-server.log"
    t = time.perf_counter()
    proc, address = start_rollout_server(args, job_path, token, log_path)
    log(f"rollout server at {address} ready in {time.perf_counter() - t:.1f}s")
    try:
        # Sender-side CPU cost of one bucket: pack + tobytes + sha256 (no network).
        bucket_bytes = 512 << 20
        first = next(iter(variants.values()))
        buckets = plan_buckets(tensor_specs(first.items()), bucket_bytes)
        t = time.perf_counter()
        buf = pack_bucket(buckets[0], iter(first.items()), torch.device("cpu"))
        t_pack = time.perf_counter() - t
        t = time.perf_counter()
        data = buf.numpy().tobytes()
        t_bytes = time.perf_counter() - t
        t = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        t_sha = time.perf_counter() - t
        emit(args, "sync_cpu_costs", bucket_mb=len(data) / 2**20, pack_s=t_pack, tobytes_s=t_bytes, sha256_s=t_sha,
             sha256_gbps=len(data) / t_sha / 1e9)
        sender = GrpcWeightSender(RolloutClients(token), bucket_bytes=bucket_bytes)
        version = 0
        for name in args.sync_variants:
            tensors = variants[name]
            nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
            for rep in range(args.reps):
                version += 1
                t = time.perf_counter()
                report = sender.send([address], tensors.items(), version)
                secs = time.perf_counter() - t
                log(f"sync {name} v{version}: {nbytes / 1e9:.2f} GB in {secs:.2f}s = {nbytes / secs / 1e9:.2f} GB/s")
                emit(args, "sync", payload=name, version=version, gbytes=nbytes / 1e9, seconds=secs,
                     gbps=nbytes / secs / 1e9, report_seconds=report.seconds, buckets=len(plan_buckets(
                         tensor_specs(tensors.items()), bucket_bytes)))
        sender.close()
    finally:
        stop_server(proc)
        dump_server_log(log_path)


# --- storage exchange ----------------------------------------------------------------------------------

def cmd_storage(args) -> None:
    import io
    import random

    import pyarrow.parquet as pq

    from grpo_api.records import PROMPT_SCHEMA, RunLayout
    from grpo_api.spec import StorageSpec
    from grpo_api.storage import Storage
    from grpo_rollout.engine import Sample as EngineSample
    from grpo_rollout.shard import Prompt, Scored, rollout_table
    from grpo_trainer.batch import samples_from_table
    from grpo_trainer.data import PromptRow, prompt_shard_table
    w = workload(args)
    root = f"file://{Path(args.workdir) / 'storage-bench'}"
    storage = Storage(StorageSpec(uri=root))
    layout = RunLayout(root)
    rng = random.Random(0)
    rows = [PromptRow(i, [rng.randrange(26) for _ in range(w["prompt_len"])], "openai/gsm8k", str(i % 10), "{}")
            for i in range(w["prompts"])]
    vocab = TINY["vocab_size"] if args.tiny else FULL["vocab_size"]
    groups = [[EngineSample([rng.randrange(vocab) for _ in range(w["response_len"])],
                            [-rng.random() * 10 for _ in range(w["response_len"])], "length") for _ in range(w["n"])]
              for _ in range(w["prompts"])]
    reps = []
    for rep in range(args.reps):
        t = {}
        t0 = time.perf_counter()
        # trainer: prompt shard -> parquet bytes -> storage (RolloutDispatcher.generate)
        table = prompt_shard_table(rows, 0)
        sink = io.BytesIO()
        pq.write_table(table, sink)
        uri = layout.prompt_shard(rep, "train-shard-000")
        storage.write_bytes(uri, sink.getvalue())
        t["write_prompts_s"] = time.perf_counter() - t0
        # rollout server: read the prompt shard, write the rollout shard (RolloutWorker.generate)
        t1 = time.perf_counter()
        prompts = Prompt.rows(storage.read_table(uri, PROMPT_SCHEMA))
        t["read_prompts_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        scored = [[Scored(s, 0.0, {"acc": False}) for s in g] for g in groups]
        out = rollout_table(prompts, scored, policy_version=rep, worker="bench")
        t["build_rollout_table_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        out_uri = layout.rollout_shard(rep, "train-shard-000-attempt-1")
        storage.write_table(out_uri, out)
        t["write_rollouts_s"] = time.perf_counter() - t3
        # trainer: read the rollout shard back into samples (Trainer._read_rollouts)
        t4 = time.perf_counter()
        samples = samples_from_table(storage.read_table(out_uri))
        t["read_rollouts_s"] = time.perf_counter() - t4
        t["total_s"] = time.perf_counter() - t0
        assert len(samples) == w["prompts"] * w["n"]
        t["rollout_shard_mb"] = Path(out_uri.removeprefix("file://")).stat().st_size / 2**20
        reps.append(t)
    summary = {k: median([r[k] for r in reps]) for k in reps[0]}
    log("storage: " + ", ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    emit(args, "storage", reps=reps, **{f"median_{k}": v for k, v in summary.items()})


# --- the whole step --------------------------------------------------------------------------------

def cmd_step(args) -> None:
    import secrets

    import torch
    import torch.distributed as dist
    import yaml

    from grpo_trainer.trainer import Trainer
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    overrides = {"spec.trainer.maxTokensPerGPU": args.max_tokens[0], "spec.rollout.engine": args.engine,
                 "spec.weightSync.backend": args.weight_sync, "spec.trainer.useTorchCompile": not args.no_compile,
                 "spec.rollout.maxStaleness": args.max_staleness}
    if args.engine == "vllm":
        overrides["spec.rollout.gpuMemoryUtilization"] = args.gpu_memory_utilization
    # --set KEY=VALUE: a variant of the workload (LoRA, PPO's critic, ...), named by --label.
    overrides.update(kv.split("=", 1) for kv in args.set)
    job = load_bench_job(args, **overrides)
    job_path = str(Path(args.workdir) / f"job-step-{args.engine}.yaml")
    Path(job_path).write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True)))
    token = secrets.token_hex(16)
    os.environ["GRPO_RPC_TOKEN"] = token
    log_path = Path(args.log_dir) / f"step-rollout-server-{args.engine}.log"
    t = time.perf_counter()
    proc, address = start_rollout_server(args, job_path, token, log_path, gpu=args.rollout_gpu)
    log(f"rollout server at {address} ready in {time.perf_counter() - t:.1f}s")
    try:
        init_dist(dev)
        t = time.perf_counter()
        from grpo_api.rpc import ClientAuth
        # plaintext on loopback, as the bench's server runs (TLS cost: bench/tls_weight_sync.py)
        # one key per workdir, as `grpo run` keeps one per run: the compile cache a run signed is
        # the next run's (phase compile-cache)
        from grpo_api import signing
        key = bytes.fromhex(signing.key_file(Path(args.workdir) / signing.KEY_FILE, create=True))
        trainer = Trainer(job, rollout_addresses=address, auth=ClientAuth(token), checkpoint_key=key, local=True)
        log(f"trainer built in {time.perf_counter() - t:.1f}s")
        replies = []
        generate = trainer.rollouts.dispatcher.generate

        def generate_and_keep(*a, **k):
            results = generate(*a, **k)
            replies.append([r.reply for r in results])
            return results
        trainer.rollouts.dispatcher.generate = generate_and_keep
        rows = []
        for step in range(1, args.steps + args.warmup + 1):
            trainer.state.step = step
            m = trainer.train_step(step)
            reply = replies[-1][0]
            row = {k: m[k] for k in m if k.startswith(("timing_s/", "rollout_corr/"))}
            row.update({"generate_s": reply.generate_seconds, "reward_s": reply.reward_seconds,
                        "generated_tokens": reply.generated_tokens, "gbytes": trainer.publisher.layout.nbytes / 1e9,
                        "response_length_mean": m["response_length/mean"], "kl_loss": m.get("actor/kl_loss"),
                        "mfu_trainer_estimate": m.get("perf/mfu")})
            rows.append(row)
            emit(args, "step_row", step=step, warmup=step <= args.warmup, **row)   # kept if a later step times out
            log(f"step {step}: " + ", ".join(f"{k.removeprefix('timing_s/')}={v:.2f}" for k, v in row.items()
                                              if isinstance(v, float)))
        timed = rows[args.warmup:]
        summary = {k: median([r[k] for r in timed]) for k in timed[0] if isinstance(timed[0][k], (int, float))}
        emit(args, "step", label=args.label, sets=args.set, engine=args.engine, weight_sync=args.weight_sync,
             compiled=not args.no_compile,
             max_staleness=args.max_staleness, rollout_gpu=args.rollout_gpu,
             weight_path="cuda_ipc" if trainer.publisher._info and all(c for c, _ in trainer.publisher._info.values())
             else args.weight_sync,
             steps=rows, warmup=args.warmup, max_tokens_per_gpu=args.max_tokens[0],
             **{f"median_{k.removeprefix('timing_s/')}": v for k, v in summary.items()},
             max_mem_gb_trainer=torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None)
        dist.destroy_process_group()
    finally:
        stop_server(proc)
        dump_server_log(log_path)


# --- TRL -----------------------------------------------------------------------------------------

def trl_generation(args, w) -> dict:
    """TRL's generation settings: HF generate, or (--vllm) vLLM colocated in TRL's process, as
    bench/RESULTS.md's 24.0 s peer ran it (sleep mode off, 30 % of the GPU for vLLM)."""
    if not args.vllm:
        return dict(use_vllm=False, generation_kwargs={"min_new_tokens": w["response_len"]})
    return dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=False,
                generation_kwargs={"min_tokens": w["response_len"]})


def cmd_trl(args) -> None:
    """TRL's GRPOTrainer as issue 14 configures it: no vLLM, per-device batch 16, grad accumulation
    16, 8 generations, 512 new tokens (min_new_tokens 512), beta 0.001, bf16, gradient
    checkpointing. Seconds per optimizer step from a callback, after warm-up."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    w = workload(args)
    model_dir = str(Path(args.workdir) / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = bench_prompts(args, w["prompts"] * 4)
    # TRL tokenizes text itself: give it the decoded prompt text (the same tokens, plain prompts).
    texts = [tok.decode(p) for p in prompts]
    assert len(tok(texts[0])["input_ids"]) == w["prompt_len"], len(tok(texts[0])["input_ids"])
    ds = Dataset.from_dict({"prompt": texts})
    cuda = not args.tiny
    per_device = 16 if cuda else 4
    accum = (w["prompts"] * w["n"]) // per_device

    def reward(completions, **kw):
        return [float(len(c) % 2) for c in completions]

    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            sync(device())
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync(device())
            times.append(time.perf_counter() - self.t)
            log(f"trl step {state.global_step}: {times[-1]:.2f}s")

    cfg = GRPOConfig(output_dir=str(Path(args.workdir) / "trl-out"), per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=accum, num_generations=w["n"],
                     max_completion_length=w["response_len"], beta=0.001, bf16=cuda, use_cpu=not cuda,
                     gradient_checkpointing=True, learning_rate=1e-6, max_steps=args.steps + args.warmup,
                     logging_steps=1, save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0,
                     **trl_generation(args, w))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Timer()])
    t = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t
    timed = times[args.warmup:]
    hist = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    emit(args, "trl", vllm=args.vllm, steps_s=times, warmup=args.warmup, median_step_s=median(timed), total_train_s=total,
         completion_mean_length=[h.get("completions/mean_length") for h in hist],
         per_device_train_batch_size=per_device, gradient_accumulation_steps=accum)


def main(argv=None) -> int:
    if os.environ.get("BENCH_DUMP_S"):     # where a phase that times out spends its time
        import faulthandler
        faulthandler.dump_traceback_later(int(os.environ["BENCH_DUMP_S"]), repeat=True)
    p = bench_parser(__doc__)
    p.add_argument("command", choices=["build", "matmul", "attention", "train", "ref", "gen", "sync", "storage", "step", "trl"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--max-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[16384],
                   help="train/step: maxTokensPerGPU values (comma-separated)")
    p.add_argument("--variant", default="current", choices=["baseline", "current"])
    p.add_argument("--prompts", type=int, default=None, help="gen: prompts (x n sequences)")
    p.add_argument("--gen-tokens", dest="max_tokens_gen", type=int, default=None)
    p.add_argument("--sync-variants", type=lambda s: s.split(","), default=["fp32", "bf16-dedup"])
    p.add_argument("--compile", action="store_true", help="train: torch.compile each decoder layer")
    p.add_argument("--heads", type=lambda s: s.split(","), default=["fused"],
                   help="train: LM heads to measure, fused (model.useFusedKernels, the default) and/or logits")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["padded"],
                   help="train: micro-batch layouts, padded and/or packed (model.useRemovePadding)")
    p.add_argument("--lengths", default="fixed", choices=["fixed", "skewed"],
                   help="train: every sample prompt_len + response_len, or skewed lengths (the same tokens)")
    p.add_argument("--allocator", default=None, choices=["plain", "sleep"],
                   help="train: after each step empty torch's cache and record what the process still holds "
                        "(held_gb, tensors_gb), as before a colocated engine's wake; sleep: the step with "
                        "expandable segments, as while the engines sleep (grpo_trainer.engine_sleep)")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="step: the rollout engine")
    p.add_argument("--weight-sync", default="nccl", choices=["nccl", "grpc"],
                   help="step: spec.weightSync.backend (nccl: cuda_ipc when co-located)")
    p.add_argument("--no-compile", action="store_true", help="step: trainer.useTorchCompile false")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="step, train: a job override")
    p.add_argument("--label", default="", help="step: names the variant in the results")
    p.add_argument("--shape", default="1.7b", choices=["1.7b", "8b"], help="build: the model's shape")
    p.add_argument("--max-staleness", type=int, default=0, help="step: rollout.maxStaleness (1: overlap)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="step: vLLM's share of the GPU")
    p.add_argument("--rollout-gpu", type=int, default=None,
                   help="step: the rollout server on this GPU alone (disaggregated); default: the trainer's")
    p.add_argument("--vllm", action="store_true", help="trl: vLLM colocated (use_vllm, vllm_mode colocate)")
    args = p.parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    if args.command == "gen":
        args.max_tokens = args.max_tokens_gen
    log(f"h200_bench {args.command} {' '.join(argv or sys.argv[1:])}")
    t = time.perf_counter()
    globals()[f"cmd_{args.command}"](args)
    log(f"{args.command} done in {time.perf_counter() - t:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
