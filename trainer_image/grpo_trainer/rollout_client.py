"""Rank 0's side of rollout: write prompt shards, ask rollout servers to generate, re-dispatch
what failed, and return the rollout shards that together cover every prompt exactly once.

A worker that dies, times out or lags behind the policy version loses its shard to another
worker (or to itself once it is back and re-synced). Output URIs carry the attempt number, so a
late write of a failed attempt can never be mistaken for the accepted one.

A shard a server refuses as invalid (INVALID_ARGUMENT: a custom agent loop that breaks its
contract, a request the server can't read) fails the step at once with the server's message
(`RolloutRefused`): every server would refuse it again, and each try is a whole generation.

Two retry budgets: a shard that fails on workers that answered (an error, a timeout, a version
conflict) gets `max_attempts`; a shard that finds no worker listening (UNAVAILABLE: the only
replica is being restarted, a pod is rescheduled and loads its model) keeps waiting for one
up to the request timeout, since that takes as long as a server's start-up, not a few retries.

Before a server generates, it is brought to the requested version: the dispatcher is handed
something with `ensure_version` (the weight publisher, behind the `VersionKeeper` protocol, so
this module doesn't import it), and both call the servers through one client per server
(rollout_servers.RolloutServers).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import grpc

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.records import RunLayout
from grpo_api.storage import Storage
from grpo_trainer.rollout_servers import NOT_READY_HINT, RolloutServers

log = logging.getLogger("grpo.trainer")


class VersionKeeper(Protocol):
    """What the dispatcher needs of the weight publisher (publisher.WeightPublisher)."""

    def ensure_version(self, worker: str, version: int) -> None:
        """Bring the server at `worker` to policy `version` before it generates."""


@dataclass
class ShardResult:
    shard: str
    worker: str
    reply: pb.GenerateReply


class RolloutRefused(RuntimeError):
    """A rollout server refused a shard as invalid (INVALID_ARGUMENT): bad input, which retrying
    can't fix (the trainer exits 2)."""


class RolloutDispatcher:
    def __init__(self, servers: RolloutServers, *, weights: VersionKeeper, layout: RunLayout, storage: Storage,
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
        first_failure: dict[str, str] = {}          # often the cause, where the retries' errors are its effects
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
                        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                            raise RolloutRefused(f"rollout shard {name}: {worker} refused it: {detail}") from None
                        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                            since = unreachable_since.setdefault(name, time.monotonic())
                            if time.monotonic() - since > self.timeout:
                                # Not the network's fault, most likely (the last error may say DNS:
                                # a Service with no ready pod has no address): a server can't start.
                                raise RuntimeError(f"rollout shard {name}: no rollout server at {self.servers.where} "
                                                   f"could generate it for {self.timeout:.0f}s: {NOT_READY_HINT}. "
                                                   f"Last error on {worker}: {detail}") from exc
                        else:
                            unreachable_since.pop(name, None)
                            failures[name] += 1
                            last = f"on {worker}: {detail}"
                            first = first_failure.setdefault(name, last)
                            if failures[name] >= self.max_attempts:
                                said = "" if first == last else f"first error {first}; "
                                raise RuntimeError(f"rollout shard {name} failed {failures[name]} times; "
                                                   f"{said}last error {last}") from exc
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
