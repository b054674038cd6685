"""More group-baseline outcome estimators of verl's registry: GPG, GRPO pass@k, and verl's
``grpo_vectorized`` / ``rloo_vectorized`` spellings.

Same calling convention as ``advantages.py``; semantics are verl's ``compute_gpg_outcome_advantage``,
``compute_grpo_passk_outcome_advantage``, ``compute_grpo_vectorized_outcome_advantage`` and
``compute_rloo_vectorized_outcome_advantage``.
"""

from __future__ import annotations

import torch

from .advantages import _broadcast, _group_mean_or_zero, compute_grpo_outcome_advantage
from .groups import Groups
from .registry import ADV_ESTIMATORS, register_adv_est

# verl's vectorised GRPO computes what its loop does (mean, Bessel std, lone sample: mean 0, std 1).
ADV_ESTIMATORS.register("grpo_vectorized")(compute_grpo_outcome_advantage)


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    *,
    norm_adv_by_std: bool,
    gamma: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv:2504.02546): ``alpha * (score - group_mean)`` with ``alpha = B / #(score != 0)``.

    ``alpha`` (B samples in the batch) undoes the dilution of the gradient by samples that score 0;
    no std (``norm_adv_by_std`` is unused). A lone sample keeps ``alpha * score`` (mean 0, as verl).
    """
    del norm_adv_by_std, gamma, epsilon
    scores = token_level_rewards.sum(dim=-1)
    alpha = scores.numel() / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    advantages = _broadcast(alpha * (scores - _group_mean_or_zero(scores, groups)), response_mask)
    return advantages, advantages


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    *,
    norm_adv_by_std: bool,
    gamma: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (arXiv:2503.19595): only the best response of a group learns, with advantage
    ``best - second best`` (over ``group_std + epsilon`` with ``norm_adv_by_std``); the others get 0.

    Needs two samples in every group (ValueError otherwise, as verl). Of tied best responses one gets
    the advantage, which is then 0.
    """
    del gamma
    scores = token_level_rewards.sum(dim=-1)
    if bool((groups.sizes < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per prompt group (rollout.n >= 2)")
    scalar = torch.zeros_like(scores)
    stds = groups.std(scores)
    for g in range(groups.num_groups):
        members = torch.nonzero(groups.index == g).flatten()
        top = torch.topk(scores[members], 2)
        advantage = top.values[0] - top.values[1]
        if norm_adv_by_std:
            advantage = advantage / (stds[g] + epsilon)
        scalar[members[top.indices[0]]] = advantage
    advantages = _broadcast(scalar, response_mask)
    return advantages, advantages


@register_adv_est("rloo_vectorized")
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    *,
    norm_adv_by_std: bool,
    gamma: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's leave-one-out baseline, ``score - (group_sum - score) / (n - 1)``, as ``rloo``; but a
    sample alone in its group gets 0 here (verl's vectorised form), not its score."""
    del norm_adv_by_std, gamma, epsilon
    scores = token_level_rewards.sum(dim=-1)
    n = groups.sizes[groups.index].to(scores.dtype)
    scalar = (n * scores - groups.sum(scores)[groups.index]) / (n - 1).clamp(min=1) * (n > 1)
    advantages = _broadcast(scalar, response_mask)
    return advantages, advantages
