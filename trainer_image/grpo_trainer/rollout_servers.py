"""Trainer rank 0's clients of the rollout servers: who they are now (a fixed list, or a headless
Service's name resolved every time, so scaling is followed) and one gRPC client each. The
dispatcher (rollout_client.py) and the weight publisher (publisher.py) both call the servers
through one `RolloutServers`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import grpc

from grpo_api.contracts import split_addresses
from grpo_api.rpc import ClientAuth, RolloutClients

log = logging.getLogger(__name__)

NOT_READY_HINT = ("the rollout server pods are not ready, or a server they call (a reward model, the python "
                  "sandbox) is not; on Kubernetes the GRPOJob's ServersFailing condition (kubectl describe gj) "
                  "names the failing pod and the end of its log, else see the servers' logs and rollout.replicas")


class StoppedWaiting(Exception):
    """The trainer was asked to stop (SIGTERM) while it waited for rollout servers that are gone:
    the step can't finish, so it stops now rather than be killed at the end of its grace period
    (a deleted GRPOJob's rollout pods may go first)."""


class RolloutServers:
    """Trainer rank 0's view of the rollout servers: who they are now (`discover` is called every
    time: a headless Service follows scaling) and one client each. `stopping()` says whether the
    trainer was asked to stop: waits for servers end then (StoppedWaiting)."""

    def __init__(self, discover: Callable[[], list[str]], auth: ClientAuth | str,
                 stopping: Callable[[], bool] = lambda: False):
        self.discover = discover
        self.clients = RolloutClients(auth)
        self.stopping = stopping
        self.where = discover.addresses if isinstance(discover, Discovery) else "the rollout servers' addresses"
        """What the trainer was told to dial (a Service's DNS name on Kubernetes), for the errors."""

    def check_stopping(self, waiting_for: str) -> None:
        if self.stopping():
            raise StoppedWaiting(f"asked to stop while waiting for {waiting_for}")

    def tool_schemas(self, wait_seconds: float = 600.0) -> list[dict]:
        """The tools the rollout servers render a tool agent's prompt with (their Info; every server
        loads the same spec's tools), from the first one that answers. The trainer counts them in
        data.maxPromptLength before it trains, as verl's dataset does."""
        deadline = time.monotonic() + wait_seconds
        errors: list[str] = []
        while True:
            for address in self.addresses(wait_seconds=max(1.0, deadline - time.monotonic())):
                try:
                    return json.loads(self.clients.info(address, timeout=30).tool_schemas_json or "[]")
                except grpc.RpcError as exc:
                    errors.append(f"{address}: {exc.code().name} {exc.details()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no rollout server told its tools within {wait_seconds:g}s: {'; '.join(errors[-3:])}")
            self.check_stopping("a rollout server's tools")
            time.sleep(1.0)

    def wait_until_serving(self, wait_seconds: float = 120.0, poll_seconds: float = 0.2) -> None:
        """Before the first rollout: until every server now listed answers Health, at most
        `wait_seconds` (a late one is then left to the dispatcher's retries and its timeout).
        The trainer starts beside its servers (`grpo run`, a job's pods) and loads its model while
        they load theirs; without this wait, step 1 would be dispatched into their start-up and
        logged as failed attempts. An answer is enough, ready or not: a server without known
        weights (colocated, asleep at level 2; a failed sync) is ready only once the trainer has
        sent them. Returns at once when the trainer is asked to stop."""
        deadline = time.monotonic() + wait_seconds
        waiting = set(self.addresses(wait_seconds=wait_seconds))
        while waiting and time.monotonic() < deadline and not self.stopping():
            for address in list(waiting):
                try:
                    self.clients.health(address, timeout=2)
                    waiting.discard(address)
                except grpc.RpcError:
                    pass
            if waiting:
                time.sleep(poll_seconds)
        if waiting and not self.stopping():
            log.warning("Rollout server(s) %s not answering after %.0fs; starting anyway (a shard sent to "
                        "one is retried elsewhere)", ", ".join(sorted(waiting)), wait_seconds)

    def addresses(self, wait_seconds: float = 120.0) -> list[str]:
        """Addresses of the rollout servers now; waits (bounded) while there are none."""
        deadline = time.monotonic() + wait_seconds
        while True:
            found = self.discover()
            if not found:
                self.check_stopping("a rollout server (none is there)")
            if found or time.monotonic() > deadline:
                if not found:
                    raise RuntimeError(f"no rollout server is ready at {self.where} after {wait_seconds:g}s: "
                                       f"{NOT_READY_HINT}")
                return found
            time.sleep(1.0)


class Discovery:
    """`host:port,host:port` is a fixed list; a single `dns:///name:port` entry is resolved every
    call (a headless Service: one address per ready rollout pod, so scaling is followed).
    `addresses` is kept for the errors: a Service's name that resolves to nothing means no
    rollout pod is ready, which is what the user must look at, not the DNS."""

    def __init__(self, addresses: str):
        self.addresses = addresses
        self._fixed = None if addresses.startswith("dns:///") else split_addresses(addresses)

    def __call__(self) -> list[str]:
        if self._fixed is not None:
            return list(self._fixed)
        import socket
        host, port = self.addresses.removeprefix("dns:///").rsplit(":", 1)
        try:
            infos = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
        except socket.gaierror:
            return []
        return sorted({f"{info[4][0]}:{port}" for info in infos})


def static_or_dns_discovery(addresses: str) -> Discovery:
    return Discovery(addresses)
