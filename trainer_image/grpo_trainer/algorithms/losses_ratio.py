"""Policy losses that reshape PPO's ratio: CISPO, SAPO, GMPO (``geo_mean``) and GPG.

Semantics are verl's ``compute_policy_loss_{cispo,sapo,geo_mean,gpg}``. Each returns the
per-token loss for ``policy_loss`` to aggregate. SAPO and GMPO are objectives over sequences:
the job spec requires ``seq-mean-token-mean`` with them (verl forces or implies that mode), and
GMPO's sequence loss is put on every token of its response, so that mode's per-sequence token
mean gives back exactly the sequence's loss.
"""

from __future__ import annotations

import torch

from .losses import Metrics, clamped_log_ratio, needs_config
from .masked import masked_mean
from .registry import register_policy_loss


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
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
    """CISPO (arXiv:2506.13585): ``-sg[clip(r, 1-low, 1+high)] * A * logp``.

    The clipped ratio is a constant weight, so every token keeps its gradient (PPO's clip drops
    it). A ``clip_ratio_low`` of 1 or more leaves the ratio unbounded below (MiniMax-M1 uses 10).
    """
    del clip_ratio_c, config
    log_ratio = clamped_log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    metrics = {
        "pg_clipfrac": masked_mean((ratio != clipped).to(logp.dtype), response_mask).detach(),
        "pg_clipfrac_lower": torch.zeros((), dtype=logp.dtype, device=logp.device),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return -clipped * advantages * logp, metrics


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
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
    """SAPO (arXiv:2511.20347): a smooth gate instead of the clip, ``-f(r) * A`` with
    ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``; ``tau`` is ``tau_pos`` where A > 0, else ``tau_neg``.

    ``f'(1) = 1``, so on-policy the gradient is the policy gradient's; it fades as r leaves 1.
    No clip: the clip ratios are unused and the clip fractions are 0, as verl reports them.
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    config = needs_config(config, "sapo")
    log_ratio = clamped_log_ratio(logp, old_logp)
    positive = advantages > 0
    tau = torch.full_like(logp, config.tau_neg).masked_fill(positive, config.tau_pos)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    metrics = {"pg_clipfrac": zero, "pg_clipfrac_lower": zero,
               "ppo_kl": masked_mean(-log_ratio, response_mask).detach()}
    return -gate * advantages, metrics


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
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
    """GMPO (arXiv:2507.20673): the *geometric* mean of the token ratios, clipped per token in
    log space, ``-A_i * exp(mean_t clip_A(logp - old_logp))``.

    Per token the clip keeps, of the log-ratio and its clamp to ``[-low, high]``, the one that
    lowers ``A * log r`` (PPO's pessimism, in log space). ``A_i`` is the response's mean token
    advantage (outcome advantages are constant over it). No dual clip, and no clamp of the
    log-ratio, as verl. ``pg_clipfrac`` / ``pg_clipfrac_lower``: tokens clamped with A > 0 / A < 0.
    """
    del clip_ratio_c, config
    log_ratio = logp - old_logp
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = response_mask.sum(dim=-1)
    seq_log_ratio = (pessimistic * response_mask).sum(dim=-1) / (lengths + 1e-8)
    seq_advantage = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)
    seq_loss = -seq_advantage * torch.exp(seq_log_ratio)

    was_clamped = (log_ratio != clamped).to(logp.dtype)
    metrics = {
        "pg_clipfrac": masked_mean(was_clamped * (advantages > 0), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean(was_clamped * (advantages < 0), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return seq_loss.unsqueeze(-1).expand_as(logp), metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
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
    """GPG (arXiv:2504.02546): the plain policy gradient ``-A * logp``, no ratio, no clip.

    Off-policy updates (more than one mini-batch or PPO epoch) get no correction, as verl. verl
    reports no metrics for it; ``ppo_kl`` is kept here, so a drifting policy still shows.
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c, config
    return -advantages * logp, {"ppo_kl": masked_mean(old_logp - logp, response_mask).detach()}
