"""Attention of packed micro-batches on GPU (model.useRemovePadding): each sample attends to
itself alone through flash attention's varlen kernel (`torch.nn.attention.varlen.varlen_attn`),
where sdpa would compute the whole row against itself under a block-diagonal mask.

`VARLEN` is a transformers attention implementation: a forward given the samples' boundaries
(`cu_seq_lens_q` and `max_length_q`, the flash-attention kwargs transformers passes down to
every attention layer) runs varlen_attn; any other forward (padded rows) is sdpa, mask and all.
On CPU, in float32, or with a torch without the varlen kernel, models keep sdpa, which honours
the packed positions through its block-diagonal mask (transformers' masking_utils): the same
numbers, at the cost of the whole row's attention.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch

VARLEN = "grpo_varlen"
# The same kernel for a vision tower, whose attention is not causal. "flash" in the name is what
# makes transformers' Qwen VL towers pass each image's (or window's) boundaries as `cu_seqlens`;
# under any other name they run one sdpa call per window of every image.
VISION_VARLEN = "grpo_flash_varlen_vision"


def varlen_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    varlen_attn, params = _varlen_attn()
    # [1, heads, n, d] -> [n, heads, d]: usually a view already (no copy)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    # The function's keywords changed across torch releases: causal is is_causal=True (2.9) or
    # window_size=(-1, 0) (later); grouped-query heads need enable_gqa where it exists (flash
    # itself takes fewer key/value heads); without `scale` it is flash's 1/sqrt(d), Qwen's.
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if "window_size" in params:
        options = {"window_size": (-1, 0) if causal else (-1, -1)}
    else:
        options = {"is_causal": causal}
    if "scale" in params:
        options["scale"] = scaling
    elif scaling is not None and not math.isclose(scaling, q.shape[-1] ** -0.5):
        raise RuntimeError(f"varlen attention without a scale argument can't apply the model's {scaling}")
    if "enable_gqa" in params:
        options["enable_gqa"] = q.shape[1] != k.shape[1]
    n = kwargs["max_length_q"]
    out = varlen_attn(q, k, v, cu, cu, n, n, **options)
    return out.unsqueeze(0), None      # [1, n, heads, d], as transformers' attention functions return


@functools.cache
def _varlen_attn():
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def attn_implementation(device: torch.device, packed: bool, dtype: torch.dtype) -> str:
    """The model's attention: VARLEN (registered with transformers here) for packed rows on a GPU
    with the kernel, computing in bf16 or fp16 (flash attention's), else sdpa."""
    if not (packed and varlen_available(device) and dtype in (torch.bfloat16, torch.float16)):
        return "sdpa"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(VARLEN, _attention)
    AttentionMaskInterface.register(VARLEN, sdpa_mask)
    return VARLEN


def vision_attn_implementation(device: torch.device, dtype: torch.dtype) -> str | None:
    """VISION_VARLEN (registered here) where the kernel runs (a GPU, bf16 or fp16), else None."""
    if not (varlen_available(device) and dtype in (torch.bfloat16, torch.float16)):
        return None
    from transformers import AttentionInterface
    AttentionInterface.register(VISION_VARLEN, _attention)
    return VISION_VARLEN


def varlen_kwargs(model, cu_seqlens: torch.Tensor, max_length: int) -> dict:
    """What a forward of `model` on a packed row passes down to VARLEN: the samples' boundaries
    (int32 [samples + 1]) and the longest; nothing for other attention implementations."""
    if getattr(model.config, "_attn_implementation", None) != VARLEN:
        return {}
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_length,
            "max_length_k": max_length}
