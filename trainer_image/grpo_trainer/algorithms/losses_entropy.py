"""Clip-Cov and KL-Cov (arXiv:2505.22617, "The Entropy Mechanism of RL for Reasoning LMs").

Both single out the few response tokens whose covariance between advantage and log-probability,
``(A - mean A) * (logp - mean logp)`` over this call's response tokens, is largest: those drive
the collapse of the policy's entropy. Semantics are verl's ``compute_policy_loss_clip_cov`` /
``compute_policy_loss_kl_cov``; parameters come from ``config`` (the job's
``algorithm.policyLossConfig``: verl's ``actor.policy_loss``). Like every registered loss they
return the per-token loss, so any ``loss_agg_mode`` and exact gradient accumulation apply.
"""

from __future__ import annotations

import torch

from .losses import Metrics, needs_config
from .masked import masked_mean
from .registry import register_policy_loss


def _covariance(advantages: torch.Tensor, logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token ``(A - mean A) * (logp - mean logp)``, the means over the response tokens."""
    logp = logp.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (logp - masked_mean(logp, response_mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
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
    """PPO-clip, with the gradient cut from a random ``clip_cov_ratio`` share of the tokens whose
    covariance lies in ``(clip_cov_lb, clip_cov_ub)`` and that the clip left alone.

    At least one token is cut when any qualifies. No dual clip (``clip_ratio_c`` unused) and no
    clamp of the log-ratio, as verl. ``pg_clipfrac`` is the share of tokens cut.
    """
    del clip_ratio_c
    config = needs_config(config, "clip_cov")
    mask = response_mask.bool()
    negative_approx_kl = logp - old_logp
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_by_ppo = pg_losses2 > pg_losses1

    cov = _covariance(advantages, logp, response_mask)
    candidates = mask & ~clipped_by_ppo & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    chosen = torch.nonzero(candidates)
    clip_num = max(int(config.clip_cov_ratio * int(mask.sum().item())), 1)
    # verl picks uniformly among the candidates (the global RNG, as verl)
    chosen = chosen[torch.randperm(len(chosen), device=chosen.device)[:clip_num]]
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0

    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep
    metrics = {
        "pg_clipfrac": masked_mean((keep == 0).to(logp.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
    }
    return pg_losses, metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
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
    """Unclipped policy gradient ``-A r``, plus ``ppo_kl_coef * |logp - old_logp|`` on the
    ``kl_cov_ratio`` share of the tokens with the largest covariance (at least one).

    No clip at all (the clip ratios are unused), as verl. ``ppo_kl`` is the mean *absolute*
    log-ratio, verl's metric for this loss.
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    config = needs_config(config, "kl_cov")
    mask = response_mask.bool()
    negative_approx_kl = logp - old_logp
    abs_kl = negative_approx_kl.abs()
    pg_losses = -advantages * torch.exp(negative_approx_kl)

    num_tokens = int(mask.sum().item())
    if num_tokens:
        cov = _covariance(advantages, logp, response_mask).masked_fill(~mask, -torch.inf)
        k = max(1, int(num_tokens * config.kl_cov_ratio))
        top = torch.topk(cov.flatten(), k).indices
        penalised = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
        penalised[top] = True
        pg_losses = pg_losses + config.ppo_kl_coef * abs_kl * penalised.view_as(cov)

    return pg_losses, {"ppo_kl": masked_mean(abs_kl, response_mask).detach()}
