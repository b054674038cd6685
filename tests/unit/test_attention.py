"""VARLEN on a row of shared prompts (model.sharePrompts) against attention on each sample's own
full sequence, in float64: the CPU path (`_per_sample`) that stands for flash attention's varlen
kernel. The GPU's kernel is checked against the same reference by bench/h200_bench.py
(`train --layouts shared`: its `shared-attention-vs-reference` number)."""

import torch
import torch.nn.functional as F

from grpo_trainer.attention import _attention, packed_kwargs
from grpo_trainer.batch import Sample, collate


class _Layer:
    is_causal = True


def _samples():
    """Two groups, one of three samples (one response a single token) and one of one."""
    return [Sample("0-0", 0, 0, [11, 12, 13], [21, 22], None, 1.0, "stop"),
            Sample("0-1", 1, 0, [14, 15], [23, 24, 25, 26], None, 0.0, "stop"),
            Sample("0-0", 0, 1, [11, 12, 13], [27], None, 0.0, "length"),
            Sample("0-0", 0, 2, [11, 12, 13], [28, 29, 30], None, 0.0, "stop")]


def test_shared_row_attention_is_each_samples_own_causal_attention():
    packed = collate(list(range(4)), _samples(), None, pad_id=0, device=torch.device("cpu"), share_prompts=True).packed
    torch.manual_seed(0)
    heads, kv_heads, dim, m = 4, 2, 8, packed.input_ids.shape[1]
    q, k, v = (torch.randn(1, h, m, dim, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    out, _ = _attention(_Layer(), q, k, v, None, scaling=dim ** -0.5, **packed_kwargs(packed))
    assert out.shape == (1, m, heads, dim)
    # The reference: each sample's full sequence (its prompt's copy, then its response) alone; a
    # prompt's positions see the prompt only, so any sample of the group gives their output
    bounds = packed.cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        positions = packed.expand[a:b]
        expected = F.scaled_dot_product_attention(q[:, :, positions], k[:, :, positions], v[:, :, positions],
                                                  is_causal=True, enable_gqa=True).transpose(1, 2)[0]
        assert torch.allclose(out[0, positions], expected, atol=1e-12), (a, b)
    # Control: the mask aligned to the first query instead (sdpa's is_causal with fewer queries
    # than keys) gives the second sample of the first group other outputs
    a, b = packed.cu_seqlens_q[1:3].tolist()
    c, d = packed.cu_seqlens_k[1:3].tolist()
    keys = packed.key_index[c:d]
    misaligned = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, keys], v[:, :, keys], is_causal=True,
                                                enable_gqa=True).transpose(1, 2)[0]
    assert b - a < d - c and (misaligned - out[0, a:b]).abs().max() > 1e-3
