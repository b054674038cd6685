"""Issue 45: where the VL update's time goes, on one GPU, without vLLM. One micro-batch as the
GRPO step makes it (`--prompts` prompts x `--n` samples, one 448 x 448 image per prompt, 512
response tokens) through the Qwen2.5-VL-3B-shaped random model of bench/vl_vllm_check.py, bf16,
gradient checkpointing on, forward + backward of the summed response log-probs; each variant:

  per-row   each row's image through the vision tower (what the trainer did before 12-04)
  shared    each distinct image once, its features shared by its rows (grpo_trainer.vision.forward_inputs)
and the vision tower's attention either transformers' sdpa path (one call per window of every
image) or grpo_trainer.attention.VISION_VARLEN (one varlen flash call per layer).

Each variant's log-probs against the first's (per-row, sdpa) in the same call: equal up to bf16
noise (max and mean |d|), else a variant computes something else.

    python bench/vl_update_profile.py --workdir /tmp/grpo-bench --results OUT.jsonl [--tiny]
"""

from __future__ import annotations

import time
from pathlib import Path

import bench_common
from bench_common import bench_parser


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from grpo_trainer import attention, vision
    from vl_vllm_check import build_model, noise_png

    def emit(row):
        bench_common.emit(args, "vl_update", **row)

    started = time.monotonic()
    model, tok, image_processor, _ = build_model(Path(args.workdir) / "vl-update-model", args.tiny)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device = next(model.parameters()).device
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    emit({"phase": "build", "seconds": round(time.monotonic() - started, 1)})

    image_id, merge = model.config.image_token_id, model.config.vision_config.spatial_merge_size
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the image"}]}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = rendered if isinstance(rendered, list) else list(rendered["input_ids"])
    pngs = [noise_png(i) for i in range(args.prompts)]
    prompt = vision.expand_image_tokens(rendered, image_id, vision.pixel_inputs(image_processor, pngs[:1]).rows_grid_thw,
                                        merge)
    gen = torch.Generator().manual_seed(0)
    specials = set(tok.all_special_ids) | {image_id, model.config.video_token_id}
    words = torch.tensor([t for t in range(len(tok)) if t not in specials])      # responses never hold a placeholder
    rows = [prompt + words[torch.randint(0, len(words), (args.response,), generator=gen)].tolist()
            for _ in range(args.prompts * args.n)]
    ids = torch.tensor(rows, device=device)
    mask = torch.ones_like(ids)
    row_images = [pngs[i // args.n] for i in range(len(rows))]
    shared = vision.pixel_inputs(image_processor, row_images).to(device)
    apart = [vision.pixel_inputs(image_processor, [png]) for png in row_images]
    per_row = vision.PixelInputs(torch.cat([p.pixel_values for p in apart]), torch.cat([p.image_grid_thw for p in apart]),
                                 torch.arange(len(rows))).to(device)
    start = len(prompt)
    targets = ids[:, start:]

    def logprobs(pixels):
        with vision.forward_inputs(model, ids, mask, pixels) as extra:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=ids.shape[1] - start + 1,
                           **extra).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]

    varlen = attention.vision_attn_implementation(device, torch.bfloat16)
    baseline = None
    for attn in ("sdpa", varlen):
        if attn is None:
            emit({"phase": "skip", "why": "no varlen kernel here (a GPU, bf16, torch.nn.attention.varlen)"})
            continue
        vision.set_vision_attention(model, attn)
        for label, pixels in (("per-row", per_row), ("shared", shared)):
            with torch.no_grad():
                logp = logprobs(pixels)
            baseline = logp if baseline is None else baseline
            seconds = []
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.reps + 1):         # the first is a warm-up
                sync()
                t = time.perf_counter()
                logprobs(pixels).sum().backward()
                sync()
                seconds.append(time.perf_counter() - t)
                model.zero_grad(set_to_none=True)
            emit({"phase": "forward-backward", "vision_attention": attn, "images": label, "rows": len(rows),
                  "distinct_images": len(shared.image_grid_thw), "tokens": ids.numel(),
                  "seconds": round(sorted(seconds[1:])[len(seconds[1:]) // 2], 3), "warmup_s": round(seconds[0], 2),
                  "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if on_gpu else None,
                  "logp_max_abs_vs_first": round(float((logp - baseline).abs().max()), 4),
                  "logp_mean_abs_vs_first": round(float((logp - baseline).abs().mean()), 5)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
