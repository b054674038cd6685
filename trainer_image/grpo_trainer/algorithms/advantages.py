"""Outcome advantage estimators: GRPO (and Dr.GRPO), RLOO, REINFORCE++ (+baseline), OPO.

Names and formulas follow verl's ``verl/trainer/ppo/core_algos.py`` (``compute_grpo_outcome_advantage``
and friends). Every estimator has the same signature, so that one registered by a user plugs in::

    @register_adv_est("my_estimator")
    def my_estimator(token_level_rewards, response_mask, groups, *, norm_adv_by_std, gamma, epsilon):
        ...
        return advantages, returns          # both [B, T], zero outside response_mask

``token_level_rewards`` and ``response_mask`` are ``[B, T]``; ``groups`` is a ``Groups`` (dense
prompt-group index). A sample's *score* is the sum of its token rewards (outcome rewards put the
whole reward on the last response token). Advantages are constants for the policy update, so they
are computed without autograd, in at least float32.
"""

from __future__ import annotations

import torch

from .groups import GroupIds, Groups
from .masked import masked_whiten
from .registry import ADV_ESTIMATORS, Registry, register_adv_est


def compute_advantages(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    norm_adv_by_std: bool = True,
    gamma: float = 1.0,
    epsilon: float = 1e-6,
    registry: Registry | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, both ``[B, T]``, for the estimator registered as ``estimator``.

    ``group_ids`` gives one prompt-group id per sample (ints or strings). ``norm_adv_by_std``
    applies to ``grpo`` only (False = Dr.GRPO); ``gamma`` to ``reinforce_plus_plus`` only;
    ``epsilon`` guards GRPO's division by the group std. The result has the dtype of the rewards
    promoted to at least float32.
    """
    fn = (registry or ADV_ESTIMATORS).get(estimator)
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            "token_level_rewards and response_mask must both be [B, T] "
            f"(got {tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)})"
        )
    groups = Groups.from_ids(group_ids, token_level_rewards.shape[0], device=token_level_rewards.device)
    dtype = torch.promote_types(token_level_rewards.dtype, torch.float32)
    with torch.no_grad():
        return fn(
            token_level_rewards.detach().to(dtype),
            response_mask.detach().to(dtype),
            groups,
            norm_adv_by_std=norm_adv_by_std,
            gamma=gamma,
            epsilon=epsilon,
        )


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, T]``: the same value on every response token, zero on padding."""
    return per_sample.unsqueeze(-1) * response_mask


def _group_mean_or_zero(scores: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Per-sample group mean, with 0 for a sample alone in its group (as verl)."""
    lone = groups.sizes[groups.index] == 1
    return torch.where(lone, torch.zeros_like(scores), groups.mean(scores)[groups.index])


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    *,
    norm_adv_by_std: bool,
    gamma: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(score - group_mean) / (group_std + epsilon)``; Dr.GRPO (arXiv:2503.20783) drops the std.

    The std has Bessel's correction (``torch.std``). A sample alone in its group gets mean 0 and
    std 1, i.e. keeps its raw score (as verl).
    """
    del gamma
    scores = token_level_rewards.sum(dim=-1)
    lone = groups.sizes[groups.index] == 1
    mean = _group_mean_or_zero(scores, groups)
    if norm_adv_by_std:
        std = torch.where(lone, torch.ones_like(scores), groups.std(scores)[groups.index])
        scalar = (scores - mean) / (std + epsilon)
    else:
        scalar = scores - mean
    advantages = _broadcast(scalar, response_mask)
    return advantages, advantages


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    *,
    norm_adv_by_std: bool,
    gamma: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): score minus the mean of the *other* samples of the group.

    Written as verl does, ``score * n/(n-1) - mean * n/(n-1)``, which equals
    ``score - (sum - score)/(n-1)``. A lone sample keeps its score.
    """
    del norm_adv_by_std, gamma, epsilon
    scores = token_level_rewards.sum(dim=-1)
    n = groups.sizes[groups.index].to(scores.dtype)
    mean = groups.mean(scores)[groups.index]
    factor = n / (n - 1).clamp(min=1)
    scalar = torch.where(n > 1, scores * factor - mean * factor, scores)
    advantages = _broadcast(scalar, response_mask)
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    *,
    norm_adv_by_std: bool,
    gamma: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted return-to-go, whitened over the batch's response tokens.

    Returns are the un-whitened returns-to-go. No group baseline: ``groups`` is unused.
    """
    del groups, norm_adv_by_std, epsilon
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        # A padded position must not carry return back into the response (reset after EOS).
        running = running * response_mask[:, t]
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    *,
    norm_adv_by_std: bool,
    gamma: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean score, broadcast, then whiten over the batch."""
    del norm_adv_by_std, gamma, epsilon
    scores = token_level_rewards.sum(dim=-1)
    centered = _broadcast(scores - _group_mean_or_zero(scores, groups), response_mask)
    advantages = masked_whiten(centered, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("opo")
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    *,
    norm_adv_by_std: bool,
    gamma: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv:2505.23585): baseline = length-weighted group mean, ``sum(len_i * score_i) / sum(len_i)``.

    A lone sample has baseline 0 (as verl); so does a group whose responses are all empty.
    """
    del norm_adv_by_std, gamma, epsilon
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1)
    weighted = groups.sum(lengths * scores)[groups.index]
    total_len = groups.sum(lengths)[groups.index]
    use_baseline = (groups.sizes[groups.index] > 1) & (total_len > 0)
    baseline = torch.where(use_baseline, weighted / total_len.clamp(min=1), torch.zeros_like(scores))
    advantages = _broadcast(scores - baseline, response_mask)
    return advantages, advantages


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's generalized advantage estimation (verl's ``compute_gae_advantage_return``).

    All ``[B, T]``; ``values[:, t]`` is the critic's value of the state before response token t.
    Going back from the last token: ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * A_{t+1}``, where a masked-out position (padding, or a tool's
    tokens inside a response) passes the next value and advantage through unchanged. Returns are
    ``A + V`` before whitening; the advantages are then whitened over the batch's response tokens.
    Not a registered estimator: it needs the critic's values.
    """
    with torch.no_grad():
        dtype = torch.promote_types(token_level_rewards.dtype, torch.float32)
        rewards, values, mask = (x.detach().to(dtype) for x in (token_level_rewards, values, response_mask))
        next_value = torch.zeros_like(rewards[:, 0])
        last_gae = torch.zeros_like(rewards[:, 0])
        advantages = torch.zeros_like(rewards)
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            next_value = torch.where(mask[:, t].bool(), values[:, t], next_value)
            last_gae = torch.where(mask[:, t].bool(), gae, last_gae)
            advantages[:, t] = last_gae
        returns = advantages + values
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns * mask
