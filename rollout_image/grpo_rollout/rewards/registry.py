"""Reward functions by data source: a registry object plus `@register` on a module default
(STYLE.md: registries are objects; duplicates refused; unknown names list the known ones).

Every function has verl's signature: `compute_score(data_source, solution_str, ground_truth,
extra_info=None, **kwargs) -> float | dict` (a dict carries the score under "score" and extra
fields), and is called with keyword arguments. A name ending in `*` is a prefix (verl's `aime*`);
an exact name wins over a prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., Any]


class RewardRegistry:
    def __init__(self) -> None:
        self._fns: dict[str, RewardFn] = {}

    def register(self, *data_sources: str) -> Callable[[RewardFn], RewardFn]:
        """Decorator: score the named data sources with the decorated function."""
        if not data_sources:
            raise ValueError("register() needs at least one data_source")

        def add(fn: RewardFn) -> RewardFn:
            for name in data_sources:
                if name in self._fns:
                    raise ValueError(f"reward for data_source {name!r} is already registered "
                                     f"({self._fns[name].__module__}.{self._fns[name].__qualname__})")
            for name in data_sources:
                self._fns[name] = fn
            return fn
        return add

    def get(self, data_source: str) -> RewardFn:
        if data_source in self._fns:
            return self._fns[data_source]
        prefixes = sorted((n for n in self._fns if n.endswith("*") and data_source.startswith(n[:-1])), key=len)
        if prefixes:
            return self._fns[prefixes[-1]]
        raise ValueError(f"no reward function for data_source {data_source!r}; known: {sorted(self._fns)}. "
                         f"Set spec.reward.function to 'module:function' or 'file.py:function' for others.")

    def known(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, data_source: str) -> bool:
        try:
            self.get(data_source)
        except ValueError:
            return False
        return True


DEFAULT_REGISTRY = RewardRegistry()
register = DEFAULT_REGISTRY.register
