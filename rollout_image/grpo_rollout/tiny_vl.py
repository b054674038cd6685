"""A tiny random-weight Qwen2.5-VL or Qwen3-VL and an image task it can learn (issue 45's CPU slice).

`build_tiny_vl_model` writes a Qwen2_5_VLForConditionalGeneration or a
Qwen3VLForConditionalGeneration from a transformers config (a small vision tower, two decoder
layers), a word-level tokenizer built locally with Qwen's vision tokens, and a processor folder
(image processor and chat template), all loadable offline with AutoModelForImageTextToText /
AutoProcessor. Nothing is downloaded. The two differ where the real models do: Qwen3-VL's
16-pixel patches, learned vision position embeddings, DeepStack (vision features added to the
first decoder layers) and interleaved mrope with its own image positions (`get_rope_index`).

The task (`write_colour_dataset`, `grpo data colours`): each prompt is `<image> what colour is
the image` with one solid-colour PNG in verl's `images` column (a list of {bytes, path}, as
verl's geo3k preprocessing writes it); the answer is the colour's name, scored by
`grpo_rollout.rewards.colours` (1 when the response's first word is the colour). The text is
the same for every row, so only a model that reads the image beats chance (1 in 4).

torch/transformers/PIL are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

from grpo_rollout import tiny

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 220), "yellow": (230, 220, 40)}
DATA_SOURCE = "grpo/colours"
QUESTION = "<image> what colour is the image"
WORDS = ["system", "user", "assistant", "what", "colour", "is", "the", "image", *COLOURS]
IMAGE_SIZE = 56     # 4 x 4 patches of 14 pixels (Qwen3-VL: resized to 64, 4 x 4 of 16): 4 image tokens after the 2 x 2 merge

# Qwen2-VL's ChatML: a message's content is a string or a list of {type: image|text} parts; an
# image part becomes <|vision_start|><|image_pad|><|vision_end|>, which the processor widens to
# the image's token count.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
DEFAULT_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      fullatt_block_indexes=[0], window_size=56, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)
# Qwen3-VL: head_dim 16, so mrope_section sums to 8 and is interleaved (T H W T H W T T), the
# real 128-dim [24, 20, 20] pattern in small; a 4 x 4 grid of learned vision positions; DeepStack
# from the first of two vision blocks into the first decoder layer.
QWEN3_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                  num_key_value_heads=2, max_position_embeddings=512,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                   "mrope_interleaved": True})
QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                    deepstack_visual_indexes=[0])
ARCHS = ("qwen2.5-vl", "qwen3-vl")


def build_processor(words: list[str] | None = None, arch: str = "qwen2.5-vl"):
    """(tokenizer, image processor): the word-level tokenizer with the vision tokens as specials
    and the chat template above, Qwen's image processor bounded to small images (Qwen3-VL's:
    16-pixel patches, mean and std 0.5, as its checkpoints' preprocessor_config.json). Saved side
    by side they are a Qwen2.5-VL / Qwen3-VL processor folder (their processor classes need
    torchvision, for the video processor, which the images don't have)."""
    from tokenizers import AddedToken
    from transformers import Qwen2VLImageProcessor

    tokenizer = tiny.build_tokenizer(words or WORDS)
    tokenizer.add_special_tokens({"additional_special_tokens": [tiny.IM_START, *VISION_TOKENS]})
    tokenizer.add_tokens([AddedToken(t, special=True) for t in VISION_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    pixels = IMAGE_SIZE * IMAGE_SIZE
    size = {"shortest_edge": pixels, "longest_edge": 4 * pixels}
    if arch == "qwen3-vl":
        images = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, size=size,
                                       image_mean=[0.5] * 3, image_std=[0.5] * 3)
    else:
        images = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, size=size)
    return tokenizer, images


def vl_config(tok, arch: str = "qwen2.5-vl", text: dict | None = None, vision: dict | None = None,
              dtype: str = "float32"):
    """The config of a Qwen2.5-VL / Qwen3-VL around `tok`'s vision and special tokens: the tiny
    sizes above, or those `text` and `vision` override (a real shape, its vocab_size too)."""
    import transformers
    if arch not in ARCHS:
        raise ValueError(f"arch: {arch!r} is not a tiny VL architecture (known: {', '.join(ARCHS)})")
    qwen3 = arch == "qwen3-vl"
    ids = tok.convert_tokens_to_ids
    specials = dict(pad_token_id=ids(tiny.PAD), eos_token_id=ids(tiny.IM_END), bos_token_id=None)
    text = {**(QWEN3_TEXT if qwen3 else DEFAULT_TEXT), "vocab_size": len(tok), **(text or {}), **specials}
    return (transformers.Qwen3VLConfig if qwen3 else transformers.Qwen2_5_VLConfig)(
        text_config=text, vision_config={**(QWEN3_VISION if qwen3 else DEFAULT_VISION), **(vision or {})},
        image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD), vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END), tie_word_embeddings=text.get("tie_word_embeddings", False), dtype=dtype,
        **specials)


def build_tiny_vl_model(out_dir: str | Path, seed: int = 0, text: dict | None = None,
                        vision: dict | None = None, arch: str = "qwen2.5-vl", head_scale: float = 1.0) -> Path:
    """Write a random-init `arch` (qwen2.5-vl or qwen3-vl), its tokenizer and processor to `out_dir`.

    `head_scale` multiplies the LM head's random weights. A trained head's logits span tens; the
    random one's (std 0.02 on 64 dims) span about one, and a policy that cannot change its head
    (LoRA: the head and the final norm stay frozen) then cannot give any word more than ~0.2 of
    the probability on this vocabulary, whatever it learns. 5 gives LoRA the range to learn in."""
    import torch
    import transformers
    from transformers import GenerationConfig

    tok, images = build_processor(arch=arch)
    config = vl_config(tok, arch, text, vision)
    model_cls = (transformers.Qwen3VLForConditionalGeneration if arch == "qwen3-vl"
                 else transformers.Qwen2_5_VLForConditionalGeneration)
    specials = dict(pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id, bos_token_id=None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        model.lm_head.weight.data.mul_(head_scale)
    model.generation_config = GenerationConfig(**specials, do_sample=True, temperature=1.0, top_p=1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    images.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"      # as tiny.py: the 4.x class name loads in both
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    for f in out.iterdir():
        f.chmod(f.stat().st_mode | 0o044)
    return out


def colour_png(colour: str, size: int = IMAGE_SIZE) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (size, size), COLOURS[colour]).save(buf, format="PNG")
    return buf.getvalue()


def make_rows(n: int, split: str, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    pngs = {c: colour_png(c) for c in COLOURS}
    rows = []
    for i in range(n):
        colour = rng.choice(sorted(COLOURS))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": QUESTION}],
            "images": [{"bytes": pngs[colour], "path": None}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": colour},
            "extra_info": {"split": split, "index": i},
        })
    return rows


def write_colour_dataset(out_dir: str | Path, n_train: int = 512, n_val: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """`train.parquet` and `test.parquet` under `out_dir` in verl's image layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, split, n in (("train.parquet", "train", n_train), ("test.parquet", "test", n_val)):
        path = out / name
        table = pa.Table.from_pylist(make_rows(n, split, seed))
        image_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))   # as Hugging Face writes it
        table = table.set_column(table.schema.get_field_index("images"), "images", table["images"].cast(image_type))
        pq.write_table(table, path)
        paths.append(path)
    return paths[0], paths[1]
