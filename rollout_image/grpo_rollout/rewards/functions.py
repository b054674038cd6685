"""Turn `spec.reward.function` into a callable with verl's signature.

- "auto": dispatch on `data_source` through the registry, as verl's default_compute_score routes
  (GSM8K; DAPO's math rule for math_dapo, math, aime*; math-verify for the MATH datasets); a data
  source with no rule is an error, as in verl (NotImplementedError there).
- "package.module:function": an importable module (e.g. shipped in the rollout image).
- "path/to/file.py:function": a file, loaded as a module as verl's `custom_reward_function`
  does (on Kubernetes, typically a ConfigMap mounted into the rollout pods).
"""

from __future__ import annotations

from functools import partial

from grpo_rollout.loading import load_attribute
from grpo_rollout.rewards.registry import DEFAULT_REGISTRY, RewardFn, RewardRegistry

AUTO = "auto"


def _register_builtins() -> None:
    # Importing the modules runs their @register decorators on the default registry.
    from grpo_rollout.rewards import colours, geo3k, gsm8k, math_answer, math_dapo  # noqa: F401


def dispatch_by_data_source(data_source, solution_str, ground_truth, extra_info=None, *, registry: RewardRegistry,
                            **kwargs):
    return registry.get(data_source)(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                                     extra_info=extra_info, **kwargs)


def load_reward_function(ref: str, registry: RewardRegistry | None = None) -> RewardFn:
    """The callable `ref` names; a ValueError says what is wrong with `ref`."""
    if ref == AUTO:
        if registry is None:
            _register_builtins()
            registry = DEFAULT_REGISTRY
        return partial(dispatch_by_data_source, registry=registry)
    if ":" not in ref:
        raise ValueError(f"spec.reward.function {ref!r}: expected 'auto', 'module:function' or 'path/file.py:function'")
    fn = load_attribute(ref, "spec.reward.function")
    if not callable(fn):
        raise ValueError(f"spec.reward.function {ref!r}: {ref.rpartition(':')[0]} has no function "
                         f"{ref.rpartition(':')[2]!r}")
    return fn

