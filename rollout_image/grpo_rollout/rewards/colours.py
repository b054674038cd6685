"""The tiny VL model's task (grpo_rollout.tiny_vl, `grpo data colours`): name the image's colour."""

from __future__ import annotations

from grpo_rollout.rewards.registry import register


@register("grpo/colours")
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 when the response's first word is the colour, else 0."""
    words = solution_str.split()
    return 1.0 if words and words[0].lower() == str(ground_truth).lower() else 0.0
