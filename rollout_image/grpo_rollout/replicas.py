"""Calls to a pool of servers of one kind that a rollout server depends on: a reward model's
replicas (reward_client), the `python` tool's sandbox servers (tools/sandbox_client).

A call that fails or overruns its attempt timeout goes to the next address (round robin across
calls); after a whole round of failures it waits a moment, so a replica being restarted can come
back; once the call's budget is spent it raises `ReplicasUnavailable` with the last errors. An
address may itself be many replicas: a `dns:///` name (the operator's headless Service) is dialled
with gRPC's round robin over every ready pod it resolves to, and a pod that dies leaves DNS.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from grpo_api.rpc import ClientAuth, rollout_channel

log = logging.getLogger(__name__)

WARN_EVERY_SECONDS = 60.0
"""At most one warning per address this often: a Service with no ready pod fails every attempt,
once a `retry_pause` (the metric behind `on_error` still counts each)."""


class ReplicasUnavailable(RuntimeError):
    """No replica answered within the call's budget; `errors` has the last ones, one per address."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass(eq=False)
class _Channel:
    """A channel and the calls on it now: one that failed is replaced at once (a fresh channel
    reaches a restarted server without gRPC's reconnect backoff) but closed only once the last of
    its calls is over. Calls from several threads share it (a rollout server's tool calls, its
    reward requests); closing it under another call made that call raise ValueError, not an
    RpcError ('crash' tool errors in a CI run of tests/integration/test_sandbox_run)."""
    channel: grpc.Channel
    calls: int = 0
    replaced: bool = False


class Replicas:
    def __init__(self, what: str, addresses: list[str], auth: ClientAuth | str, stub: Callable[[grpc.Channel], object],
                 *, retry_pause: float = 1.0, on_error: Callable[[str], None] | None = None,
                 warn_every: float = WARN_EVERY_SECONDS, clock: Callable[[], float] = time.monotonic):
        if not addresses:
            raise ValueError(f"{what}: no server address")
        self.what, self.addresses, self._auth, self._make_stub = what, list(addresses), auth, stub
        self._pause, self._on_error = retry_pause, on_error
        self._channels: dict[str, _Channel] = {}
        self._lock = threading.Lock()
        self._next = itertools.count()
        self._warn_every, self._clock = warn_every, clock
        self._warned: dict[str, float] = {}         # address -> when it was last warned about
        self._quiet: dict[str, int] = {}            # address -> failures not warned about since

    def _take(self, address: str) -> _Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = _Channel(rollout_channel(address, self._auth,
                                                                   round_robin=address.startswith("dns:")))
            taken = self._channels[address]
            taken.calls += 1
            return taken

    def _give_back(self, address: str, taken: _Channel, failed: bool) -> None:
        with self._lock:
            taken.calls -= 1
            if failed and self._channels.get(address) is taken:
                del self._channels[address]
                taken.replaced = True
            done = taken.replaced and taken.calls == 0
        if done:
            taken.channel.close()

    def call(self, method: str, request, *, attempt_timeout: float, budget: float):
        """(the reply, the address that gave it)."""
        deadline = time.monotonic() + budget
        start = next(self._next)
        errors: list[str] = []
        for attempt in itertools.count():
            address = self.addresses[(start + attempt) % len(self.addresses)]
            timeout = min(attempt_timeout, max(0.1, deadline - time.monotonic()))
            taken, failed = self._take(address), True
            try:
                reply = getattr(self._make_stub(taken.channel), method)(request, timeout=timeout)
                failed = False
                return reply, address
            except grpc.RpcError as exc:
                errors.append(f"{address}: {exc.code().name} {exc.details()}")
                self._warn(address, exc)
                if self._on_error:
                    self._on_error(exc.code().name)
            finally:
                self._give_back(address, taken, failed)
            if time.monotonic() >= deadline:
                raise ReplicasUnavailable(errors[-len(self.addresses):])
            if (attempt + 1) % len(self.addresses) == 0:      # a whole round failed: let one come back
                time.sleep(min(self._pause, max(0.0, deadline - time.monotonic())))
        raise AssertionError("unreachable")

    def _warn(self, address: str, exc: grpc.RpcError) -> None:
        now = self._clock()
        if now - self._warned.get(address, float("-inf")) < self._warn_every:
            self._quiet[address] = self._quiet.get(address, 0) + 1
            return
        self._warned[address] = now
        quiet = self._quiet.pop(address, 0)
        since = f" ({quiet} more failures since the last warning)" if quiet else ""
        log.warning("%s on %s failed (%s): %s; trying the next replica%s; next warning about it in %.0f s at the "
                    "earliest", self.what, address, exc.code().name, exc.details(), since, self._warn_every)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for taken in channels:
            taken.channel.close()
