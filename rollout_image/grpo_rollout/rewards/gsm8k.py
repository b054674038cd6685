"""GSM8K: verl's rule exactly (verl/utils/reward_score/gsm8k.py, strict method).

The answer must follow the `#### ` marker GSM8K's solutions end with; only the last 300
characters are searched (the answer is at the end, and regexes on long strings are slow); of
several markers the last counts; commas (and `$`) are stripped; the comparison with the ground
truth is exact string equality. Note what that means, as in verl: `#### $18` has no number right
after the marker and scores 0, and `#### 18.0` is wrong for ground truth `18`.
"""

from __future__ import annotations

import re

from grpo_rollout.rewards.registry import register

_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(solution_str: str) -> str | None:
    if len(solution_str) > _CLIP_CHARS:
        solution_str = solution_str[-_CLIP_CHARS:]
    found = _STRICT.findall(solution_str)
    if not found:
        return None
    return found[-1].replace(",", "").replace("$", "")


def gsm8k_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` when right, `format_score` when formatted but wrong, 0 without an answer."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


@register("openai/gsm8k")
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return gsm8k_score(solution_str, str(ground_truth))
