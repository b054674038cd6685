"""Rollout t+1 overlapping training t (`rollout.maxStaleness: 1`), trainer rank 0's side.

Right after step t's rollouts are read, `start` runs step t+1's rollout plan (sample the prompts,
dispatch them, any dynamic-sampling rounds) in a background thread, at the policy version that
step t trains, while step t trains. `wait` is called before step t's new weights are published:
the weights must not change under a generation (the servers would refuse a request for a
version they no longer hold), and this way the dispatcher and the weight publisher are never used
by two threads at once. So between steps nothing is in flight, and validation, checkpoints and a
SIGTERM stop see at most one finished plan.

A checkpoint records where the sampler stood before the prefetched batch was drawn, and the
finished plan itself (its rollout shards are in storage): a resumed run trains on exactly the
batch an uninterrupted run would have (`Trainer._resume`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RolloutPrefetch:
    def __init__(self):
        self._step: int | None = None
        self._thread: threading.Thread | None = None
        self._plan: dict | None = None
        self._error: BaseException | None = None
        self._sampler_before: dict | None = None
        self._waited = 0.0

    def start(self, step: int, plan: Callable[[], dict], sampler_before: dict) -> None:
        """Run `plan()` (step `step`'s rollout plan) in the background. `sampler_before`: the
        sampler's state before the plan draws its prompts (what a checkpoint records)."""
        if self._step is not None:
            raise RuntimeError(f"rollouts of step {self._step} are still pending")
        self._step, self._plan, self._error, self._waited = step, None, None, 0.0
        self._sampler_before = sampler_before

        def run() -> None:
            start = time.perf_counter()
            try:
                self._plan = {**plan(), "generate_s": time.perf_counter() - start}
            except BaseException as exc:  # noqa: BLE001 - raised in the trainer's thread by `take`
                self._error = exc

        # A daemon: a trainer that fails mid-step exits without waiting for the generation.
        self._thread = threading.Thread(target=run, name=f"rollout-prefetch-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the background plan is done (its error, if any, is raised by `take`)."""
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.join()
            self._thread = None
            self._waited = time.perf_counter() - start

    def take(self, step: int) -> dict | None:
        """Step `step`'s prefetched plan, with `waited_s` (how long the trainer waited for it),
        or None when none was prefetched (the first step, staleness 0)."""
        if self._step is None:
            return None
        if self._step != step:
            raise RuntimeError(f"prefetched rollouts are for step {self._step}, not {step}")
        self.wait()
        plan, error, waited = self._plan, self._error, self._waited
        self._step = self._plan = self._error = self._sampler_before = None
        if error is not None:
            raise error
        return {**plan, "waited_s": waited}

    def restore(self, step: int, plan: dict, sampler_before: dict) -> None:
        """A finished plan from a checkpoint, for step `step`."""
        self._step, self._plan, self._error, self._waited = step, plan, None, 0.0
        self._sampler_before = sampler_before

    def checkpoint_state(self, sampler_now: dict) -> tuple[dict, dict | None]:
        """(the sampler's state before any pending batch, the pending plan or None). A failed
        plan is not kept: a resumed run draws the same prompts again and generates them."""
        if self._step is None:
            return sampler_now, None
        if self._thread is not None:
            raise RuntimeError("a checkpoint while rollouts are being generated")
        return self._sampler_before, self._plan if self._error is None else None
