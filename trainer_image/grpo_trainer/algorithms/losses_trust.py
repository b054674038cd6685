"""DPPO's divergence trust regions (``dppo_tv``, ``dppo_kl``; arXiv:2602.04879) and DRO's
quadratic log-ratio penalty (``dro``).

Semantics are verl's ``compute_policy_loss_{dppo_tv,dppo_kl,dro}``; each returns the per-token
loss for ``policy_loss`` to aggregate in any ``loss_agg_mode``. DPPO measures how far a token
moved by its *probability* (total variation ``p - p_old``, or the binary KL between the two
Bernoulli distributions ``p`` and ``p_old``) rather than by the ratio: a token that moved past the
bound in the direction its advantage pushes loses its gradient; the others get the policy
gradient weighted by the ratio, truncated at ``clip_ratio_c``, as a constant.
"""

from __future__ import annotations

import torch

from .losses import Metrics, clamped_log_ratio, needs_config
from .masked import masked_mean
from .registry import register_policy_loss


def _dppo(old_logp, logp, advantages, response_mask, clip_ratio_c, inside) -> tuple[torch.Tensor, Metrics]:
    """``-A * sg[min(r, c)] * logp`` on the tokens ``inside`` the trust region, 0 elsewhere."""
    log_ratio = clamped_log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    valid = inside.detach().to(logp.dtype)
    metrics = {
        "pg_clipfrac": masked_mean(1.0 - valid, response_mask).detach(),
        "pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).to(logp.dtype) * valid, response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return -advantages * truncated * logp * valid, metrics


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
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
    """DPPO-Binary-TV: inside while ``p - p_old <= clip_ratio_high`` (A > 0) or
    ``p - p_old >= -clip_ratio_low`` (A <= 0); the clip ratios bound a probability difference."""
    del config
    moved = torch.exp(logp) - torch.exp(old_logp)
    inside = torch.where(advantages > 0, moved <= clip_ratio_high, moved >= -clip_ratio_low)
    return _dppo(old_logp, logp, advantages, response_mask, clip_ratio_c, inside)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
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
    """DPPO-Binary-KL: ``KL(Bern(p_old) || Bern(p))`` bounded by ``clip_ratio_high`` for a token
    whose probability rose with A > 0 (``clip_ratio_low`` for one that fell with A <= 0); a token
    moving against its advantage's push is always inside."""
    del config
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    binary_kl = p_old * (old_logp - logp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    inside = torch.where(advantages > 0, (binary_kl <= clip_ratio_high) | (p <= p_old),
                         (binary_kl <= clip_ratio_low) | (p >= p_old))
    return _dppo(old_logp, logp, advantages, response_mask, clip_ratio_c, inside)


@register_policy_loss("dro")
def compute_policy_loss_dro(
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
    """Direct reward optimisation: ``-(A * logp - beta/2 * (logp - old_logp)^2)``, ``beta`` the
    config's ``dro_beta`` (required); no ratio and no clip."""
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    beta = needs_config(config, "dro").dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"policy loss 'dro' needs dro_beta > 0 (got {beta})")
    log_ratio = logp - old_logp
    return (-(logp * advantages - 0.5 * beta * log_ratio.square()),
            {"ppo_kl": masked_mean(-log_ratio, response_mask).detach()})
