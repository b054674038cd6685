"""The rollout server's side of the sandbox servers (`grpo sandbox`): the `python` tool's programs
run there instead of in a child of the rollout server (spec.rollout.multiTurn.python.replicas).

A server that fails (killed mid-call, restarting, every slot busy) or overruns the program's own
limit has the program sent to the next one: a program runs in a fresh process and folder, so
running it again elsewhere changes nothing but the time. Once the tool's timeout is spent the
model reads that the sandbox is unavailable; the trajectory goes on and the error is counted
(kind `unavailable`).
"""

from __future__ import annotations

import os

from grpo_api.contracts import SANDBOX_ADDRESSES_ENV, split_addresses
from grpo_api.proto import sandbox_pb2 as pb
from grpo_api.proto import sandbox_pb2_grpc as pb_grpc
from grpo_api.rpc import ClientAuth
from grpo_api.spec import MultiTurnSpec
from grpo_rollout.replicas import Replicas, ReplicasUnavailable
from grpo_rollout.tools.base import ToolUnavailable

START_SECONDS = 5.0
"""A program's allowance beyond its wall-clock limit: process start-up, the call's round trip."""


class SandboxClient:
    def __init__(self, spec: MultiTurnSpec, addresses: list[str], auth: ClientAuth | str, *, retry_pause: float = 0.5):
        self.attempt_timeout = spec.python.timeout_seconds + START_SECONDS
        # Ends before the tool runner's own timeout, so the model reads why the sandbox didn't answer.
        self.budget = 0.8 * spec.tool_timeout_seconds
        self.addresses = list(addresses)
        self.replicas = Replicas("python sandbox", addresses, auth, pb_grpc.SandboxStub, retry_pause=retry_pause)

    def run(self, code: str, request_id: str = "") -> tuple[str, bool]:
        """(what the program printed, with the error line if it failed; whether it failed)."""
        try:
            reply, _ = self.replicas.call("Run", pb.RunRequest(request_id=request_id, code=code),
                                          attempt_timeout=self.attempt_timeout, budget=self.budget)
        except ReplicasUnavailable as exc:
            raise ToolUnavailable(f"the python sandbox is unavailable: no sandbox server ran the program within "
                                  f"{self.budget:g}s (last errors: {exc})") from None
        return reply.output, reply.failed

    def close(self) -> None:
        self.replicas.close()


def sandbox_addresses(given: list[str]) -> list[str]:
    """`--sandbox` values, else $GRPO_SANDBOX_ADDRESSES; each may list several, comma-separated."""
    return split_addresses(",".join(given) or os.environ.get(SANDBOX_ADDRESSES_ENV, ""))
