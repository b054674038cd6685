"""Chunked logprobs/entropy of grpo_trainer.algorithms: exact, differentiable, and never a full float32 copy."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_trainer.algorithms import (entropy_from_logits, fused_linear_logprobs,
                                     logprobs_from_logits)


def plain_logprobs(logits, labels):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def plain_entropy(logits):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _inputs(dtype=torch.float32, shape=(3, 7), vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(*shape, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    return logits, labels


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 21, 1000])  # 21 = every token; 5 leaves a remainder
def test_logprobs_equal_the_plain_float32_computation(chunk_size):
    logits, labels = _inputs()
    out = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    assert out.shape == labels.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, plain_logprobs(logits, labels), rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 1000])
def test_entropy_equals_the_plain_float32_computation(chunk_size):
    logits, _ = _inputs()
    out = entropy_from_logits(logits, chunk_size=chunk_size)
    assert out.shape == logits.shape[:-1] and out.dtype == torch.float32
    torch.testing.assert_close(out, plain_entropy(logits), rtol=1e-6, atol=1e-6)


def test_bfloat16_logits_are_upcast_like_the_plain_computation():
    logits, labels = _inputs(torch.bfloat16)
    torch.testing.assert_close(logprobs_from_logits(logits, labels, 4), plain_logprobs(logits, labels),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy_from_logits(logits, 4), plain_entropy(logits), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_autograd_through_the_plain_computation(dtype):
    logits, labels = _inputs(dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    upstream_lp, upstream_h = torch.randn(labels.shape, generator=gen), torch.randn(labels.shape, generator=gen)

    def grads(lp_fn, h_fn):
        x = logits.clone().requires_grad_()
        loss = (lp_fn(x) * upstream_lp).sum() + (h_fn(x) * upstream_h).sum()
        loss.backward()
        return x.grad

    ours = grads(lambda x: logprobs_from_logits(x, labels, 4), lambda x: entropy_from_logits(x, 4))
    ref = grads(lambda x: plain_logprobs(x, labels), plain_entropy)
    assert ours.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours, ref, **tol)


def test_gradcheck_in_float64():
    logits, labels = _inputs(torch.float64, shape=(2, 3), vocab=6)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels, chunk_size=4), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, chunk_size=4), (logits,))


class _LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_float32_tensor_larger_than_one_chunk_in_forward_or_backward():
    tokens, vocab, chunk = 64, 100, 8
    logits, labels = _inputs(torch.bfloat16, shape=(tokens,), vocab=vocab)
    logits.requires_grad_()
    with _LargestFloat32() as seen:
        loss = logprobs_from_logits(logits, labels, chunk).sum() + entropy_from_logits(logits, chunk).sum()
        loss.backward()
    assert seen.largest <= chunk * vocab
    assert logits.grad.dtype == torch.bfloat16
    # The check can fail: the plain computation makes a [tokens, vocab] float32 tensor.
    with _LargestFloat32() as plain:
        plain_logprobs(logits, labels).sum().backward()
    assert plain.largest == tokens * vocab


def test_labels_must_match_the_logits_positions():
    logits, labels = _inputs()
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(logits, labels[:, :-1])


def _head_inputs(n=23, hidden=6, vocab=40, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).to(dtype)
    w = (2 * torch.randn(vocab, hidden, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    return h, w, labels, torch.randn(n, generator=gen), torch.randn(n, generator=gen)   # a, b: loss weights


def _float64_reference(h, w, labels, temperature, a, b, *, grad_w=True):
    """Autograd in float64 through log_softmax(h @ w.T / T): values and gradients of sum(a logp + b H)."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_(grad_w)
    logp_all = torch.log_softmax(h64 @ w64.t() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (a.double() @ logp + b.double() @ entropy).backward()
    return logp, entropy, h64.grad, w64.grad


@pytest.mark.parametrize("chunk_size", [5, 1000])        # 5 leaves a remainder of 23 tokens
@pytest.mark.parametrize("grad_w", [True, False])         # False: a frozen head (LoRA, the reference)
def test_fused_head_logprobs_entropy_and_gradients_match_float64(chunk_size, grad_w):
    h, w, labels, a, b = _head_inputs()
    h.requires_grad_()
    w.requires_grad_(grad_w)
    logp, entropy = fused_linear_logprobs(h, w, labels, temperature=0.7, with_entropy=True, chunk_size=chunk_size)
    (a @ logp + b @ entropy).backward()
    ref_logp, ref_entropy, ref_gh, ref_gw = _float64_reference(h, w, labels, 0.7, a, b, grad_w=grad_w)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), ref_gh, rtol=1e-4, atol=1e-5)
    if grad_w:
        torch.testing.assert_close(w.grad.double(), ref_gw, rtol=1e-4, atol=1e-5)
    else:
        assert w.grad is None


def test_fused_head_without_entropy_or_with_it_detached_gives_the_logprob_gradient():
    h, w, labels, a, _ = _head_inputs()
    ref_logp, _, ref_gh, ref_gw = _float64_reference(h, w, labels, 1.0, a, torch.zeros_like(a))
    for with_entropy in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, entropy = fused_linear_logprobs(hh, ww, labels, with_entropy=with_entropy, chunk_size=4)
        assert (entropy is None) == (not with_entropy)
        (a @ logp + (entropy.detach().sum() if with_entropy else 0)).backward()
        torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hh.grad.double(), ref_gh, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ww.grad.double(), ref_gw, rtol=1e-4, atol=1e-5)


def test_fused_head_gradcheck_in_float64():
    h, w, labels, _, _ = _head_inputs(n=7, hidden=3, vocab=9, dtype=torch.float64)
    h.requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w: fused_linear_logprobs(h, w, labels, temperature=0.6, with_entropy=True, chunk_size=3), (h, w))


def test_fused_head_equals_the_logits_path_and_never_holds_tokens_by_vocab():
    tokens, hidden, vocab, chunk = 64, 8, 100, 8
    h, w, labels, a, b = _head_inputs(n=tokens, hidden=hidden, vocab=vocab)
    h.requires_grad_(), w.requires_grad_()
    with _LargestFloat32() as seen:
        logp, entropy = fused_linear_logprobs(h, w, labels, temperature=0.7, with_entropy=True, chunk_size=chunk)
        (a @ logp + b @ entropy).backward()
    assert seen.largest <= max(chunk * vocab, vocab * hidden)     # a chunk's logits, or grad_W
    # The logits path (what the trainer computed before): same numbers to float32 rounding.
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = (h2 @ w2.t()) / 0.7
    with _LargestFloat32() as plain:
        plain_logp, plain_entropy = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
        (a @ plain_logp + b @ plain_entropy).backward()
    assert plain.largest == tokens * vocab
    torch.testing.assert_close(logp, plain_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, plain_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)


def test_fused_head_refuses_mismatched_shapes():
    h, w, labels, _, _ = _head_inputs()
    with pytest.raises(ValueError, match="labels shape"):
        fused_linear_logprobs(h, w, labels[:-1])
    with pytest.raises(ValueError, match="weight"):
        fused_linear_logprobs(h, w[:, :-1], labels)


def test_fused_lm_head_module_is_the_linear_layer_until_asked_for_logprobs():
    """grpo_trainer.lm_head on a tiny tied Qwen3 (no FSDP): the class swap keeps the tied weight
    and the logits; a request returns the log-probs and entropies of those logits at the selected
    positions (0 elsewhere); a head with a bias is left alone."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from grpo_trainer.lm_head import fused_head, install_fused_head
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=50,
                                         tie_word_embeddings=True))
    ids = torch.randint(0, 50, (2, 6))
    logits = model(input_ids=ids).logits
    assert install_fused_head(model) and fused_head(model) is model.lm_head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model(input_ids=ids).logits, logits, rtol=0, atol=0)
    select = torch.tensor([[True, True, False, True, False, False], [False, True, True, True, True, False]])
    labels = torch.randint(0, 50, (int(select.sum()),))
    with model.lm_head.request(select, labels, 0.5, with_entropy=True):
        out = model(input_ids=ids).logits
    assert out.shape == (2, 6, 2) and (out[~select] == 0).all()
    torch.testing.assert_close(out[select][:, 0], plain_logprobs(logits[select] / 0.5, labels), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[select][:, 1], plain_entropy(logits[select] / 0.5), rtol=1e-5, atol=1e-5)
    every = torch.randint(0, 50, (12,))     # no selection: every position, in order
    with model.lm_head.request(None, every, 0.5):
        out = model(input_ids=ids).logits
    assert out.shape == (2, 6, 1)
    torch.testing.assert_close(out.flatten(), plain_logprobs(logits.flatten(0, 1) / 0.5, every), rtol=1e-5, atol=1e-5)
    model.lm_head = torch.nn.Linear(16, 50, bias=True)
    assert not install_fused_head(model) and fused_head(model) is None
