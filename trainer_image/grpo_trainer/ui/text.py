"""How `grpo ui` turns token ids into text when it can't always have the run's tokenizer (issue 48):
the chart's viewer starts with its job, before the first checkpoint records the model, and it
doesn't mount the job's volumes. Pages then show token ids rather than the viewer crash-looping."""

from __future__ import annotations

import time
from collections.abc import Callable
from threading import Lock

from grpo_trainer.rollouts_export import NoModelYet

RETRY_SECONDS = 60.0
"""How often a run that records no model yet is looked at again (a page view triggers it)."""


class IdsText:
    """Token ids as text ("151644 872 ..."), no tokenizer needed (`--no-text`)."""

    final = True

    def batch_decode(self, ids_lists) -> list[str]:
        return [" ".join(map(str, ids)) for ids in ids_lists]


class RunText:
    """The run's tokenizer, loaded when a page first needs it. While the run records no model
    (before its first checkpoint) pages show ids and the run is looked at again every
    `retry_seconds`; a model that can't be loaded (a folder on the job's volume, a fetch that
    fails) means ids for good, with one warning. `final`: the text won't change (a page may be cached)."""

    def __init__(self, load: Callable[[], object], *, log: Callable[[str], None],
                 retry_seconds: float = RETRY_SECONDS, clock: Callable[[], float] = time.monotonic):
        self._load, self._log, self._retry, self._clock = load, log, retry_seconds, clock
        self._decoder = None
        self._next_try = float("-inf")
        self._lock = Lock()       # pages are served from a thread pool: one load at a time

    @property
    def final(self) -> bool:
        return self._decoder is not None

    def batch_decode(self, ids_lists) -> list[str]:
        with self._lock:
            if self._decoder is None and self._clock() >= self._next_try:
                self._try_load()
        return (self._decoder or IdsText()).batch_decode(ids_lists)

    def _try_load(self) -> None:
        try:
            self._decoder = self._load()
            self._log("decoding with the run's tokenizer")
        except NoModelYet as exc:
            self._next_try = self._clock() + self._retry
            self._log(f"warning: {exc}; showing token ids, looking again in {self._retry:.0f} s")
        except (ValueError, OSError) as exc:     # a folder this pod doesn't mount, a failed fetch
            self._decoder = IdsText()
            self._log(f"warning: showing token ids (as --no-text): {exc}")
