"""Reward functions (verl's `compute_score` contract), their registry, the worker pool that runs
them with a time limit, and DAPO's overlong shaping."""

from grpo_rollout.rewards.functions import AUTO, load_reward_function
from grpo_rollout.rewards.overlong import overlong_penalty
from grpo_rollout.rewards.pool import ERROR_KINDS, RewardPool, RewardRequest, RewardResult
from grpo_rollout.rewards.registry import DEFAULT_REGISTRY, RewardRegistry, register

__all__ = ["AUTO", "DEFAULT_REGISTRY", "ERROR_KINDS", "RewardPool", "RewardRegistry", "RewardRequest",
           "RewardResult", "load_reward_function", "overlong_penalty", "register"]
