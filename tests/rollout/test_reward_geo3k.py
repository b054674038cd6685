"""verl's geo3k scorer (hiyouga/geometry3k, the VLM examples' data source) and the colours task's,
by data_source through the default registry as the rollout server dispatches them."""

import pytest

from grpo_rollout.rewards.functions import AUTO, load_reward_function


@pytest.mark.parametrize("response, truth, expected", [
    ("<think>the legs are 3 and 4</think> so the side is \\boxed{5}", "5", 1.0),     # right and well-formed
    ("<think>half</think>\\boxed{\\frac{1}{2}}", "0.5", 1.0),                      # equal as numbers
    ("\\boxed{5}", "5", 0.9),                                                       # right, no <think>
    ("<think>x</think> \\boxed{4}", "5", 0.1),                                       # formatted, wrong
    ("<think>x</think> the answer is 5", "5", 0.0),                                 # no \boxed: no answer
    ("<think>x</think>\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),
])
def test_geo3k_is_verls_weighted_accuracy_and_format(response, truth, expected):
    score = load_reward_function(AUTO)
    assert score(data_source="hiyouga/geometry3k", solution_str=response, ground_truth=truth) == pytest.approx(expected)


@pytest.mark.parametrize("response, expected", [("red", 1.0), ("Red is it", 1.0), ("blue red", 0.0), ("", 0.0)])
def test_colours_scores_the_first_word(response, expected):
    score = load_reward_function(AUTO)
    assert score(data_source="grpo/colours", solution_str=response, ground_truth="red") == expected
