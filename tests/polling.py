"""The one polling loop of the tests: wait until a check holds, or fail the test saying what was
awaited. Controllers, servers and trainers act asynchronously and the machines are loaded:
tests wait for a state to converge, never assert once on a race.

Imported as `polling` from every test folder (tests/ is on sys.path: the root conftest.py is
not in a package). The folders' own names for it (operator_helpers.eventually,
e2e_helpers.wait_for, integration_helpers.wait_until, ...) call this one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float = 30.0, interval: float = 0.2, what: str = "condition", *,
               retry_on: tuple[type[BaseException], ...] = (), diagnose: Callable[[], Any] | None = None) -> T:
    """Calls `check()` every `interval` seconds until it returns something truthy, and returns
    that. After `timeout` seconds the test fails, naming `what`, the last value (or the last
    exception of a type in `retry_on`, which counts as "not yet") and `diagnose()`'s text
    (e.g. kubectl describe), if given. `check` is always called once more after the deadline
    has passed, so a slow check still gets its last look."""
    deadline = time.monotonic() + timeout
    while True:
        expired = time.monotonic() > deadline
        try:
            last: Any = check()
            if last:
                return last
        except retry_on as e:
            last = e
        if expired:
            break
        time.sleep(interval)
    msg = f"timed out after {timeout:g}s waiting for {what}"
    if last is not None and last is not False:
        msg += f"; last: {_short(repr(last))}"
    if diagnose is not None:
        try:
            msg += f"\n{diagnose()}"
        except Exception as e:  # noqa: BLE001 - diagnostics must not hide the failure
            msg += f"\n(diagnose failed: {e!r})"
    pytest.fail(msg)


def _short(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"
