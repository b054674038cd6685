"""Token log-probabilities and entropies from logits without a float32 ``[tokens, vocab]`` at once.

The plain computation, ``log_softmax(logits.float())``, materialises a float32 copy of the
logits: for 16k tokens and a 152k vocabulary that is 10 GB, more than the bf16 logits themselves.
Here the tokens are processed in chunks of ``chunk_size``; only one chunk is upcast at a time.

Why custom autograd functions rather than a loop of ordinary ops: a loop that keeps each chunk's
graph saves every chunk's float32 softmax for backward, so the whole float32 matrix is alive again
by the end of the forward pass. ``torch.utils.checkpoint`` per chunk avoids that, but the gradient
of each chunk (a slice of the logits) is then assembled by autograd's slice/split backward into
extra full-size buffers. The functions below save only the logits (already alive, not copied) and
one float32 number per token (the log-normaliser), and in backward recompute the softmax chunk by
chunk, writing straight into a single gradient tensor in the logits' dtype:

- ``d logp_y / d x = onehot(y) - softmax(x)``
- ``d H / d x = -softmax(x) * (log_softmax(x) + H)``

Peak extra memory is one float32 chunk (``chunk_size * vocab * 4`` bytes) in both passes. The
values are the plain float32 computation's, row by row (the same kernels on fewer rows); the
gradients equal autograd's through the plain computation to float32 rounding.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per chunk: 1024 x 152k vocab x 4 bytes = 0.6 GB of float32 scratch."""


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _chunks(n: int, chunk_size: int) -> range:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (got {chunk_size})")
    return range(0, n, chunk_size)


class _LogprobsFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        dtype = _compute_dtype(logits)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for start in _chunks(logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            x = logits[rows].to(dtype)
            # log_softmax, not x - logsumexp(x): the very kernel of the plain computation.
            out[rows] = torch.log_softmax(x, dim=-1).gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1)
            lse[rows] = torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in _chunks(logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            g = grad_out[rows].to(lse.dtype).unsqueeze(-1)
            probs = torch.exp(logits[rows].to(lse.dtype) - lse[rows].unsqueeze(-1))
            chunk_grad = -probs * g
            chunk_grad.scatter_add_(-1, labels[rows].unsqueeze(-1), g)
            grad[rows] = chunk_grad.to(grad.dtype)
        return grad, None, None


class _EntropyFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        dtype = _compute_dtype(logits)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for start in _chunks(logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            x = logits[rows].to(dtype)
            # -sum(p log p) rather than verl's logsumexp(x) - sum(p x): same value, without the
            # cancellation between two large terms when the distribution is peaked.
            logp = torch.log_softmax(x, dim=-1)
            out[rows] = -(logp.exp() * logp).sum(dim=-1)
            lse[rows] = torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(logits, lse, out)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in _chunks(logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            logp = logits[rows].to(lse.dtype) - lse[rows].unsqueeze(-1)
            chunk_grad = -torch.exp(logp) * (logp + entropy[rows].unsqueeze(-1))
            grad[rows] = (chunk_grad * grad_out[rows].to(lse.dtype).unsqueeze(-1)).to(grad.dtype)
        return grad, None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """``log_softmax(logits.float())[..., labels]``: logits ``[..., V]``, labels ``[...]`` (valid ids).

    Returns float32 (float64 for float64 logits), shape ``labels.shape``; differentiable in logits
    (once: no double backward). Pass contiguous logits (e.g. the unpadded ``[tokens, V]``): a
    non-contiguous view such as ``logits[:, :-1]`` is copied by the flattening reshape.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must be logits shape without the vocab dim "
                         f"{tuple(logits.shape[:-1])}")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).to(torch.long)
    return _LogprobsFromLogits.apply(flat_logits, flat_labels, chunk_size).view(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy of ``softmax(logits.float())`` per position: logits ``[..., V]`` -> ``[...]``.

    Returns float32 (float64 for float64 logits); differentiable in logits (entropy bonus).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    return _EntropyFromLogits.apply(flat_logits, chunk_size).view(logits.shape[:-1])


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, temperature: float):
    """A chunk's logits / T in `dtype`, a fresh tensor (the matmul in the inputs' dtype, as the head)."""
    x = (hidden @ weight.t()).to(dtype)      # no copy when already in dtype
    return x.div_(temperature) if temperature != 1.0 else x


class _FusedLinearLogprobs(torch.autograd.Function):
    """Log-prob of the target and entropy of ``softmax(hidden @ weight.T / T)``, chunk by chunk.

    Saves the hidden states, the weight and two float32 numbers per token; backward recomputes
    each chunk's logits and writes grad_hidden and a float32 grad_weight accumulator, so no
    ``[tokens, vocab]`` tensor exists in either pass (Liger's fused linear cross-entropy)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, with_entropy: bool, chunk_size: int):
        dtype = _compute_dtype(hidden)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device) if with_entropy else None
        for start in _chunks(n, chunk_size):
            rows = slice(start, start + chunk_size)
            # In place where it can be: one float32 chunk, two with the entropy.
            x = _chunk_logits(hidden[rows], weight, dtype, temperature)
            lse[rows] = torch.logsumexp(x, dim=-1)
            x.sub_(lse[rows].unsqueeze(-1))      # log_softmax
            logp[rows] = x.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[rows] = -x.exp().mul_(x).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # float32 over the chunks: a bf16 accumulator would round once per chunk.
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if need_weight else None
        if grad_logp is None and grad_entropy is None or not (need_hidden or need_weight):
            return grad_hidden, grad_weight, None, None, None, None
        for start in _chunks(hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            # Two float32 chunks: the log-probs (becoming the gradient) and the probabilities.
            logp = _chunk_logits(hidden[rows], weight, lse.dtype, ctx.temperature).sub_(lse[rows].unsqueeze(-1))
            probs = logp.exp()
            if grad_entropy is not None:     # d H / d x = -p (log p + H)
                ge = grad_entropy[rows].to(lse.dtype).unsqueeze(-1)
                grad = logp.add_(entropy[rows].unsqueeze(-1)).mul_(probs).mul_(-ge)
            else:
                grad = logp.zero_()
            if grad_logp is not None:        # d logp_y / d x = onehot(y) - p
                g = grad_logp[rows].to(lse.dtype).unsqueeze(-1)
                grad.sub_(probs.mul_(g))
                grad.scatter_add_(-1, labels[rows].unsqueeze(-1), g)
            del probs
            grad = grad.div_(ctx.temperature).to(hidden.dtype)   # through x = logits / T
            if need_hidden:
                grad_hidden[rows] = grad @ weight
            if need_weight:
                grad_weight.add_(grad.t() @ hidden[rows])      # cast as it adds: no float32 copy
        return (grad_hidden, grad_weight.to(weight.dtype) if need_weight else None, None, None, None, None)


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          temperature: float = 1.0, with_entropy: bool = False,
                          chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-prob of ``labels`` and (with ``with_entropy``) the entropy under
    ``softmax(hidden @ weight.T / temperature)``, never building the ``[tokens, vocab]`` logits:
    hidden ``[n, H]``, weight ``[V, H]`` (an LM head), labels ``[n]``. Float32 math (float64 for
    float64 inputs), the logits in the inputs' dtype as the LM head computes them. Differentiable
    in hidden and weight, through both outputs (once). Temperature 0 (greedy) reads as 1."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, H] and weight [V, H] expected (got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)})")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must be ({hidden.shape[0]},)")
    return _FusedLinearLogprobs.apply(hidden, weight.to(hidden.dtype), labels.to(torch.long),
                                      float(temperature) if temperature > 0 else 1.0, with_entropy, chunk_size)
