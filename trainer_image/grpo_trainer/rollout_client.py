"""Rank 0's side of rollout: write prompt shards, ask rollout servers to generate, re-dispatch
what failed, and return the rollout shards that together cover every prompt exactly once.

A worker that dies, times out or lags behind the policy version loses its shard to another
worker (or to itself once it is back and re-synced). Output URIs carry the attempt number, so a
late write of a failed attempt can never be mistaken for the accepted one.

Two retry budgets: a shard that fails on workers that answered (an error, a timeout, a version
conflict) gets `max_attempts`; a shard that finds no worker listening (UNAVAILABLE: the only
replica is being restarted, a pod is rescheduled and loads its model) keeps waiting for one
up to the request timeout, since that takes as long as a server's start-up, not a few retries.

Before a server generates, the weight publisher brings it to the requested version
(`ensure_version`): the dispatcher is handed the publisher, and both call the servers through
one client per server (`RolloutServers.clients`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.records import RunLayout
from grpo_api.rpc import ClientAuth, RolloutClients
from grpo_api.storage import Storage

if TYPE_CHECKING:
    from grpo_trainer.publisher import WeightPublisher

log = logging.getLogger("grpo.trainer")


@dataclass
class ShardResult:
    shard: str
    worker: str
    reply: pb.GenerateReply


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

    def addresses(self, wait_seconds: float = 120.0) -> list[str]:
        """Addresses of the rollout servers now; waits (bounded) while there are none."""
        deadline = time.monotonic() + wait_seconds
        while True:
            found = self.discover()
            if not found:
                self.check_stopping("a rollout server (none is there)")
            if found or time.monotonic() > deadline:
                if not found:
                    raise RuntimeError("no rollout server is reachable (check rollout.replicas and their logs)")
                return found
            time.sleep(1.0)


class RolloutDispatcher:
    def __init__(self, servers: RolloutServers, *, weights: WeightPublisher, layout: RunLayout, storage: Storage,
                 timeout: float, max_attempts: int = 6):
        self.servers, self.weights, self.layout, self.storage = servers, weights, layout, storage
        self.timeout, self.max_attempts = timeout, max_attempts
        self.redispatched = 0

    def generate(self, step: int, tag: str, shards: dict[str, bytes], sampling: pb.SamplingParams,
                 version: int) -> list[ShardResult]:
        """`shards` maps shard name -> prompt parquet bytes. Returns one result per shard."""
        for name, data in shards.items():
            self.storage.write_bytes(self.layout.prompt_shard(step, name), data)
        pending = list(shards)
        order = {name: k for k, name in enumerate(shards)}
        attempts = {name: 0 for name in shards}     # tries (they name the output file)
        failures = {name: 0 for name in shards}     # tries that a worker answered with a failure
        unreachable_since: dict[str, float] = {}
        done: dict[str, ShardResult] = {}
        while pending:
            workers = self.servers.addresses()
            failed: list[str] = []
            with ThreadPoolExecutor(max_workers=len(workers)) as pool:
                futures = {}
                for name in pending:
                    worker = workers[(order[name] + attempts[name]) % len(workers)]  # a retry moves on
                    attempts[name] += 1
                    futures[name] = (worker, pool.submit(self._generate_one, worker, step, tag, name,
                                                         attempts[name], sampling, version))
                for name, (worker, fut) in futures.items():
                    try:
                        done[name] = ShardResult(name, worker, fut.result())
                    except Exception as exc:  # noqa: BLE001 - any failure re-dispatches the shard
                        detail = exc.details() if isinstance(exc, grpc.RpcError) else repr(exc)
                        log.warning("rollout shard %s on %s failed (attempt %d): %s", name, worker,
                                    attempts[name], detail)
                        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                            since = unreachable_since.setdefault(name, time.monotonic())
                            if time.monotonic() - since > self.timeout:
                                raise RuntimeError(f"rollout shard {name}: no rollout server reachable for "
                                                   f"{self.timeout:.0f}s; last error on {worker}: {detail}") from exc
                        else:
                            unreachable_since.pop(name, None)
                            failures[name] += 1
                            if failures[name] >= self.max_attempts:
                                raise RuntimeError(f"rollout shard {name} failed {failures[name]} times; "
                                                   f"last error on {worker}: {detail}") from exc
                        failed.append(name)
                        self.servers.clients.forget(worker)
            if any(name in unreachable_since for name in failed):
                self.servers.check_stopping("rollout servers that don't answer")
            if failed:
                self.redispatched += len(failed)
                time.sleep(min(5.0, 0.5 * max(attempts[n] for n in failed)))
            pending = failed
        return [done[name] for name in shards]

    def _generate_one(self, worker: str, step: int, tag: str, shard: str, attempt: int,
                      sampling: pb.SamplingParams, version: int) -> pb.GenerateReply:
        self.weights.ensure_version(worker, version)
        request = pb.GenerateRequest(
            request_id=f"{tag}-{step}-{shard}-{attempt}",
            prompt_uri=self.layout.prompt_shard(step, shard),
            output_uri=self.layout.rollout_shard(step, f"{shard}-attempt-{attempt}"),
            sampling=sampling, expected_policy_version=version, step=step, shard=shard)
        return self.servers.clients(worker).Generate(request, timeout=self.timeout)


def static_or_dns_discovery(addresses: str) -> Callable[[], list[str]]:
    """`host:port,host:port` is a fixed list; a single `dns:///name:port` entry is resolved every
    call (a headless Service: one address per ready rollout pod, so scaling is followed)."""
    if addresses.startswith("dns:///"):
        import socket
        host, port = addresses.removeprefix("dns:///").rsplit(":", 1)

        def resolve() -> list[str]:
            try:
                infos = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
            except socket.gaierror:
                return []
            return sorted({f"{info[4][0]}:{port}" for info in infos})
        return resolve
    fixed = [a for a in addresses.split(",") if a]
    return lambda: list(fixed)
