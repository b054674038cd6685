"""Name -> function registries for pluggable algorithms (advantage estimators, policy losses).

Modelled on verl's ``verl/workers/reward_manager/registry.py`` (a dict plus ``@register(name)``),
but strict where verl is lax: registering a name twice raises instead of silently overwriting, and
an unknown name raises with the list of known ones, so a typo in a job spec fails loudly.

A ``Registry`` is a plain object; the two module-level instances are only the defaults that the
built-in algorithms register into. Callers that want isolation (tests, plugins) pass their own
``Registry`` to ``compute_advantages(..., registry=)`` / ``policy_loss(..., registry=)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named collection of functions of one kind (e.g. "advantage estimator")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@registry.register("grpo")``. Raises ValueError if ``name`` is taken."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string (got {name!r})")

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {_qualname(self._entries[name])}); "
                    f"pick another name or use a separate Registry"
                )
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; ValueError listing the known names otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


ADV_ESTIMATORS: Registry = Registry("advantage estimator")
"""Default registry of advantage estimators (see ``advantages.py`` for the calling convention)."""

POLICY_LOSSES: Registry = Registry("policy loss")
"""Default registry of policy losses (see ``losses.py`` for the calling convention)."""


# verl's spellings, so `@register_adv_est("my_est")` reads the same as in a verl recipe.
def register_adv_est(name: str) -> Callable[[F], F]:
    return ADV_ESTIMATORS.register(name)


def get_adv_estimator_fn(name: str) -> Callable:
    return ADV_ESTIMATORS.get(name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    return POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> Callable:
    return POLICY_LOSSES.get(name)
