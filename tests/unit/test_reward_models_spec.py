"""Reward models (issue 31): the spec's field-named errors, the combination rules, the judge's
parsers on hand-written answers, token batching, and `grpo from-verl` of verl's reward-model keys."""

import math

import pytest

from grpo_api.from_verl import translate
from grpo_api.jobfile import JobError, parse_job
from grpo_api.spec import RewardSpec
from grpo_api.verl_command import read_command
from grpo_rollout.reward_models import batches_by_tokens, fill_template, parse_tag_score, parse_yes_no, ScoreInput
from grpo_rollout.rewards.combine import combine_rewards


def job(reward: dict) -> dict:
    return {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "x"},
            "spec": {"model": {"path": "/m"}, "data": {"trainFiles": ["/t.parquet"]}, "reward": reward}}


@pytest.mark.parametrize("reward, error", [
    ({"rewardModels": [{"name": "j", "kind": "judge", "path": "/j"}]},
     "spec.reward.rewardModels[0]: promptTemplate: required for kind judge"),
    ({"rewardModels": [{"name": "j", "kind": "judge", "path": "/j", "promptTemplate": "rate {prompt}"}]},
     "spec.reward.rewardModels[0]: promptTemplate: required for kind judge, and must contain {response}"),
    ({"rewardModels": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]},
     "spec.reward.rewardModels: names must be unique (twice: a)"),
    ({"rewardModels": [{"name": "Bad_Name", "path": "/a"}]}, "spec.reward.rewardModels[0].name: must match"),
    ({"rewardModels": [{"name": "a", "path": "/a", "weight": -1}]}, "spec.reward.rewardModels[0].weight"),
    ({"rewardModels": [{"name": "a", "path": "/a", "weight": 0}], "combine": "weighted", "ruleWeight": 0},
     "spec.reward.ruleWeight: ruleWeight and every reward model's weight are 0"),
    ({"rewardModels": [{"name": "a", "path": "/a", "replicas": 0}]}, "spec.reward.rewardModels[0].replicas"),
    ({"combine": "average"}, "spec.reward.combine"),
])
def test_bad_reward_models_are_refused_naming_the_field(reward, error):
    with pytest.raises(JobError) as exc:
        parse_job(job(reward))
    assert any(e.startswith(error) for e in exc.value.errors), exc.value.errors


def test_a_judge_and_a_classifier_are_accepted():
    spec = parse_job(job({"rewardModels": [
        {"name": "rm", "path": "/rm"},
        {"name": "judge", "kind": "judge", "path": "/j", "engine": "hf", "parser": "yes_no",
         "promptTemplate": "Is {response} right for {prompt}? ({ground_truth})"}]})).spec
    assert [m.kind for m in spec.reward.reward_models] == ["classifier", "judge"]
    assert spec.reward.combine == "replace"        # verl's: with a reward model on, its score is the reward


def _reward(combine, rule_weight=1.0):
    return RewardSpec.model_validate({"combine": combine, "ruleWeight": rule_weight, "rewardModels": [
        {"name": "a", "path": "/a", "weight": 2.0}, {"name": "b", "path": "/b", "weight": 0.5}]})


def test_combination_rules_by_hand():
    scores = {"a": 0.25, "b": -1.0}                 # 2 x 0.25 + 0.5 x -1 = 0
    assert combine_rewards(1.0, scores, _reward("replace")) == pytest.approx(0.0)
    assert combine_rewards(1.0, scores, _reward("sum")) == pytest.approx(1.0)
    # (3 x 1 + 0) / (3 + 2 + 0.5)
    assert combine_rewards(1.0, scores, _reward("weighted", 3.0)) == pytest.approx(3 / 5.5)
    assert combine_rewards(0.7, {}, RewardSpec()) == 0.7   # no reward models: the rule


@pytest.mark.parametrize("text, score", [
    ("The answer is fine. <score>7</score>", 7.0),
    ("<score> 8.5 </score>", 8.5),
    ("first <score>2</score> then I reconsider: <score>-3</score>", -3.0),
    ("<score>1e1</score>", 10.0),
    ("score: 7", None),
    ("<score>seven</score>", None),
    ("<rating>7</rating>", None),
    ("<score>7", None),
])
def test_tag_parser(text, score):
    assert parse_tag_score(text, "score") == score


def test_tag_parser_other_tag():
    assert parse_tag_score("<grade>4</grade><score>1</score>", "grade") == 4.0


def test_yes_no_parser():
    assert parse_yes_no(" Yes", math.log(0.9)) == pytest.approx(0.9)
    assert parse_yes_no("no.", math.log(0.8)) == pytest.approx(0.2)
    assert parse_yes_no("maybe", math.log(0.99)) is None


def test_template_fills_only_its_placeholders():
    item = ScoreInput([{"role": "user", "content": "2+2?"}], "4", "4")
    assert fill_template('Q: {prompt} A: {response} truth={ground_truth} json={"k": 1} {other}', item) == \
        'Q: 2+2? A: 4 truth=4 json={"k": 1} {other}'


def test_batches_by_tokens_stay_in_budget_and_cover_everything():
    lengths = [5, 30, 12, 12, 3, 40, 7]
    batches = batches_by_tokens(lengths, 48)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 48


def _translate(args: str):
    return translate(read_command("python3 -m verl.trainer.main_ppo data.train_files=/t.parquet "
                                        "actor_rollout_ref.model.path=/m " + args))


def test_verl_09_skywork_example_translates_to_a_classifier():
    t = _translate("reward.num_workers=8 reward.reward_model.enable=True "
                   "reward.reward_model.model_path=Skywork/Skywork-Reward-Llama-3.1-8B "
                   "reward.reward_model.rollout.name=vllm reward.reward_model.rollout.prompt_length=8192 "
                   "reward.reward_model.rollout.response_length=4096")
    assert not t.errors, t.errors
    rm = t.job.spec.reward.reward_models
    assert [(m.name, m.kind, m.path, m.max_length) for m in rm] == [
        ("rm", "classifier", "Skywork/Skywork-Reward-Llama-3.1-8B", 12288)]
    assert t.job.spec.reward.workers == 8 and t.job.spec.reward.combine == "replace"


def test_verl_old_layout_translates():
    t = _translate("reward_model.enable=True reward_model.model.path=/rm")
    assert not t.errors, t.errors
    assert t.job.spec.reward.reward_models[0].path == "/rm"


@pytest.mark.parametrize("args, error", [
    ("reward_model.enable=True", "a reward model needs reward_model.model.path"),
    ("reward.reward_model.enable=True", "a reward model needs reward.reward_model.model_path"),
    ("reward.reward_model.enable=True reward.reward_model.model_path=/rm "
     "reward.custom_reward_function.path=/f.py", "verl's reward router"),
    ("reward.reward_manager.name=batch", "per-sample managers only"),
    ("reward.sandbox_fusion.url=http://x", "can't honour"),
])
def test_verl_reward_features_that_cant_be_honoured_are_errors(args, error):
    t = _translate(args)
    assert t.job is None and any(error in e for e in t.errors), t.errors


def test_reward_model_off_is_quiet():
    t = _translate("reward.reward_model.enable=False reward_model.enable=False")
    assert not t.errors and not t.job.spec.reward.reward_models


def test_kubernetes_accepts_reward_models():
    """The operator serves them (a Deployment and Service per model): no Kubernetes-only rule refuses them."""
    from grpo_api.spec import KUBERNETES_RULES
    spec = parse_job(job({"rewardModels": [{"name": "rm", "path": "/rm"}]})).spec
    assert not [e for rule in KUBERNETES_RULES if (e := rule.check(spec)) and "rewardModels" in e]
