"""Geometry3K (verl's geo3k VLM examples, data_source hiyouga/geometry3k): verl's
utils/reward_score/geo3k.py, 0.9 x accuracy + 0.1 x format.

Format: the whole response is `<think>...</think>...\\boxed{...}...`. Accuracy: the last
`\\boxed{}`'s content equals the ground truth. verl grades with mathruler's grade_answer
(normalized strings, then sympy); here math-verify judges the equivalence (as for MATH,
math_answer.py), so `\\frac{1}{2}` matches `0.5` in both.
"""

from __future__ import annotations

import re

from grpo_rollout.rewards.math_answer import math_score
from grpo_rollout.rewards.math_dapo import last_boxed
from grpo_rollout.rewards.registry import register

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
FORMAT_WEIGHT = 0.1


def format_reward(response: str) -> float:
    return 1.0 if _FORMAT.fullmatch(response) else 0.0


def acc_reward(response: str, ground_truth: str) -> float:
    answer = last_boxed(response)
    return 0.0 if answer is None else math_score("\\boxed{" + answer + "}", ground_truth)


@register("hiyouga/geometry3k")
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (1.0 - FORMAT_WEIGHT) * acc_reward(solution_str, str(ground_truth)) + FORMAT_WEIGHT * format_reward(
        solution_str)
