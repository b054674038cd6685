"""How the reward models' scores and the rule's (spec.reward.function) make a sample's reward
(spec.reward.combine, docs/ARCHITECTURE.md §1). DAPO's overlong penalty is added afterwards."""

from __future__ import annotations

from grpo_api.spec import RewardSpec


def combine_rewards(rule: float, model_scores: dict[str, float], spec: RewardSpec) -> float:
    """replace (verl: with a reward model on, its score is the reward): sum of weight x score;
    sum: rule + that; weighted: (ruleWeight x rule + sum of weight x score) / (ruleWeight + sum of
    weights). No reward models: the rule's score."""
    if not spec.reward_models:
        return rule
    weights = {m.name: m.weight for m in spec.reward_models}
    models = sum(weights[name] * score for name, score in model_scores.items())
    if spec.combine == "replace":
        return models
    if spec.combine == "sum":
        return rule + models
    return (spec.rule_weight * rule + models) / (spec.rule_weight + sum(weights.values()))
