"""The rollout server's calls to the replicas it depends on (reward models, sandbox servers).

A dependent Service with no ready pod (issue 48): every attempt fails, once a retry pause, and
the rollout server's log got one warning per attempt. Now one per address per `warn_every`,
the next one counting the failures it didn't show; the error metric still counts each.

Calls from several threads share a channel per address: one call's failure must not break
another's call on the same channel (it did: the channel was closed under it, and the tool call
ended as a `crash`)."""

from __future__ import annotations

import logging
import socket
import threading
from concurrent import futures

import grpc

import pytest

from grpo_api.proto import sandbox_pb2 as pb
from grpo_api.proto import sandbox_pb2_grpc as pb_grpc
from grpo_rollout.replicas import Replicas, ReplicasUnavailable


def _closed_port() -> int:
    with socket.socket() as s:          # bound, never listening: every call is refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_never_answers_is_warned_about_once_a_period(caplog):
    now = [0.0]
    failures = []
    address = f"127.0.0.1:{_closed_port()}"
    replicas = Replicas("python sandbox", [address], "token", pb_grpc.SandboxStub, retry_pause=0.0,
                        on_error=failures.append, warn_every=60.0, clock=lambda: now[0])

    def call_until_failed_twice():
        before = len(failures)
        while len(failures) < before + 2:
            with pytest.raises(ReplicasUnavailable):
                replicas.call("Run", pb.RunRequest(code="print(1)"), attempt_timeout=5.0, budget=0.2)

    with caplog.at_level(logging.WARNING, logger="grpo_rollout.replicas"):
        call_until_failed_twice()
        now[0] = 59.0
        call_until_failed_twice()
        assert len(caplog.records) == 1 and address in caplog.messages[0] and "UNAVAILABLE" in caplog.messages[0]
        quiet = len(failures) - 1
        now[0] = 60.0
        call_until_failed_twice()
    replicas.close()
    assert len(caplog.records) == 2 and f"({quiet} more failures since the last warning)" in caplog.messages[1]
    assert set(failures) == {"UNAVAILABLE"}


class _Sandbox(pb_grpc.SandboxServicer):
    def Run(self, request, context):
        return pb.RunReply(output="ran")


def test_a_failed_call_leaves_another_threads_call_on_the_same_channel_to_fail_over():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_SandboxServicer_to_server(_Sandbox(), server)
    live = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    dead = f"127.0.0.1:{_closed_port()}"
    stub_made, go = threading.Event(), threading.Event()

    def stub(channel):
        real = pb_grpc.SandboxStub(channel)
        if threading.current_thread().name != "held":
            return real
        stub_made.set()
        go.wait(30)                 # held between taking the channel and calling on it

        class Held:
            def Run(self, request, timeout):
                threading.current_thread().name = "released"    # its retry goes through at once
                return real.Run(request, timeout=timeout)
        return Held()

    replicas = Replicas("python sandbox", [dead, live], "token", stub, retry_pause=0.0)
    got: list = []

    def held_call():
        try:
            got.append(replicas.call("Run", pb.RunRequest(code="print(1)"), attempt_timeout=5.0, budget=20.0))
        except BaseException as exc:   # noqa: BLE001 - what the caller would have seen
            got.append(exc)

    held = threading.Thread(target=held_call, name="held")
    try:
        held.start()                   # the first call of the round robin: the dead address
        assert stub_made.wait(30)
        assert replicas.call("Run", pb.RunRequest(), attempt_timeout=5.0, budget=20.0)[1] == live
        reply, address = replicas.call("Run", pb.RunRequest(), attempt_timeout=5.0, budget=20.0)
        assert address == live         # this one failed on the dead address first, then went on
        go.set()
        held.join(30)
    finally:
        go.set()
        replicas.close()
        server.stop(None)
    assert len(got) == 1 and not isinstance(got[0], BaseException), got
    assert got[0][0].output == "ran" and got[0][1] == live
