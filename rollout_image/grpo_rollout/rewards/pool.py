"""Reward scoring in a pool of worker processes, with a time limit per call.

User reward code runs here, never in the server process: a function that raises, hangs, crashes
its process or returns garbage gives reward 0 for that sample, is counted by kind (the rollout
record's `reward_error` column, which the trainer counts and stops on past
spec.reward.maxErrorFraction), and is logged once per kind and exception type; the server goes on.

Functions are called as verl's reward managers call them: keyword arguments (data_source=,
solution_str=, ground_truth=, extra_info=, then spec.reward.kwargs, verl's
custom_reward_function.reward_kwargs, which take precedence). An `async def` function is awaited:
a worker takes a slice of the requests and runs up to spec.reward.concurrency of its calls at once.

A worker that overruns its time limit is killed and replaced (pebble does that), so a hung
function costs `timeout` seconds, not a worker.
Workers are spawned, not forked: the server process holds threads (gRPC, torch) that fork would
copy in an undefined state.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import multiprocessing
import numbers
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from pebble import ProcessExpired, ProcessPool

from grpo_api.records import REWARD_ERROR_KINDS

log = logging.getLogger(__name__)

ERROR_KINDS = REWARD_ERROR_KINDS   # the rollout record's reward_error values


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
    """verl's contract: a number (bool, int or float, as verl's default_compute_score takes), or a
    dict with the number under "score" and extra fields. Anything else is a ValueError: verl would
    fail on it later (a tensor can't hold "1.0"), never score it."""
    extra: dict[str, Any] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"returned a dict without 'score' (keys: {sorted(map(str, out))[:10]})")
        extra = {str(k): v for k, v in out.items() if k != "score"}
        out = out["score"]
    if not isinstance(out, numbers.Real):
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


def _check_in_worker(ref: str) -> tuple[str | None, bool]:
    """(what is wrong with `ref` or None, whether it is an `async def` function)."""
    try:
        fn = _function(ref)
    except Exception as exc:
        return str(exc), False
    return None, inspect.iscoroutinefunction(fn)


def _call(fn, req: RewardRequest, kwargs: dict):
    # verl's call: keywords only, the job's reward kwargs last (they win, as in verl's
    # _call_with_kwargs).
    return fn(**{"data_source": req.data_source, "solution_str": req.solution_str,
                 "ground_truth": req.ground_truth, "extra_info": req.extra_info, **kwargs})


def _outcome(out: Any) -> tuple[str, Any, Any]:
    try:
        score, extra = normalize_result(out)
    except ValueError as exc:
        return "invalid", "ValueError", str(exc)
    return "ok", score, extra


def _raised(exc: BaseException) -> tuple[str, Any, Any]:
    return "exception", type(exc).__name__, f"{type(exc).__name__}: {exc}"


def _score_in_worker(ref: str, req: RewardRequest, kwargs: dict) -> tuple[str, Any, Any]:
    try:
        out = _call(_function(ref), req, kwargs)
        if inspect.isawaitable(out):      # e.g. a sync wrapper returning a coroutine
            out = asyncio.run(_awaited(out))
    except Exception as exc:  # user code: any exception is the function's failure, not ours
        return _raised(exc)
    return _outcome(out)


async def _awaited(awaitable):
    return await awaitable


def _score_async_in_worker(ref: str, reqs: list[RewardRequest], kwargs: dict, concurrency: int,
                           timeout: float) -> list[tuple[str, Any, Any]]:
    """An `async def` function's calls on one event loop, `concurrency` at a time, each under
    its own time limit."""
    fn = _function(ref)

    async def one(req: RewardRequest, gate: asyncio.Semaphore) -> tuple[str, Any, Any]:
        async with gate:
            try:
                out = await asyncio.wait_for(_call(fn, req, kwargs), timeout)
            except asyncio.TimeoutError:
                return "timeout", "TimeoutError", f"took longer than {timeout:g}s (spec.reward.timeoutSeconds)"
            except Exception as exc:  # user code
                return _raised(exc)
        return _outcome(out)

    async def run() -> list[tuple[str, Any, Any]]:
        gate = asyncio.Semaphore(concurrency)
        return list(await asyncio.gather(*(one(r, gate) for r in reqs)))

    return asyncio.run(run())


# -- the pool -------------------------------------------------------------------------------

class RewardPool:
    def __init__(self, function: str, *, workers: int, timeout_seconds: float, startup_timeout: float = 120.0,
                 kwargs: dict | None = None, concurrency: int = 16):
        """Start the workers and load `function` in one of them: a bad reference (missing
        file, import error, no such function) is a ValueError here, before any request.
        kwargs: spec.reward.kwargs; concurrency: spec.reward.concurrency (async functions)."""
        self.function = function
        self._timeout = timeout_seconds
        self._kwargs = dict(kwargs or {})
        self._concurrency = concurrency
        self._workers = workers
        self._logged: set[tuple[str, str]] = set()
        self._pool = ProcessPool(max_workers=workers, context=multiprocessing.get_context("spawn"))
        try:
            problem, self.is_async = self._pool.schedule(_check_in_worker, args=(function,)).result(
                timeout=startup_timeout)
        except BaseException:
            self.close()
            raise
        if problem:
            self.close()
            raise ValueError(problem)

    def score(self, requests: list[RewardRequest]) -> list[RewardResult]:
        """Scores in request order; never raises for a failing reward function."""
        if self.is_async:
            return self._score_async(requests)
        futures = [self._pool.schedule(_score_in_worker, args=(self.function, r, self._kwargs), timeout=self._timeout)
                   for r in requests]
        return [self._collect(f) for f in futures]

    def _score_async(self, requests: list[RewardRequest]) -> list[RewardResult]:
        """One slice of the requests per worker, each slice's calls concurrent on its event loop.
        The slice's own limit only catches a function that blocks its loop (time.sleep in an
        async def): each call has its own limit inside."""
        per = -(-len(requests) // self._workers) if requests else 1
        slices = [requests[k:k + per] for k in range(0, len(requests), per)]
        futures = [self._pool.schedule(_score_async_in_worker,
                                       args=(self.function, s, self._kwargs, self._concurrency, self._timeout),
                                       timeout=self._timeout * (-(-len(s) // self._concurrency) + 1))
                   for s in slices]
        out = []
        for s, f in zip(slices, futures):
            try:
                outcomes = f.result()
            except Exception:
                out += [self._collect(f) for _ in s]     # the whole slice failed the same way
                continue
            out += [self._result(*o) for o in outcomes]
        return out

    def _collect(self, future) -> RewardResult:
        try:
            status, a, b = future.result()
        except FutureTimeout:
            return self._failed("timeout", "TimeoutError", f"took longer than {self._timeout:g}s (spec.reward.timeoutSeconds)")
        except ProcessExpired as exc:
            return self._failed("crash", "ProcessExpired", f"the worker process died (exit code {exc.exitcode})")
        except Exception as exc:  # e.g. a result that can't be pickled back
            return self._failed("exception", type(exc).__name__, f"{type(exc).__name__}: {exc}")
        return self._result(status, a, b)

    def _result(self, status: str, a, b) -> RewardResult:
        if status == "ok":
            return RewardResult(score=a, extra=b)
        return self._failed(status, a, b)

    def _failed(self, kind: str, exc_type: str, message: str) -> RewardResult:
        if (kind, exc_type) not in self._logged:
            self._logged.add((kind, exc_type))
            log.warning("reward function %s: %s (scored 0; further %s/%s failures are only counted in "
                        "grpo_rollout_reward_errors_total and the records' reward_error)", self.function, message,
                        kind, exc_type)
        # The record carries the function's name with the message: the trainer says it once.
        return RewardResult(score=0.0, extra={"reward_error": f"{self.function}: {message}"}, error=kind)

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=10)
