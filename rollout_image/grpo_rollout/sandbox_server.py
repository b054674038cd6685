"""`grpo sandbox`: run the `python` tool's programs for a job's rollout servers, over gRPC.

On Kubernetes it is the Deployment `<job>-sandbox` (spec.rollout.multiTurn.python.replicas):
model-written code runs away from the rollout pods, which hold the job's token, TLS key and
storage credentials, in pods whose NetworkPolicy denies every connection out and admits only
the job's rollout pods (docs/RELIABILITY.md says what this guarantees). Each program runs as
the rollout server would run it itself (tools.python_tool.run_python: a fresh process and
folder, rlimits), under the limits of this server's spec, which a caller can't change; at most
`concurrency` at once, a call that finds every slot busy for its whole deadline answers
RESOURCE_EXHAUSTED and the caller tries another replica.

Token auth and TLS are the rollout servers' (grpo_api.rpc). Start-up (grpo_rollout.grpc_launcher):
metrics and /ready, then gRPC, and one line on stdout when it listens,

    GRPO_SANDBOX_READY {"port": 50071, "metrics_port": 9401, "pid": 123, "tls": true}

SIGTERM/SIGINT: stop accepting calls, let running programs finish for `--grace` seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time

from grpo_api.contracts import SANDBOX_READY_PREFIX

log = logging.getLogger("grpo_rollout.sandbox_server")


class SandboxMetrics:
    """`grpo_sandbox_*`: programs by outcome (ok, failed, busy), seconds per program, running now."""

    def __init__(self, job: str, namespace: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = CollectorRegistry()
        self._labels = dict(job=job, namespace=namespace)
        names = tuple(self._labels)
        self._runs = Counter("grpo_sandbox_runs", "Programs run, by outcome (ok, failed, busy: no slot in time).",
                             names + ("outcome",), registry=self.registry)
        self._seconds = Histogram("grpo_sandbox_run_seconds", "Wall-clock seconds of one program.", names,
                                  registry=self.registry).labels(**self._labels)
        self.running = Gauge("grpo_sandbox_running", "Programs running now.", names,
                             registry=self.registry).labels(**self._labels)

    def done(self, outcome: str, seconds: float | None = None) -> None:
        self._runs.labels(**self._labels, outcome=outcome).inc()
        if seconds is not None:
            self._seconds.observe(seconds)


class SandboxServicer:
    def __init__(self, limits, metrics: SandboxMetrics, name: str):
        self.limits, self.metrics, self.name = limits, metrics, name
        self._slots = threading.BoundedSemaphore(limits.concurrency)
        self._running = 0
        self._lock = threading.Lock()

    def Run(self, request, context):
        import grpc

        from grpo_api.proto import sandbox_pb2 as pb
        from grpo_rollout.tools.python_tool import run_python
        wait = context.time_remaining()
        if not self._slots.acquire(timeout=None if wait is None else max(0.0, wait - 0.5)):
            self.metrics.done("busy")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.name}: all {self.limits.concurrency} slots busy (python.concurrency)")
        self._count(+1)
        try:
            started = time.monotonic()
            output, failed = run_python(request.code, self.limits)
            seconds = time.monotonic() - started
        finally:
            self._count(-1)
            self._slots.release()
        self.metrics.done("failed" if failed else "ok", seconds)
        log.info("run %s: %s in %.2fs", request.request_id or "-", "failed" if failed else "ok", seconds)
        return pb.RunReply(output=output, failed=failed, seconds=seconds, server=self.name)

    def _count(self, delta: int) -> None:
        with self._lock:
            self._running += delta
            self.metrics.running.set(self._running)

    def Health(self, request, context):
        from grpo_api.proto import sandbox_pb2 as pb
        return pb.SandboxHealthReply(ready=True, status="ready", running=self._running,
                                     concurrency=self.limits.concurrency)


def start_server(servicer: SandboxServicer, token: str, *, host: str = "[::]", port: int = 0, tls=None):
    from grpo_api.proto import sandbox_pb2_grpc as pb_grpc
    from grpo_rollout.grpc_launcher import serve_grpc
    # Threads for every slot plus callers waiting for one and Health: waiting happens in Run.
    return serve_grpc(pb_grpc.add_SandboxServicer_to_server, servicer, token, host=host, port=port, tls=tls,
                      max_workers=2 * servicer.limits.concurrency + 4, log=log)


def _parser() -> argparse.ArgumentParser:
    from grpo_rollout.grpc_launcher import server_parser
    return server_parser("grpo sandbox", "Run the `python` tool's programs for a GRPOJob's rollout servers "
                         "(spec.rollout.multiTurn.python).", port=50071, running="programs")


def main(argv: list[str]) -> int:
    from grpo_rollout.grpc_launcher import run_server
    return run_server("grpo sandbox", _parser().parse_args(argv), SANDBOX_READY_PREFIX, _start, log)


def _start(launch):
    from grpo_rollout.grpc_launcher import Serving
    from grpo_rollout.tools.python_tool import network_isolation_available
    job, args = launch.job, launch.args
    limits = job.spec.rollout.multi_turn.python
    metrics = SandboxMetrics(job.metadata.name, job.metadata.namespace)
    launch.serve_metrics(metrics.registry)
    name = os.environ.get("POD_NAME") or socket.gethostname()
    server, port = start_server(SandboxServicer(limits, metrics, name), launch.token, host=args.host,
                                port=args.port, tls=launch.tls)
    isolated = "yes" if network_isolation_available() else "no (the pod's NetworkPolicy is what keeps it off the network)"
    return Serving(server, port, f"sandbox server {name} listening on port {port}: {limits.concurrency} programs "
                   f"at once, each {limits.timeout_seconds:g}s wall, {limits.cpu_seconds}s CPU, {limits.memory_mb} "
                   f"MiB; own network namespace per program: {isolated}")
