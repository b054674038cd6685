"""Competition math (MATH, MATH-500): the answer in the response (preferably in
`\\boxed{}`) is compared with the ground truth by math-verify, which parses both into sympy and
checks equivalence, so `\\boxed{\\frac{1}{2}}` matches `0.5` (as verl's math_verify scorer, which verl's
default_compute_score suggests for these data sources over its string-matching math_reward). DAPO's
data sources (math_dapo, math, aime*) have verl's own rule: math_dapo.py."""

from __future__ import annotations

from grpo_rollout.rewards.registry import register

MATH_DATA_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
)

_verifier = None


def _verify():
    global _verifier
    if _verifier is None:  # math-verify pulls in sympy: import it where it's used
        from math_verify.metric import math_metric
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

        _verifier = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                                pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    return _verifier


def math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response's final answer equals the ground truth mathematically, else 0.0."""
    gold = ground_truth if "\\boxed" in ground_truth else "\\boxed{" + ground_truth + "}"
    try:
        score, _ = _verify()([gold], [solution_str])
    except Exception:  # math-verify raises on unparsable input and its own parse timeouts
        return 0.0
    return float(score)


@register(*MATH_DATA_SOURCES)
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return math_score(solution_str, str(ground_truth))
