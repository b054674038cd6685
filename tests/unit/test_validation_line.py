"""The console's validation line (grpo_trainer.validation.validation_line): the tutorial's accuracy
where rewards are right/wrong, the mean reward otherwise (never a reward model's score as a %)."""

from grpo_trainer.validation import validation_line


def test_right_or_wrong_rewards_read_as_the_tutorials_accuracy():
    assert validation_line([1.0, 0.0, 0.0, 1.0, 1.0]) == "Validation accuracy: 60.0%"
    assert validation_line([0.0, 0.0]) == "Validation accuracy: 0.0%"


def test_other_rewards_read_as_the_mean_score_not_a_percentage():
    assert validation_line([3.25, -1.5]) == "Validation score: 0.8750 (the mean reward)"        # a reward model
    assert validation_line([1.0, -1.0, 1.0, 1.0]) == "Validation score: 0.5000 (the mean reward)"  # math_dapo's +-1
    assert validation_line([0.5, 1.0]) == "Validation score: 0.7500 (the mean reward)"           # partial credit
