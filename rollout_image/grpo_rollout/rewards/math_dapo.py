"""DAPO's math rule, with verl's values: +1 for a right answer, -1 for a wrong or missing one
(not 1/0: DAPO's overlong penalty is weighed against that spread), and the extra fields `acc`
(right or not) and `pred` (the answer read). verl routes the data sources `math_dapo`, `math`,
`math_dapo_reasoning` and every `aime*` here (verl/utils/reward_score/__init__.py,
default_compute_score).

The answer is read from the last 300 characters: first the last `Answer: ...` line, compared with
the ground truth after the Minerva normalisation (Lewkowycz et al. 2022, as in lm-evaluation-harness'
hendrycks_math); without one, the last `\\boxed{...}` of the last 100 characters, compared with the
ground truth as written.
"""

from __future__ import annotations

import re

from grpo_rollout.rewards.registry import register

DAPO_DATA_SOURCES = ("math_dapo", "math", "math_dapo_reasoning", "aime*")

_INVALID = "[INVALID]"
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normalisation: these replacements in this order, then these strings removed.
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVE = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
           "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
           "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
           "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
           r",\!", "{,}", '"', "\\dots")
_UNWRAP = (  # (pattern, replacement), applied in order
    (r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"),          # the first $...$ of the answer
    (r"(\\text\{)(.*?)(\})", "\\2"),
    (r"(\\textbf\{)(.*?)(\})", "\\2"),
    (r"(\\overline\{)(.*?)(\})", "\\2"),
    (r"(\\boxed\{)(.*)(\})", "\\2"),
    (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),        # \frac12 -> \frac{1}{2}
    (r"(sqrt)([^{])", "sqrt{\\2}"),                # \sqrt2 -> \sqrt{2}
)


def normalize_answer(answer: str) -> str:
    answer = answer.split("=")[-1]
    for old, new in _REPLACE:
        answer = answer.replace(old, new)
    for text in _REMOVE:
        answer = answer.replace(text, "")
    for pattern, replacement in _UNWRAP:
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():          # 1,000 -> 1000
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), None without a closed one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


def dapo_verify(solution_str: str, ground_truth: str) -> tuple[bool, str]:
    """(right, the answer read) on the response's tail."""
    tail = solution_str[-300:]     # verl: the longest answer in MATH-500 has 159 characters
    lines = _ANSWER_LINE.findall(tail)
    if lines:
        pred = normalize_answer(lines[-1])
        if pred != _INVALID:
            return pred == normalize_answer(ground_truth), pred
    boxed = last_boxed(tail[-100:])
    if boxed is not None:
        return boxed == ground_truth, boxed
    return normalize_answer(ground_truth) == _INVALID, _INVALID   # verl's comparison, kept as is


def dapo_score(solution_str: str, ground_truth: str) -> dict:
    right, pred = dapo_verify(solution_str, ground_truth)
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": pred}


@register(*DAPO_DATA_SOURCES)
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return dapo_score(solution_str, str(ground_truth))
