"""Reward functions: verl's GSM8K rule, math-verify for math datasets, the registry, custom
functions, DAPO's overlong shaping, and the worker pool's handling of broken functions."""

from __future__ import annotations

import time

import pytest

from grpo_rollout.rewards import (RewardPool, RewardRegistry, RewardRequest, load_reward_function,
                                  overlong_penalty)
from grpo_rollout.rewards.gsm8k import gsm8k_score
from grpo_rollout.rewards.math_answer import math_score

LONG_WORKING = ("Natalia sold 48/2 = 24 clips in May. " * 20)


@pytest.mark.parametrize("response, truth, expected", [
    ("She sold 48 + 24 = 72 clips in total.\n#### 72", "72", 1.0),
    ("#### 72", "72", 1.0),
    ("The answer is 72.", "72", 0.0),                       # no #### marker: unformatted
    ("He earns 10 * 5 = 50 dollars.\n#### 60", "50", 0.0),  # formatted but wrong: format_score 0
    ("Total: 1,000 + 234 = 1,234\n#### 1,234", "1234", 1.0),  # commas stripped
    ("The temperature dropped to -5 degrees.\n#### -5", "-5", 1.0),
    ("#### $18", "18", 0.0),   # verl's regex needs a number right after "#### "
    ("It costs $18.\n#### 18", "18", 1.0),
    ("#### 3\nwait, I made a mistake\n#### 4", "4", 1.0),   # the last marker counts
    ("#### 18.0", "18", 0.0),  # exact string match, as verl
    ("#### 72\n" + LONG_WORKING, "72", 0.0),  # only the last 300 characters are searched
    (LONG_WORKING + "#### 72", "72", 1.0),
    ("####72", "72", 0.0),     # the space after the marker is part of the format
])
def test_gsm8k_is_verls_strict_rule(response, truth, expected):
    assert gsm8k_score(response, truth) == expected


def test_gsm8k_format_score_for_formatted_wrong_answers():
    assert gsm8k_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k_score("five", "6", format_score=0.1) == 0.0


@pytest.mark.parametrize("response, truth, expected", [
    ("So $x = \\frac{1}{2}$, and the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("Therefore \\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("We get \\boxed{3}", "4", 0.0),
    ("I don't know.", "4", 0.0),
    ("\\boxed{", "4", 0.0),                     # malformed: no crash, no reward
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
])
def test_math_answers_are_compared_mathematically(response, truth, expected):
    assert math_score(response, truth) == expected


def test_auto_dispatches_by_data_source():
    score = load_reward_function("auto")
    assert score("openai/gsm8k", "#### 7", "7") == 1.0
    assert score("HuggingFaceH4/MATH-500", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert score("lighteval/MATH", "\\boxed{2}", "3") == 0.0
    with pytest.raises(ValueError, match="no reward function for data_source 'my/dataset'.*openai/gsm8k"):
        score("my/dataset", "#### 7", "7")


def test_registry_refuses_duplicates_and_lists_known_names():
    registry = RewardRegistry()

    @registry.register("a", "b")
    def one(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    with pytest.raises(ValueError, match="'b' is already registered"):
        registry.register("b")(one)
    with pytest.raises(ValueError, match=r"known: \['a', 'b'\]"):
        registry.get("c")
    assert load_reward_function("auto", registry)("a", "", "") == 1.0


def test_custom_functions_from_a_file_or_a_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def exact(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.strip() == ground_truth), 'source': data_source}\n")
    fn = load_reward_function(f"{tmp_path}/my_rewards.py:exact")
    assert fn("x", " 42 ", "42") == {"score": 1.0, "source": "x"}
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_function("my_rewards:exact")("x", "41", "42")["score"] == 0.0
    for ref, message in [("my_rewards.py", "expected 'auto'"), (f"{tmp_path}/my_rewards.py:nope", "no function 'nope'"),
                         ("missing/file.py:f", "no file"), ("no_such_module:f", "can't import")]:
        with pytest.raises(ValueError, match=message):
            load_reward_function(ref)


def test_dapo_overlong_penalty():
    # maxResponseLength 20, buffer 4: lengths up to 16 are free, then -0.25 per token to -1.
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(20, 20, 4, 0.5) == -0.5
    with pytest.raises(ValueError, match="overlongBuffer.len"):
        overlong_penalty(5, 20, 0, 1.0)


BROKEN = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise KeyError("missing field")
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "none":
        return None
    if solution_str == "crash":
        os._exit(1)
    return 1.0
'''


def test_pool_scores_broken_functions_zero_and_keeps_going(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN)
    pool = RewardPool(f"{tmp_path}/broken.py:compute_score", workers=2, timeout_seconds=1.0)
    try:
        kinds = ["ok", "raise", "hang", "nan", "none", "crash", "ok"]
        started = time.monotonic()
        results = pool.score([RewardRequest("d", k, "") for k in kinds])
        assert time.monotonic() - started < 15
        assert [r.score for r in results] == [1.0, 0, 0, 0, 0, 0, 1.0]
        assert [r.error for r in results] == [None, "error", "timeout", "invalid", "invalid", "crash", None]
        assert "KeyError" in results[1].extra["reward_error"]
        # The pool replaced its dead and hung workers.
        assert [r.score for r in pool.score([RewardRequest("d", "ok", "")] * 4)] == [1.0] * 4
    finally:
        pool.close()


def test_pool_refuses_a_function_that_does_not_load(tmp_path):
    (tmp_path / "syntax.py").write_text("def f(:\n")
    with pytest.raises(ValueError, match="syntax.py.*SyntaxError"):
        RewardPool(f"{tmp_path}/syntax.py:f", workers=1, timeout_seconds=1.0)
