"""Masked reductions over response tokens (verl's ``masked_mean`` / ``masked_var`` / ``masked_whiten``).

The formulas, including the ``1e-8`` guards, are verl's (``verl/utils/torch_functional.py``) so
that REINFORCE++ advantages match a verl run to rounding.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # `where`, not `values * mask`: a NaN/inf in a padded position must not leak into the sum.
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    masked = torch.where(mask.bool(), values, zeros)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count.to(values.dtype) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements; with Bessel's correction when ``unbiased``."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = int(mask.sum().item())
        if count < 2:
            raise ValueError(
                f"masked_var needs at least 2 unmasked elements for an unbiased variance (got {count}); "
                "whitening advantages over a batch needs more than one response token in it"
            )
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with mean and (unbiased) var over the masked elements."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
