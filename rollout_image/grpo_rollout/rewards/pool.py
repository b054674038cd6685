"""Reward scoring in a pool of worker processes, with a time limit per call.

User reward code runs here, never in the server process: a function that raises, hangs, crashes
its process or returns garbage gives reward 0 for that sample, is counted by kind, and is logged
once per kind and exception type; the server goes on. A worker that overruns its time limit is
killed and replaced (pebble does that), so a hung function costs `timeout` seconds, not a worker.
Workers are spawned, not forked: the server process holds threads (gRPC, torch) that fork would
copy in an undefined state.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import numbers
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from pebble import ProcessExpired, ProcessPool

log = logging.getLogger(__name__)

ERROR_KINDS = ("error", "timeout", "invalid", "crash")
"""raised an exception; overran the time limit; returned something that is not a score;
killed its worker process."""


@dataclass(frozen=True)
class RewardRequest:
    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict | None = None


@dataclass
class RewardResult:
    score: float
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """One of ERROR_KINDS when the function failed (score is then 0)."""


def normalize_result(out: Any) -> tuple[float, dict[str, Any]]:
    """verl's contract: a number, or a dict with the number under "score" and extra fields.
    Anything else is a ValueError."""
    extra: dict[str, Any] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"returned a dict without 'score' (keys: {sorted(map(str, out))[:10]})")
        extra = {str(k): v for k, v in out.items() if k != "score"}
        out = out["score"]
    if isinstance(out, bool) or not isinstance(out, numbers.Real):
        raise ValueError(f"returned {type(out).__name__}, not a number")
    score = float(out)
    if not math.isfinite(score):
        raise ValueError(f"returned {score}")
    # Extra fields end up in a JSON column: make sure they serialize.
    return score, json.loads(json.dumps(extra, default=repr))


# -- what runs in the worker processes ------------------------------------------------------

_functions: dict[str, Any] = {}


def _function(ref: str):
    if ref not in _functions:
        from grpo_rollout.rewards.functions import load_reward_function
        _functions[ref] = load_reward_function(ref)
    return _functions[ref]


def _check_in_worker(ref: str) -> str | None:
    try:
        _function(ref)
    except Exception as exc:
        return str(exc)
    return None


def _score_in_worker(ref: str, req: RewardRequest) -> tuple[str, Any, Any]:
    try:
        out = _function(ref)(req.data_source, req.solution_str, req.ground_truth, req.extra_info)
    except Exception as exc:  # user code: any exception is the function's failure, not ours
        return "error", type(exc).__name__, f"{type(exc).__name__}: {exc}"
    try:
        score, extra = normalize_result(out)
    except ValueError as exc:
        return "invalid", "ValueError", str(exc)
    return "ok", score, extra


# -- the pool -------------------------------------------------------------------------------

class RewardPool:
    def __init__(self, function: str, *, workers: int, timeout_seconds: float, startup_timeout: float = 120.0):
        """Start the workers and load `function` in one of them: a bad reference (missing
        file, import error, no such function) is a ValueError here, before any request."""
        self.function = function
        self._timeout = timeout_seconds
        self._logged: set[tuple[str, str]] = set()
        self._pool = ProcessPool(max_workers=workers, context=multiprocessing.get_context("spawn"))
        try:
            problem = self._pool.schedule(_check_in_worker, args=(function,)).result(timeout=startup_timeout)
        except BaseException:
            self.close()
            raise
        if problem:
            self.close()
            raise ValueError(problem)

    def score(self, requests: list[RewardRequest]) -> list[RewardResult]:
        """Scores in request order; never raises for a failing reward function."""
        futures = [self._pool.schedule(_score_in_worker, args=(self.function, r), timeout=self._timeout)
                   for r in requests]
        return [self._collect(f) for f in futures]

    def _collect(self, future) -> RewardResult:
        try:
            status, a, b = future.result()
        except FutureTimeout:
            return self._failed("timeout", "TimeoutError", f"took longer than {self._timeout:g}s (spec.reward.timeoutSeconds)")
        except ProcessExpired as exc:
            return self._failed("crash", "ProcessExpired", f"the worker process died (exit code {exc.exitcode})")
        except Exception as exc:  # e.g. a result that can't be pickled back
            return self._failed("error", type(exc).__name__, f"{type(exc).__name__}: {exc}")
        if status == "ok":
            return RewardResult(score=a, extra=b)
        return self._failed(status, a, b)

    def _failed(self, kind: str, exc_type: str, message: str) -> RewardResult:
        if (kind, exc_type) not in self._logged:
            self._logged.add((kind, exc_type))
            log.warning("reward function %s: %s (scored 0; further %s/%s failures are only counted in "
                        "grpo_rollout_reward_errors_total)", self.function, message, kind, exc_type)
        return RewardResult(score=0.0, extra={"reward_error": message}, error=kind)

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=10)
