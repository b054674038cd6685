"""What the trainer makes of the rewards in its rollout records, beyond the reward itself: the
reward function's failures (counted in every step's and every validation's metrics, said once,
and past spec.reward.maxErrorFraction the end of the run, as verl stops on an exception in
compute_score), and the reward models' and the rule's own scores (issue 48, items 1 and 7).

Everything here is computed from the samples alone, so every rank reaches the same decision at
the same step without a collective.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter
from typing import TYPE_CHECKING

from grpo_api.records import REWARD_ERROR_KINDS

if TYPE_CHECKING:
    from grpo_trainer.batch import Sample

log = logging.getLogger("grpo.trainer")


class RewardFunctionFailed(RuntimeError):
    """The reward function failed for more of a step's samples than spec.reward.maxErrorFraction
    allows (unset: for all of them): bad input (the function or the data), which retrying can't
    fix (exit code 2)."""


def failure_counts(samples: list[Sample]) -> dict[str, int]:
    """reward/errors/<kind>: samples whose reward function failed, by kind, every kind (0 too)."""
    counts = Counter(s.reward_error for s in samples if s.reward_error)
    return {f"reward/errors/{kind}": counts.get(kind, 0) for kind in REWARD_ERROR_KINDS}


def failure_fraction(samples: list[Sample]) -> float:
    """reward/error_fraction: the share of the samples whose reward function failed (0 of none)."""
    return sum(bool(s.reward_error) for s in samples) / len(samples) if samples else 0.0


def _message(sample: Sample) -> str:
    # The rollout server records "<function>: <exception type>: <message>".
    return str((sample.reward_extra or {}).get("reward_error") or f"{sample.reward_error} (no message recorded)")


def _kinds(failed: list[Sample]) -> str:
    """'exception 2, invalid 1'"""
    return ", ".join(f"{k.rsplit('/', 1)[1]} {n}" for k, n in failure_counts(failed).items() if n)


class ValidationFailureNote:
    """The reward function's failures on validation rollouts (each scored 0 in val/score): counted
    by kind at every validation, said once on the console. Never the end of the run: training's
    own samples decide that (RewardFailureCheck)."""

    def __init__(self):
        self._said = False

    def counts(self, step: int, samples: list[Sample]) -> dict[str, int]:
        """val/reward_errors/<kind>, every kind (0 too), for the validation after step `step`."""
        failed = [s for s in samples if s.reward_error]
        if failed and not self._said:
            self._said = True
            log.warning("The reward function failed for %d of %d validation samples at step %d (%s; each scored 0 "
                        "in val/score; counted in val/reward_errors/* from now on, not said again); the first: %s",
                        len(failed), len(samples), step, _kinds(failed), _message(failed[0]))
        return {f"val/reward_errors/{k.rsplit('/', 1)[1]}": n for k, n in failure_counts(samples).items()}


class RewardFailureCheck:
    """Says the first failure once (on rank 0) and stops the run past the allowed fraction."""

    def __init__(self, max_fraction: float | None, *, say: bool):
        self.max_fraction, self.say = max_fraction, say
        self._said = False

    def exceeded(self, samples: list[Sample]) -> bool:
        failed = sum(bool(s.reward_error) for s in samples)
        if self.max_fraction is None:       # the default: a function that failed for every sample
            return bool(samples) and failed == len(samples)
        return bool(samples) and failed / len(samples) > self.max_fraction

    def _allowed(self) -> str:
        return ("spec.reward.maxErrorFraction (unset: all but every sample) allows" if self.max_fraction is None
                else f"spec.reward.maxErrorFraction {self.max_fraction:g} allows")

    def check(self, step: int, samples: list[Sample]) -> None:
        """`samples`: every sample generated for step `step`. Raises RewardFunctionFailed."""
        failed = [s for s in samples if s.reward_error]
        if not failed:
            return
        counts = _kinds(failed)
        if self.exceeded(samples):
            raise RewardFunctionFailed(
                f"the reward function failed for {len(failed)} of {len(samples)} samples of step {step} ({counts}), "
                f"more than {self._allowed()}; the first: "
                f"{_message(failed[0])}")
        if self.say and not self._said:
            self._said = True
            log.warning("The reward function failed for %d of %d samples of step %d (%s; each scored 0, as many as "
                        "%s; counted in reward/errors/* from now on, not said again); the first: %s",
                        len(failed), len(samples), step, counts, self._allowed(), _message(failed[0]))


def score_means(samples: list[Sample]) -> dict[str, float]:
    """The reward models' scores (rm/<name>/mean), the share of a judge's outputs its parser read
    (rm/<name>/parsed) and the rule's score (rule_score/mean), from reward_extra; {} without
    reward models."""
    values: dict[str, list[float]] = {}
    for s in samples:
        for key, v in (s.reward_extra or {}).items():
            if (key == "rule_score" or key.startswith("rm/")) and isinstance(v, (int, float)) and math.isfinite(v):
                values.setdefault(key, []).append(float(v))
    return {(k if k.endswith("/parsed") else f"{k}/mean"): statistics.fmean(v) for k, v in sorted(values.items())}
