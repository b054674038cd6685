"""A rollout server's side of the reward models (`grpo reward`): score the samples of one
Generate request with every model of spec.reward.rewardModels.

A replica that fails or overruns the model's timeoutSeconds has the batch sent to the next one;
the failed call's answer, should it come, is never read. When no replica answers within
timeoutSeconds (waiting a moment between rounds, so one being restarted can come back) the
Generate call fails with UNAVAILABLE and the trainer re-dispatches the shard: each sample in a
rollout shard is scored exactly once, by one replica.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from grpo_api.contracts import REWARD_ADDRESSES_ENV
from grpo_api.proto import reward_pb2 as pb
from grpo_api.proto import reward_pb2_grpc as pb_grpc
from grpo_api.rpc import ClientAuth
from grpo_api.spec import RewardModelSpec
from grpo_rollout.replicas import Replicas, ReplicasUnavailable


class RewardModelUnavailable(RuntimeError):
    """No replica of a reward model scored the batch: the Generate call fails (UNAVAILABLE)."""


@dataclass(frozen=True)
class ScoreItem:
    messages: list[dict]
    response: str
    ground_truth: str


def _request(request_id: str, items: Sequence[ScoreItem]) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=request_id, items=[
        pb.ScoreItem(prompt_messages=[pb.ChatMessage(role=str(m.get("role", "user")), content=str(m.get("content", "")))
                                      for m in it.messages],
                     response=it.response, ground_truth=it.ground_truth) for it in items])


class RewardModelClient:
    """One reward model's replicas, tried in turn (round robin across calls)."""

    def __init__(self, spec: RewardModelSpec, addresses: list[str], auth: ClientAuth | str, metrics=None,
                 retry_pause: float = 1.0):
        on_error = (lambda code: metrics.reward_model_error(spec.name, code)) if metrics else None
        self.spec, self.metrics = spec, metrics
        self.replicas = Replicas(f"reward model {spec.name}", addresses, auth, pb_grpc.RewardStub,
                                 retry_pause=retry_pause, on_error=on_error)
        if metrics:
            metrics.reward_model_known(spec.name)

    def score(self, request_id: str, items: Sequence[ScoreItem]) -> list[pb.ItemScore]:
        started = time.monotonic()
        timeout = self.spec.timeout_seconds
        try:
            reply, address = self.replicas.call("Score", _request(request_id, items), attempt_timeout=timeout,
                                                budget=timeout)
        except ReplicasUnavailable as exc:
            raise RewardModelUnavailable(
                f"reward model {self.spec.name}: no replica scored the batch within {timeout:g}s "
                f"(spec.reward.rewardModels[].timeoutSeconds); last errors: {exc}") from None
        if len(reply.scores) != len(items):
            raise RewardModelUnavailable(f"reward model {self.spec.name} on {address}: {len(reply.scores)} "
                                         f"scores for {len(items)} items")
        if self.metrics:
            self.metrics.reward_model_scored(self.spec.name, len(items), time.monotonic() - started)
        return list(reply.scores)

    def close(self) -> None:
        self.replicas.close()


class RewardModels:
    """Every reward model of the job; `score` gives, per item, {name: ItemScore}."""

    def __init__(self, specs: Sequence[RewardModelSpec], addresses: Mapping[str, list[str]], auth, metrics=None):
        missing = [m.name for m in specs if not addresses.get(m.name)]
        if missing:
            raise ValueError(f"spec.reward.rewardModels: no server address for {', '.join(missing)} (pass "
                             f"--reward-model NAME=HOST:PORT or set {REWARD_ADDRESSES_ENV})")
        unknown = sorted(set(addresses) - {m.name for m in specs})
        if unknown:
            raise ValueError(f"reward model addresses for {', '.join(unknown)}: not in spec.reward.rewardModels")
        self.clients = [RewardModelClient(m, addresses[m.name], auth, metrics) for m in specs]

    def score(self, request_id: str, items: Sequence[ScoreItem]) -> list[dict[str, pb.ItemScore]]:
        out: list[dict[str, pb.ItemScore]] = [{} for _ in items]
        for client in self.clients:
            for row, s in zip(out, client.score(request_id, items)):
                row[client.spec.name] = s
        return out

    def close(self) -> None:
        for c in self.clients:
            c.close()
