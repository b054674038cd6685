"""Per-token KL(policy || reference) estimators for the KL loss (verl's ``kl_penalty``).

Estimators of KL from samples of the policy, with ``log r = ref_logp - logp``
(J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html):

- ``k1`` / ``kl``: ``logp - ref_logp``: unbiased, high variance, can be negative.
- ``abs``: ``|logp - ref_logp|``.
- ``k2`` / ``mse``: ``0.5 * (logp - ref_logp)^2``: biased, low variance; its *gradient* is the
  unbiased gradient of KL.
- ``k3`` / ``low_var_kl``: ``exp(log r) - log r - 1``: unbiased, low variance, always >= 0
  (``log r`` clamped to [-20, 20] and the result to [-10, 10] for stability, as verl).

A ``+`` suffix (``k3+``, ``low_var_kl+``, ...) keeps the named estimator's *value* but uses k2's
*gradient* (straight-through: ``k2 + (value - k2).detach()``): the expected gradients of k1 and k3
are not the gradient of KL, k2's is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_logp - logp, min=-20, max=20)
    kld = torch.exp(log_ratio) - log_ratio - 1
    return torch.clamp(kld, min=-10, max=10)


_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}

KL_TYPES: tuple[str, ...] = tuple(_ESTIMATORS) + tuple(f"{name}+" for name in _ESTIMATORS)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of type ``kind`` (see module doc); same shape as ``logp``.

    Aggregate it with the loss's ``aggregate_loss``/``LossNormalizer`` and weight by ``klLossCoef``.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    try:
        estimator = _ESTIMATORS[base]
    except KeyError:
        raise ValueError(f"unknown KL type {kind!r}; known: {', '.join(KL_TYPES)}") from None
    value = estimator(logp, ref_logp)
    if not straight_through or estimator is _k2:
        return value
    k2 = _k2(logp, ref_logp)
    return k2 + (value - k2).detach()


class KLController:
    """The coefficient of the KL penalty in the reward (algorithm.useKLInReward; verl's
    ``FixedKLController`` / ``AdaptiveKLController``). Adaptive (Ziegler et al. 2019): after each
    step, ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``, with
    ``n_steps`` the step's responses; fixed: ``value`` stays ``kl_coef``."""

    def __init__(self, kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"unknown KL controller {kind!r}; known: fixed, adaptive")
        self.kind, self.value, self.target_kl, self.horizon = kind, kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon
