"""`grpo run`'s servers listen on loopback only (issue 48): the address the launcher passes to every
server, and the /metrics address a server derives from it; a pod's servers keep every interface."""

from __future__ import annotations

import pytest

from grpo_api.jobfile import parse_job
from grpo_operator.local import LOOPBACK, LocalRun
from grpo_rollout.grpc_launcher import http_host
from grpo_rollout.metrics import serve_http
from prometheus_client import CollectorRegistry


def _host_of(argv: list[str]) -> str | None:
    return argv[argv.index("--host") + 1] if "--host" in argv else None


def test_every_server_of_a_local_run_listens_on_loopback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = parse_job({"spec": {
        "model": {"path": "Qwen/Qwen3-0.6B"}, "data": {"trainFiles": ["t.parquet"], "trainBatchSize": 4},
        "trainer": {"miniBatchSize": 4},
        "reward": {"rewardModels": [{"name": "rm", "path": "/models/rm", "replicas": 2}]},
        "rollout": {"replicas": 2, "multiTurn": {"enable": True, "tools": ["python"], "python": {"replicas": 1}}}}})
    run = LocalRun(job, metrics=True)
    servers = [*run.rollouts, *run.dependency_children]
    assert sorted(c.name for c in servers) == ["reward-rm-0", "reward-rm-1", "rollout-0", "rollout-1", "sandbox-0"]
    assert {c.name: _host_of(c.argv) for c in servers} == {c.name: LOOPBACK for c in servers}
    assert "--run-locally" in run.trainer.argv        # the trainer's /metrics: 127.0.0.1 (Trainer.metrics_host)


@pytest.mark.parametrize("grpc_host, expected", [("127.0.0.1", "127.0.0.1"), ("[::]", "0.0.0.0"),
                                                 ("0.0.0.0", "0.0.0.0")])
def test_metrics_listen_where_grpc_does(grpc_host, expected):
    assert http_host(grpc_host) == expected
    server = serve_http(CollectorRegistry(), 0, ready=lambda: True, host=http_host(grpc_host))
    try:
        assert server.server_address[0] == expected
    finally:
        server.shutdown()
