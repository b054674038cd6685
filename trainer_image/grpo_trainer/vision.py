"""Vision-language policies (issue 45): what a Qwen2.5-VL or Qwen3-VL forward needs beyond the token ids.

A VL model's prompt holds one image token per merged patch of each image (the image processor's
`image_grid_thw`, t x h x w patches, merged `spatial_merge_size`^2 to a token); its forward takes
the images' `pixel_values` and grids, and Qwen's multimodal rotary positions (mrope: a temporal,
height and width position per token, [3, b, L], from the model's own `get_rope_index`, which
Qwen2.5-VL and Qwen3-VL each define; Qwen3-VL also adds vision features to its first decoder
layers (DeepStack), inside its forward). transformers computes the positions itself
when none are given, but it caches the last batch's offsets on the model (`rope_deltas`) for
generation; the trainer computes them for every micro-batch from its own ids and mask
(`position_ids`), so nothing carries over between forwards.

Packing (model.useRemovePadding) does not apply yet: packed rows would need the mrope positions
of every sample laid end to end with the text positions first; VL micro-batches stay padded
(Actor says so once). The fused LM head applies unchanged (the same `lm_head` linear layer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from grpo_api.images import open_image


def is_vision_language(config) -> bool:
    """A config with a vision tower (Qwen2.5-VL, Qwen2-VL, Qwen3-VL ...)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config):
    """The transformers Auto class that loads this config's generating model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_image_processor(spec):
    """The image processor of spec.model (its tokenizerPath's folder, else its path)."""
    from transformers import AutoImageProcessor
    path = spec.tokenizer_path or spec.path
    try:
        return AutoImageProcessor.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
    except OSError as exc:
        raise FileNotFoundError(f"spec.model.path: a vision-language model needs its image processor "
                                f"(preprocessor_config.json) in {path!r}: {exc}") from None


def _core(model):
    if hasattr(model, "get_base_model"):     # a PEFT (LoRA) wrapper
        model = model.get_base_model()
    return model.model                        # Qwen2_5_VLModel, Qwen3VLModel: .visual, .language_model


def decoder_layers(model) -> list[torch.nn.Module] | None:
    """The language model's decoder layers and the vision tower's blocks (FSDP2 shards each), or
    None for a model that is not VL."""
    if not is_vision_language(model.config):
        return None
    core = _core(model)
    return [*core.language_model.layers, *core.visual.blocks]


def vision_blocks(model) -> list[torch.nn.Module]:
    """The vision tower's blocks; none for a model that is not VL."""
    if not is_vision_language(getattr(model, "config", None)):
        return []
    return list(_core(model).visual.blocks)


def set_vision_attention(model, implementation: str) -> None:
    """The vision tower's attention implementation (the language model keeps its own)."""
    for config in {id(m.config): m.config for m in _core(model).visual.modules() if hasattr(m, "config")}.values():
        config._attn_implementation = implementation


def freeze_vision_tower(model) -> int:
    """requires_grad off for the vision tower (verl: actor.freeze_vision_tower); its parameter count."""
    visual = _core(model).visual
    visual.requires_grad_(False)
    return sum(p.numel() for p in visual.parameters())


@dataclass
class PixelInputs:
    """The images of a micro-batch's rows: each distinct image once (a GRPO group's samples share
    their prompt's), and which of them each image of the rows is, in row order."""
    pixel_values: torch.Tensor      # [patches of the distinct images, channels x temporal x patch x patch]
    image_grid_thw: torch.Tensor    # [distinct images, 3]
    shown: torch.Tensor             # [images of the rows]: an index into the distinct images

    def to(self, device: torch.device) -> "PixelInputs":
        return PixelInputs(self.pixel_values.to(device), self.image_grid_thw.to(device), self.shown.to(device))

    @property
    def rows_grid_thw(self) -> torch.Tensor:
        """[images of the rows, 3]: the grids in the order the rows' image tokens run."""
        return self.image_grid_thw[self.shown]


def pixel_inputs(image_processor, images: list[bytes]) -> PixelInputs | None:
    """The processor's pixel values and grids of encoded `images`, each distinct one once (None
    for none)."""
    if not images:
        return None
    distinct = {b: None for b in images}     # insertion-ordered
    order = {b: i for i, b in enumerate(distinct)}
    out = image_processor(images=[open_image(b) for b in distinct], return_tensors="pt")
    return PixelInputs(out["pixel_values"], out["image_grid_thw"], torch.tensor([order[b] for b in images]))


def mrope_position_ids(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """[3, b, L] mrope positions of padded rows (padding reads 0), as the model's get_rope_index."""
    core = _core(model)
    token_types = (input_ids == model.config.image_token_id).int()
    positions, _ = core.get_rope_index(input_ids, mm_token_type_ids=token_types, image_grid_thw=image_grid_thw,
                                       attention_mask=attention_mask)
    return positions


@contextlib.contextmanager
def forward_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixels: PixelInputs | None):
    """What a VL forward inside the block takes beside the ids and mask: the images and the mrope
    positions (nothing for a model that is not VL). Inside, the vision tower encodes each distinct
    image once and its features fill every row that shows it: a group's n samples share their
    prompt's image, which would otherwise pass through the tower n times in each forward and
    backward (the gradient of the shared features sums over the rows, as the index's backward does)."""
    if not is_vision_language(model.config):
        yield {}
        return
    grid = None if pixels is None else pixels.rows_grid_thw
    merge = model.config.vision_config.spatial_merge_size ** 2
    expected = 0 if grid is None else int((grid.prod(-1) // merge).sum())
    found = int((input_ids == model.config.image_token_id).sum())
    if found != expected:     # e.g. samples read without their images: the model would see placeholders
        raise ValueError(f"a micro-batch's prompts hold {found} image tokens, its images make {expected}")
    kwargs = {"position_ids": mrope_position_ids(model, input_ids, attention_mask, grid)}
    if pixels is None:
        yield kwargs
        return
    # The model asks the tower for the rows' images (grids in row order); the tower encodes the
    # distinct ones and hands back their merged features (and Qwen3-VL's DeepStack features) per row.
    visual = _core(model).visual
    encode, own = visual.forward, visual.__dict__.get("forward")
    tokens = pixels.image_grid_thw.prod(-1) // merge
    starts = tokens.cumsum(0) - tokens
    rows = torch.cat([torch.arange(int(starts[i]), int(starts[i] + tokens[i])) for i in pixels.shown.tolist()])
    rows = rows.to(pixels.pixel_values.device)

    def encode_distinct(hidden_states, grid_thw=None, **kw):
        return _select_tokens(encode(hidden_states, grid_thw=pixels.image_grid_thw, **kw), rows)
    visual.forward = encode_distinct
    try:
        yield kwargs | {"pixel_values": pixels.pixel_values, "image_grid_thw": grid}
    finally:
        if own is None:
            del visual.forward      # the class's forward again
        else:
            visual.forward = own


def _select_tokens(out, rows: torch.Tensor):
    """The vision tower's merged features (a tensor, or the pooler and DeepStack features of its
    output) taken at `rows`; the patch-level hidden states are left as they are (unused)."""
    if isinstance(out, torch.Tensor):
        return out.index_select(0, rows)
    if isinstance(out, (tuple, list)):
        return type(out)(_select_tokens(o, rows) for o in out)
    out.pooler_output = _select_tokens(out.pooler_output, rows)
    if getattr(out, "deepstack_features", None) is not None:
        out.deepstack_features = _select_tokens(out.deepstack_features, rows)
    return out


def image_parts(messages: list[dict], n_images: int) -> list[dict]:
    """verl's `<image>` placeholders made chat-template parts: a message whose content holds
    them becomes [{type: image}, {type: text, text}...] in order (verl's RLHFDataset). Every
    image needs its placeholder, and every placeholder an image."""
    out, seen = [], 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or "<image>" not in content:
            out.append(message)
            continue
        parts = []
        for i, text in enumerate(content.split("<image>")):
            if i:
                parts.append({"type": "image"})
                seen += 1
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**message, "content": parts})
    if seen != n_images:
        raise ValueError(f"{seen} <image> placeholder(s) in the prompt for {n_images} image(s)")
    return out


def expand_image_tokens(ids: list[int], image_token_id: int, grids: torch.Tensor, merge_size: int) -> list[int]:
    """Each image's one placeholder token repeated to the image's token count (t x h x w patches
    / merge_size^2), as the model's processor does on the rendered text."""
    counts = (grids.prod(-1) // merge_size ** 2).tolist()
    out, k = [], 0
    for token in ids:
        if token == image_token_id:
            if k >= len(counts):
                raise ValueError(f"the chat template rendered more image tokens than the {len(counts)} image(s)")
            out.extend([token] * counts[k])
            k += 1
        else:
            out.append(token)
    if k != len(counts):
        raise ValueError(f"the chat template rendered {k} image token(s) for {len(counts)} image(s)")
    return out
