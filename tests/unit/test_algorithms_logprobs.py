"""Chunked logprobs/entropy of grpo_trainer.algorithms: exact, differentiable, and never a full float32 copy."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_trainer.algorithms import entropy_from_logits, logprobs_from_logits


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
