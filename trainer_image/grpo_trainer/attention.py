"""Attention of packed micro-batches on GPU (model.useRemovePadding): each sample attends to
itself alone through flash attention's varlen kernel (`torch.nn.attention.varlen.varlen_attn`),
where sdpa would compute the whole row against itself under a block-diagonal mask.

`VARLEN` is a transformers attention implementation: a forward given the samples' boundaries
(`cu_seq_lens_q` and `max_length_q`, the flash-attention kwargs transformers passes down to
every attention layer) runs varlen_attn; any other forward (padded rows) is sdpa, mask and all.
On CPU, in float32, or with a torch without the varlen kernel, models keep sdpa, which honours
the packed positions through its block-diagonal mask (transformers' masking_utils): the same
numbers, at the cost of the whole row's attention.

Shared prompts (model.sharePrompts, `batch.Packed.expand`): the layers run on a row that holds
each prompt once, but attention runs on the full row: queries, keys and values are copied out
to it (`expand`), each sample attends to itself as above, and each shared position keeps its
first copy's output (`first`). Attention is a few percent of the FLOPs at these lengths; the
rest (projections, MLP, head) is what the prompt's copies would have cost. On CPU or in float32,
where varlen_attn is missing, VARLEN runs sdpa sample by sample (`_per_sample`) for this row.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch
import torch.nn.functional as F

VARLEN = "grpo_varlen"
# The same kernel for a vision tower, whose attention is not causal. "flash" in the name is what
# makes transformers' Qwen VL towers pass each image's (or window's) boundaries as `cu_seqlens`;
# under any other name they run one sdpa call per window of every image.
VISION_VARLEN = "grpo_flash_varlen_vision"


_HAS_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None   # a constant for torch.compile


def varlen_available(device: torch.device) -> bool:
    return device.type == "cuda" and _HAS_VARLEN


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    expand, first = kwargs.get("grpo_expand"), kwargs.get("grpo_first")
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    # [1, heads, n, d] -> [n, heads, d]: a view; a shared row's are copied out to the full row by
    # `expand`, in this layout already, so that flash attention's input needs no second copy
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if expand is not None:
        q, k, v = q[expand], k[expand], v[expand]
    if varlen_available(query.device) and query.dtype in (torch.bfloat16, torch.float16):
        out = _varlen(q, k, v, cu, kwargs["max_length_q"], causal, scaling)
    else:
        out = _per_sample(q, k, v, cu, causal, scaling)
    return (out[first] if first is not None else out).unsqueeze(0), None   # [1, n, heads, d], as transformers' return


def _per_sample(q, k, v, cu, causal: bool, scaling: float | None) -> torch.Tensor:
    """The reference of `_varlen`: sdpa on each sample's span alone. [n, heads, d] -> [n, heads, d]."""
    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=causal,
                                           scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1).transpose(0, 1)


def _varlen(q, k, v, cu, max_length: int, causal: bool, scaling: float | None) -> torch.Tensor:
    """[n, heads, d] -> [n, heads, d]"""
    varlen_attn, params = _varlen_attn()
    q, k, v = (t.contiguous() for t in (q, k, v))   # no copy where they are laid out [n, heads, d] already
    # The function's keywords changed across torch releases: causal is is_causal=True (2.9) or
    # window_size=(-1, 0) (later); grouped-query heads need enable_gqa where it exists (flash
    # itself takes fewer key/value heads); without `scale` it is flash's 1/sqrt(d), Qwen's.
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
    return varlen_attn(q, k, v, cu, cu, max_length, max_length, **options)


@functools.cache
def _varlen_attn():
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def attn_implementation(device: torch.device, packed: bool, dtype: torch.dtype, shared: bool = False) -> str:
    """The model's attention: VARLEN (registered with transformers here) for packed rows on a GPU
    with the kernel, computing in bf16 or fp16 (flash attention's), and for shared prompts
    anywhere; else sdpa."""
    if not (shared or packed and varlen_available(device) and dtype in (torch.bfloat16, torch.float16)):
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


def varlen_kwargs(model, packed) -> dict:
    """What a forward of `model` on a packed row (batch.Packed) passes down to VARLEN: the
    samples' boundaries (int32 [samples + 1]), the longest, and a shared row's maps; nothing for
    other attention implementations."""
    if getattr(model.config, "_attn_implementation", None) != VARLEN:
        if packed.expand is not None:
            raise RuntimeError("a row of shared prompts needs the model built with model.sharePrompts")
        return {}
    shared = {} if packed.expand is None else {"grpo_expand": packed.expand, "grpo_first": packed.first}
    return {"cu_seq_lens_q": packed.cu_seqlens, "cu_seq_lens_k": packed.cu_seqlens, "max_length_q": packed.max_length,
            "max_length_k": packed.max_length, **shared}
