"""Clipped policy-gradient losses: ``vanilla`` (dual-clip PPO with asymmetric clip) and ``gspo``.

Formulas follow verl's ``compute_policy_loss_vanilla`` / ``compute_policy_loss_gspo``; verl's other
losses live beside this module (``losses_entropy``: clip_cov, kl_cov; ``losses_ratio``: cispo,
sapo, geo_mean, gpg; ``losses_trust``: dppo_tv, dppo_kl, dro). A registered policy loss returns
the *per-token* loss matrix and its metrics; ``policy_loss`` aggregates it, so every loss (a
user's too) gets the same ``loss_agg_mode`` handling and exact gradient accumulation through a
``LossNormalizer``::

    @register_policy_loss("my_loss")
    def my_loss(old_logp, logp, advantages, response_mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                config=None):
        ...
        return loss_mat, metrics            # [B, T], dict of detached 0-d tensors

``config`` is the job's ``algorithm.policyLossConfig`` (verl's ``actor.policy_loss``: clip_cov_ratio,
kl_cov_ratio, ppo_kl_coef, tau_pos, ...), read by attribute; the losses that need it refuse None,
so its defaults live only in the job spec.

Metrics are means over this call's response tokens: ``pg_clipfrac`` (tokens whose loss the clip
raised: ``pg_clipfrac_high`` + ``pg_clipfrac_low``), ``pg_clipfrac_lower`` (tokens hit by the dual
clip), ``ppo_kl`` (``mean(old_logp - logp)``, the approximate KL from the old policy).
"""

from __future__ import annotations

import torch

from .aggregation import LossNormalizer, aggregate_loss
from .masked import masked_mean
from .registry import POLICY_LOSSES, Registry, register_policy_loss

Metrics = dict[str, torch.Tensor]


def policy_loss(
    mode: str,
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
    registry: Registry | None = None,
    weights: torch.Tensor | None = None,
    config: object | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Scalar policy loss of the loss registered as ``mode`` and its metrics.

    ``weights`` (``[B, T]``, constants) scale each token's loss before aggregation: rollout
    correction's importance weights.

    All tensors are ``[B, T]``; ``old_logp`` and ``advantages`` are treated as constants.
    Without ``normalizer`` the loss is ``loss_agg_mode`` over this batch alone; with one (built
    for the whole mini-batch, its ``mode`` must equal ``loss_agg_mode``) it is this micro-batch's
    exact share, see ``aggregation.py``. GSPO's objective is a mean over sequences of
    sequence-level terms: use ``loss_agg_mode="seq-mean-token-mean"`` with it (verl forces that
    mode; here the argument is honoured, so the job spec decides).
    """
    fn = (registry or POLICY_LOSSES).get(mode)
    if not (old_logp.shape == logp.shape == advantages.shape == response_mask.shape):
        raise ValueError(
            "old_logp, logp, advantages and response_mask must have one shape, got "
            f"{tuple(old_logp.shape)}, {tuple(logp.shape)}, {tuple(advantages.shape)}, {tuple(response_mask.shape)}"
        )
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO (got {clip_ratio_c})")
    loss_mat, metrics = fn(
        old_logp.detach(),
        logp,
        advantages.detach(),
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        config=config,
    )
    if weights is not None:
        loss_mat = loss_mat * weights.detach()
    if normalizer is None:
        loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode)
    else:
        if normalizer.mode != loss_agg_mode:
            raise ValueError(f"normalizer was built for {normalizer.mode!r} but loss_agg_mode is {loss_agg_mode!r}")
        loss = normalizer(loss_mat, response_mask)
    return loss, metrics


def clamped_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """``log r = logp - old_logp``, clamped to [-20, 20] before any exp (stability), as verl."""
    return torch.clamp(logp - old_logp, min=-20.0, max=20.0)


def needs_config(config: object | None, mode: str) -> object:
    """``config`` for a loss that reads its parameters from it; a clear error without one."""
    if config is None:
        raise ValueError(f"policy loss {mode!r} reads its parameters from config (the job's "
                         "algorithm.policyLossConfig); pass config=")
    return config


def _clip_metrics(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> Metrics:
    """Which tokens the clip acted on: ratio above 1+high with A > 0, or below 1-low with A < 0."""
    high = (ratio > 1 + clip_ratio_high) & (advantages > 0)
    low = (ratio < 1 - clip_ratio_low) & (advantages < 0)
    return {
        "pg_clipfrac_high": masked_mean(high.to(ratio.dtype), response_mask).detach(),
        "pg_clipfrac_low": masked_mean(low.to(ratio.dtype), response_mask).detach(),
    }


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    config: object | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip per token, ``max(-A r, -A clip(r, 1-low, 1+high))``, plus the dual clip for A < 0.

    ``clip_ratio_high > clip_ratio_low`` is DAPO's clip-higher. The dual clip (arXiv:1912.09729)
    caps the loss of a negative-advantage token at ``-A * clip_ratio_c`` when the ratio explodes.
    """
    del config
    negative_approx_kl = clamped_log_ratio(logp, old_logp)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(ratio.dtype), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        (torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).to(ratio.dtype), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)

    metrics = {
        "pg_clipfrac": pg_clipfrac.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
        **_clip_metrics(ratio.detach(), advantages, response_mask, clip_ratio_low, clip_ratio_high),
    }
    return pg_losses, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    config: object | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (arXiv:2507.18071): clip the *sequence* ratio ``s_i = exp(mean_t(logp - old_logp))``.

    Per token the ratio is ``sg[s_i] * exp(logp_t - sg[logp_t])``: its value is ``s_i`` and its
    gradient is ``s_i * grad logp_t``, so with seq-mean-token-mean aggregation the gradient is
    GSPO's ``s_i * mean_t grad logp_t``. No dual clip: ``clip_ratio_c`` is unused.
    """
    del clip_ratio_c, config
    negative_approx_kl = logp - old_logp
    seq_lengths = response_mask.sum(dim=-1).clamp(min=1).to(logp.dtype)
    negative_approx_kl_seq = (negative_approx_kl * response_mask).sum(dim=-1) / seq_lengths

    log_seq_ratio = logp - logp.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))  # clamp before exp: stability

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)

    metrics = {
        "pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).to(logp.dtype), response_mask).detach(),
        "pg_clipfrac_lower": torch.zeros((), dtype=logp.dtype, device=logp.device),
        "ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
        **_clip_metrics(seq_ratio.detach(), advantages, response_mask, clip_ratio_low, clip_ratio_high),
    }
    return pg_losses, metrics


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped value loss (verl's ``compute_value_loss``): ``0.5 * agg(max((V - R)^2,
    (clip(V, V_old - c, V_old + c) - R)^2))``, all ``[B, T]``; ``returns`` and ``old_values``
    are constants. ``vf_clipfrac`` is the share of response tokens where the clipped term is the
    larger. With a ``normalizer`` the loss is this micro-batch's share, as in ``policy_loss``."""
    returns, old_values = returns.detach(), old_values.detach()
    clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss, clipped_loss = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss_mat = torch.maximum(unclipped_loss, clipped_loss)
    if normalizer is None:
        loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode)
    else:
        loss = normalizer(loss_mat, response_mask)
    clipfrac = masked_mean(torch.gt(clipped_loss, unclipped_loss).to(vpreds.dtype), response_mask)
    return 0.5 * loss, {"vf_clipfrac": clipfrac.detach()}
