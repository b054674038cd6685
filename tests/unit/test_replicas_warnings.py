"""A dependent Service with no ready pod (issue 48): every attempt fails, once a retry pause, and
the rollout server's log got one warning per attempt. Now one per address per `warn_every`,
the next one counting the failures it didn't show; the error metric still counts each."""

from __future__ import annotations

import logging
import socket

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
