"""Turn `spec.reward.function` into a callable with verl's signature.

- "auto": dispatch on `data_source` through the registry (GSM8K, the math datasets).
- "package.module:function": an importable module (e.g. shipped in the rollout image).
- "path/to/file.py:function": a file, loaded as a module as verl's `custom_reward_function`
  does (on Kubernetes, typically a ConfigMap mounted into the rollout pods).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import partial
from pathlib import Path

from grpo_rollout.rewards.registry import DEFAULT_REGISTRY, RewardFn, RewardRegistry

AUTO = "auto"


def _register_builtins() -> None:
    # Importing the modules runs their @register decorators on the default registry.
    from grpo_rollout.rewards import gsm8k, math_answer  # noqa: F401


def dispatch_by_data_source(data_source, solution_str, ground_truth, extra_info=None, *, registry: RewardRegistry):
    return registry.get(data_source)(data_source, solution_str, ground_truth, extra_info)


def load_reward_function(ref: str, registry: RewardRegistry | None = None) -> RewardFn:
    """The callable `ref` names; a ValueError says what is wrong with `ref`."""
    if ref == AUTO:
        if registry is None:
            _register_builtins()
            registry = DEFAULT_REGISTRY
        return partial(dispatch_by_data_source, registry=registry)
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"spec.reward.function {ref!r}: expected 'auto', 'module:function' or 'path/file.py:function'")
    module = _load_file(target, ref) if target.endswith(".py") or "/" in target else _import(target, ref)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"spec.reward.function {ref!r}: {target} has no function {name!r}")
    return fn


def _import(module_name: str, ref: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"spec.reward.function {ref!r}: can't import {module_name}: {exc}") from None


def _load_file(path: str, ref: str):
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"spec.reward.function {ref!r}: no file {file.absolute()}")
    # verl registers the file as `custom_module`; a name derived from the path lets two
    # different files coexist.
    module_name = f"grpo_custom_reward_{abs(hash(str(file.absolute())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"spec.reward.function {ref!r}: loading {file} failed: {type(exc).__name__}: {exc}") from None
    return module
