"""`grpo run`'s servers listen on loopback only (issue 48): the address the launcher passes to every
server, and the /metrics address a server derives from it; a pod's servers keep every interface."""

from __future__ import annotations

import errno
import socket
from concurrent import futures

import grpc
import pytest

from grpo_api import rpc
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


def _bind_error(port: int) -> int:
    """0 if a socket without SO_REUSEADDR (another program's) can bind the port, else the errno."""
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError as e:
            return e.errno
    return 0


def test_a_local_runs_ports_stay_its_own_until_it_ends(tmp_path, monkeypatch):
    """Picked when the run is set up, a port is held until the run ends: nothing else can take it
    before its server binds it, or while the server restarts on it (CI once lost a rollout
    server's port in between: "Failed to bind to address"); the run's servers still bind it."""
    monkeypatch.chdir(tmp_path)
    job = parse_job({"spec": {
        "model": {"path": "Qwen/Qwen3-0.6B"}, "data": {"trainFiles": ["t.parquet"], "trainBatchSize": 4},
        "trainer": {"miniBatchSize": 4}, "rollout": {"replicas": 2}}})
    run = LocalRun(job, metrics=True)
    ports = [*run.rollout_ports, run.trainer_metrics_port, *run.rollout_metrics_ports]
    assert len(set(ports)) == 5
    assert {p: _bind_error(p) for p in ports} == {p: errno.EADDRINUSE for p in ports}
    for _restart in range(2):      # a gRPC server and a /metrics server bind theirs, twice
        server = grpc.server(futures.ThreadPoolExecutor(1))
        assert rpc.listen(server, LOOPBACK, run.rollout_ports[0], tls=None) == run.rollout_ports[0]
        http = serve_http(CollectorRegistry(), run.rollout_metrics_ports[0], ready=lambda: True, host=LOOPBACK)
        server.stop(None)
        http.shutdown()
        http.server_close()
    assert _bind_error(run.rollout_ports[0]) == errno.EADDRINUSE     # still the run's
    run.stop_all()
    assert {p: _bind_error(p) for p in ports} == {p: 0 for p in ports}


@pytest.mark.parametrize("grpc_host, expected", [("127.0.0.1", "127.0.0.1"), ("[::]", "0.0.0.0"),
                                                 ("0.0.0.0", "0.0.0.0")])
def test_metrics_listen_where_grpc_does(grpc_host, expected):
    assert http_host(grpc_host) == expected
    server = serve_http(CollectorRegistry(), 0, ready=lambda: True, host=http_host(grpc_host))
    try:
        assert server.server_address[0] == expected
    finally:
        server.shutdown()
