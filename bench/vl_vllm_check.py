"""Issue 45 items 3 and 8: vLLM's multimodal inputs (grpo_rollout.vllm_engine with images) on a
Qwen2.5-VL-3B-shaped random model (36 layers x 2048, a 32-block vision tower, vocabulary 151936;
tokenizer and processor from grpo_rollout.tiny_vl; --shape: Qwen2.5-VL-7B (8.29 B), Qwen3-VL's 2B and
8B too), on one GPU:

1. correctness: prompts built as the trainer builds them (the chat template, each image's
   placeholder widened by grpo_trainer.vision.expand_image_tokens) generate on vLLM with their
   images; the same sequences' log-probs from the transformers model (the trainer's forward:
   grpo_trainer.vision.forward_inputs, mrope positions) must agree far better with the right
   images than with the images shifted by one row. Run after the vision tower's weights were
   changed in both (perturbed, then sent through `load_weights` under their Hugging Face names):
   a vision weight that vLLM did not take would show as disagreement;
2. cost: 64 prompts x 4 samples x 256 tokens with one 448 x 448 image each (256 image tokens)
   against text-only prompts of the same length, and the GPU memory in use.

    python bench/vl_vllm_check.py --workdir /tmp/grpo-bench --results OUT.jsonl [--tiny]

With --write-job it only builds the model and a colours dataset of 448 x 448 images (verl's layout,
grpo_rollout.tiny_vl's task) and writes the workdir's job.yaml, for bench/h200_bench.py's `step`
(phase vl-step: the GRPO step of the VL model with vLLM, issue 45 item 8).
"""

from __future__ import annotations

import io
import subprocess
import time
from pathlib import Path

import bench_common
from bench_common import bench_parser

# Random models of the published shapes: (tiny_vl architecture, text and vision config overrides).
# Qwen3-VL's from torchtitan's qwen3_vl experiment configs (2B: Qwen3-1.7B's text model, 8B: Qwen3-8B's).
_QWEN3_VL_ROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
_QWEN25_VL_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}


def _qwen25_vision(out_hidden_size: int) -> dict:
    """Qwen2.5-VL's vision tower, the same at 3B and 7B but for the width it projects into."""
    return dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=out_hidden_size,
                fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2)


SHAPES = {
    "qwen2.5-vl-3b": ("qwen2.5-vl", dict(
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, max_position_embeddings=32768, vocab_size=151936, tie_word_embeddings=True,
                  rope_parameters=_QWEN25_VL_ROPE),
        vision=_qwen25_vision(2048))),
    # verl's geo3k LoRA script's model (Qwen2.5-VL-7B-Instruct's config.json).
    "qwen2.5-vl-7b": ("qwen2.5-vl", dict(
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, max_position_embeddings=128000, vocab_size=152064, tie_word_embeddings=False,
                  rope_parameters=_QWEN25_VL_ROPE),
        vision=_qwen25_vision(3584))),
    "qwen3-vl-2b": ("qwen3-vl", dict(
        text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, vocab_size=151936,
                  tie_word_embeddings=True, rope_parameters=_QWEN3_VL_ROPE),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17]))),
    "qwen3-vl-8b": ("qwen3-vl", dict(
        text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, vocab_size=151936,
                  tie_word_embeddings=False, rope_parameters=_QWEN3_VL_ROPE),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24]))),
}
IMAGE_PIXELS = 448


def build_model(out: Path, tiny: bool, shape_name: str = "qwen2.5-vl-3b"):
    """The shaped random VL model (SHAPES; --tiny: tiny_vl's sizes of its architecture) in bf16 on
    the GPU, saved with the tiny tokenizer and a full processor (vLLM loads AutoProcessor); returns
    the model (kept for the reference forward)."""
    import torch
    import transformers

    from grpo_rollout import tiny_vl
    arch, shape = SHAPES[shape_name]
    tok, images = tiny_vl.build_processor(arch=arch)
    images.size = {"shortest_edge": 56 * 56, "longest_edge": IMAGE_PIXELS * IMAGE_PIXELS}   # 448 x 448 kept whole
    shape = {"text": {}, "vision": {}} if tiny else shape
    config = tiny_vl.vl_config(tok, arch, text={"vocab_size": 151936, **shape["text"]}, vision=shape["vision"],
                               dtype="bfloat16")
    model_class = (transformers.Qwen3VLForConditionalGeneration if arch == "qwen3-vl"
                   else transformers.Qwen2_5_VLForConditionalGeneration)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_class(config).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    images.save_pretrained(out)
    try:       # vLLM loads the whole processor, whose video half needs torchvision (the GPU image has it)
        processor = transformers.AutoProcessor.from_pretrained(out)
    except ImportError as exc:
        return model, tok, images, f"none: {exc}"[:80]
    processor.save_pretrained(out)
    return model, tok, images, type(processor).__name__


def noise_png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_PIXELS, IMAGE_PIXELS, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def gpu_used_gb() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return round(float(out[0]) / 1024, 2) if out else float("nan")


def write_job(args) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from grpo_rollout import tiny_vl
    from h200_bench import job_dict, workload
    out = Path(args.workdir)
    started = time.monotonic()
    build_model(out / "model", args.tiny, args.shape)
    colours = sorted(tiny_vl.COLOURS)
    rows = [{"data_source": tiny_vl.DATA_SOURCE, "prompt": [{"role": "user", "content": tiny_vl.QUESTION}],
             "images": [{"bytes": tiny_vl.colour_png(colours[i % 4], size=IMAGE_PIXELS), "path": None}],
             "ability": "vision", "reward_model": {"style": "rule", "ground_truth": colours[i % 4]},
             "extra_info": {"index": i}} for i in range(workload(args)["prompts"] * 4)]
    pq.write_table(pa.Table.from_pylist(rows), out / "train.parquet")
    job = job_dict(args, out / "model", out / "train.parquet", out / "run")
    job["spec"]["data"].update(imageKey="images", maxPromptLength=512)
    job["spec"]["trainer"]["maxTokensPerGPU"] = max(job["spec"]["trainer"]["maxTokensPerGPU"], 1024)
    (out / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    bench_common.emit(args, "vl_vllm", phase="write-job", seconds=round(time.monotonic() - started, 1))
    return 0


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--write-job", action="store_true")
    ap.add_argument("--shape", choices=SHAPES, default="qwen2.5-vl-3b", help="the random model's shape")
    args = ap.parse_args(argv)
    if args.write_job:
        return write_job(args)

    import torch

    from grpo_rollout.engine import SamplingParams
    from grpo_rollout.vllm_engine import VLLMEngine
    from grpo_trainer import vision

    def emit(row):
        bench_common.emit(args, "vl_vllm", **row)

    out = Path(args.workdir) / "vl-model"
    started = time.monotonic()
    model, tok, image_processor, processor_class = build_model(out, args.tiny, args.shape)
    emit({"phase": "build", "seconds": round(time.monotonic() - started, 1), "processor": processor_class,
          "parameters": sum(p.numel() for p in model.parameters())})

    image_id, merge = model.config.image_token_id, model.config.vision_config.spatial_merge_size
    pngs = [noise_png(i) for i in range(args.prompts)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the image"}]}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = rendered if isinstance(rendered, list) else list(rendered["input_ids"])
    prompts = [vision.expand_image_tokens(rendered, image_id, vision.pixel_inputs(image_processor, [png]).rows_grid_thw,
                                          merge) for png in pngs]
    word = tok.convert_tokens_to_ids("image")
    text_only = [[word if t == image_id else t for t in p] for p in prompts]     # same length, no image

    started = time.monotonic()
    engine = VLLMEngine(str(out), dtype="bfloat16", seed=0, gpu_memory_utilization=0.5, max_model_len=2048)
    emit({"phase": "engine-start", "seconds": round(time.monotonic() - started, 1),
          "accepts_images": engine.accepts_images, "gpu_used_gb": gpu_used_gb()})

    # 1. The vision tower changed in both models, then log-probs of vLLM's samples against the
    # transformers forward with the right images and with the images shifted by one row.
    with torch.no_grad():
        changed = []
        for name, p in model.named_parameters():
            if ".visual." in f".{name}" and p.dim() >= 1:
                p.mul_(1.5).add_(torch.randn_like(p) * 0.02)
                changed.append((name, p.detach().to("cpu")))
    started = time.monotonic()
    engine.load_weights(changed)
    emit({"phase": "load-vision-weights", "tensors": len(changed), "seconds": round(time.monotonic() - started, 2)})
    k = 8
    groups = engine.generate(prompts[:k], SamplingParams(n=1, max_tokens=16, temperature=1.0, logprobs=True),
                             images=[[png] for png in pngs[:k]])

    def reference(image_rows):
        diffs = []
        for prompt, group, row in zip(prompts[:k], groups, image_rows):
            response = group[0].token_ids
            ids = torch.tensor([prompt + response], device="cuda")
            mask = torch.ones_like(ids)
            pixels = vision.pixel_inputs(image_processor, row).to("cuda")
            pixels.pixel_values = pixels.pixel_values.to(torch.bfloat16)
            with torch.no_grad(), vision.forward_inputs(model, ids, mask, pixels) as extra:
                logits = model(input_ids=ids, attention_mask=mask, **extra).logits.float()
            logp = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            diffs.append((logp.cpu() - torch.tensor(group[0].logprobs)).abs())
        return float(torch.cat(diffs).mean())

    right = reference([[png] for png in pngs[:k]])
    shifted = reference([[pngs[(i + 1) % k]] for i in range(k)])
    emit({"phase": "logprobs", "mean_abs_right_images": round(right, 4), "mean_abs_shifted_images": round(shifted, 4),
          "agree": right < 0.5 * shifted})
    model = None            # the reference forward is done: its GPU memory goes back
    torch.cuda.empty_cache()

    # 2. Cost: with images against text-only prompts of the same length.
    params = SamplingParams(n=4, max_tokens=256, temperature=1.0, logprobs=False)
    engine.generate(prompts[:4], params, images=[[png] for png in pngs[:4]])        # warm-up
    for label, kwargs, batch in (("images", {"images": [[png] for png in pngs]}, prompts), ("text-only", {}, text_only)):
        torch.cuda.synchronize()
        started = time.monotonic()
        groups = engine.generate(batch, params, **kwargs)
        seconds = time.monotonic() - started
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        emit({"phase": f"generate-{label}", "prompts": len(batch), "n": params.n, "prompt_tokens": len(batch[0]),
              "image_tokens": sum(t == image_id for t in batch[0]), "generated_tokens": tokens,
              "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds), "gpu_used_gb": gpu_used_gb()})
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
