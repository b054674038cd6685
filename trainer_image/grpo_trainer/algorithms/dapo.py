"""DAPO's batch-level tricks (arXiv:2503.14476): dynamic sampling and overlong reward shaping.

(DAPO's clip-higher is ``clip_ratio_high > clip_ratio_low`` in the vanilla policy loss, and its
token-level loss is ``loss_agg_mode="token-mean"``.)
"""

from __future__ import annotations

import torch

from .groups import GroupIds, Groups


def filter_groups_with_equal_rewards(scores: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """Dynamic sampling: a ``[B]`` bool keep-mask that drops every group whose scores are all equal.

    Such a group (all right or all wrong) has zero GRPO advantage everywhere, so it only dilutes
    the batch; DAPO samples more prompts until the batch is full of informative groups. A sample
    alone in its group is kept, as in verl's DAPO recipe (``std > 0 or len == 1``): its GRPO
    advantage is its raw score, not zero. Equality is exact (max == min), which unlike a float
    std > 0 test cannot be fooled by rounding in the mean.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], one per sample (got shape {tuple(scores.shape)})")
    groups = Groups.from_ids(group_ids, scores.shape[0], device=scores.device)
    varied = groups.max(scores) > groups.min(scores)
    return varied[groups.index] | (groups.sizes[groups.index] == 1)


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each sample's reward; ``<= 0``, same shape as lengths.

    Responses up to ``max_response_length - overlong_buffer_len`` tokens are not penalised; in the
    last ``overlong_buffer_len`` tokens the penalty grows linearly to ``-penalty_factor`` at
    ``max_response_length`` (verl's DAPO reward manager:
    ``min(-(len - expected_len) / buffer_len * penalty_factor, 0)``). Lengths beyond the maximum
    (which the rollout should not produce) are held at ``-penalty_factor``.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}] "
            f"(got {overlong_buffer_len})"
        )
    lengths = torch.as_tensor(response_lengths)
    dtype = torch.promote_types(lengths.dtype, torch.float32) if lengths.is_floating_point() else torch.float32
    expected_len = max_response_length - overlong_buffer_len
    exceed = lengths.to(dtype) - expected_len
    penalty = -exceed / overlong_buffer_len * penalty_factor
    return penalty.clamp(min=-penalty_factor, max=0.0)
