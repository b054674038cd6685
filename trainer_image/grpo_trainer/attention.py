"""Attention of packed micro-batches on GPU (model.useRemovePadding): each sample attends to
itself alone through flash attention's varlen kernel (`torch.nn.attention.varlen.varlen_attn`),
where sdpa would compute the whole row against itself under a block-diagonal mask.

`VARLEN` is a transformers attention implementation: a forward given the samples' boundaries
(`cu_seq_lens_q` and `max_length_q`, the flash-attention kwargs transformers passes down to
every attention layer) runs varlen_attn; any other forward (padded rows) is sdpa, mask and all.
On CPU, in float32, or with a torch without the varlen kernel, models keep sdpa, which honours
the packed positions through its block-diagonal mask (transformers' masking_utils): the same
numbers, at the cost of the whole row's attention.

Shared prompts (model.sharePrompts, `batch.Packed.key_index`): the layers run on a row that
holds each prompt once, followed by its responses. Its queries are attention's queries as they
are: a prompt's first sample takes the prompt and its response, each other sample its response
alone. Each sample's keys and values, its prompt's and its own, are gathered into a row of their
own (`key_index`), and the causal mask is aligned to the ends (a sample's last query sees all its
keys), which is flash attention's rule where a sequence has fewer queries than keys. Only the
keys and values are copied: a few percent of the step's FLOPs at these lengths, where the
projections, MLP and head would have run on every copy of the prompt. Where varlen_attn is
missing (CPU, float32), VARLEN runs sdpa sample by sample (`_per_sample`) for this row.
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
    cu_k = kwargs.get("cu_seq_lens_k", cu)
    max_q = kwargs["max_length_q"]
    max_k = kwargs.get("max_length_k", max_q)
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    # [1, heads, n, d] -> [n, heads, d]: a view
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    key_index = kwargs.get("grpo_key_index")
    if key_index is not None:      # shared prompts: each sample's keys and values, its prompt's then its own
        k, v = k[key_index], v[key_index]
    if varlen_available(query.device) and query.dtype in (torch.bfloat16, torch.float16):
        out = _varlen(q, k, v, cu, cu_k, max_q, max_k, causal, scaling)
    else:
        out = _per_sample(q, k, v, cu, cu_k, causal, scaling)
    return out.unsqueeze(0), None   # [1, n, heads, d], as transformers' return


def _per_sample(q, k, v, cu_q, cu_k, causal: bool, scaling: float | None) -> torch.Tensor:
    """The reference of `_varlen`: sdpa on each sample alone, the causal mask aligned to the ends
    where a sample has fewer queries than keys. [n_q, heads, d] -> [n_q, heads, d]."""
    outs = []
    for (a, b), (c, d) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]), zip(cu_k.tolist(), cu_k.tolist()[1:])):
        mask = torch.ones(b - a, d - c, dtype=torch.bool, device=q.device).tril(d - c - (b - a)) if causal else None
        outs.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                   v[c:d].transpose(0, 1), attn_mask=mask, scale=scaling,
                                                   enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(outs, dim=1).transpose(0, 1)


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scaling: float | None) -> torch.Tensor:
    """[n_q, heads, d] -> [n_q, heads, d]; causal: aligned to each sample's last query and key"""
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
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options)


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
    """What a forward of `model` on a packed row (batch.Packed) passes down to VARLEN
    (`packed_kwargs`); nothing for other attention implementations."""
    if getattr(model.config, "_attn_implementation", None) != VARLEN:
        if packed.key_index is not None:
            raise RuntimeError("a row of shared prompts needs the model built with model.sharePrompts")
        return {}
    return packed_kwargs(packed)


def packed_kwargs(packed) -> dict:
    """VARLEN's keywords for a packed row: the samples' boundaries (int32 [samples + 1]) and the
    longest, a shared row's keys' too."""
    if packed.key_index is None:
        return {"cu_seq_lens_q": packed.cu_seqlens, "cu_seq_lens_k": packed.cu_seqlens,
                "max_length_q": packed.max_length, "max_length_k": packed.max_length}
    return {"cu_seq_lens_q": packed.cu_seqlens_q, "cu_seq_lens_k": packed.cu_seqlens_k,
            "max_length_q": packed.max_length_q, "max_length_k": packed.max_length, "grpo_key_index": packed.key_index}
