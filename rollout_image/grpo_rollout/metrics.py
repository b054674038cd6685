"""Prometheus metrics of a rollout server (DESIGN.md §7), and the small HTTP endpoint that serves
them together with a readiness probe.

Names are prefixed `grpo_rollout_` and labelled with the job and namespace. Each server owns
its own CollectorRegistry (no process-global state), so tests can run several in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from grpo_rollout.rewards.pool import ERROR_KINDS

_SECONDS_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class RolloutMetrics:
    def __init__(self, job: str, namespace: str, worker: str):
        self.registry = CollectorRegistry()
        labels = ("job", "namespace", "worker")
        self._values = dict(job=job, namespace=namespace, worker=worker)

        def counter(name, doc, extra=()):
            return Counter(f"grpo_rollout_{name}", doc, labels + extra, registry=self.registry)

        def gauge(name, doc):
            return Gauge(f"grpo_rollout_{name}", doc, labels, registry=self.registry)

        def histogram(name, doc, extra=()):
            return Histogram(f"grpo_rollout_{name}", doc, labels + extra, buckets=_SECONDS_BUCKETS, registry=self.registry)

        self._tokens = counter("generated_tokens", "Response tokens generated.")
        self._samples = counter("samples", "Responses generated.")
        self._requests = counter("requests", "Generate requests by outcome (ok, or the gRPC status code).", ("outcome",))
        self._in_flight = gauge("requests_in_flight", "Generate requests being served or waiting for the engine.")
        self._generate_seconds = histogram("generate_seconds", "Time the engine spent generating one request.")
        self._reward_seconds = histogram("reward_seconds", "Time spent scoring one request's samples.")
        self._reward_errors = counter("reward_errors", "Samples whose reward function failed and scored 0, by kind "
                                      "(error, timeout, invalid, crash).", ("kind",))
        self._policy_version = gauge("policy_version", "Version of the weights held; -1 while an update is half-applied.")
        self._sync_seconds = histogram("weight_sync_seconds", "Duration of a complete weight update.", ("backend",))
        self._sync_bytes = counter("weight_sync_bytes", "Weight bytes received and loaded.", ("backend",))
        self._sync_rejected = counter("weight_sync_rejected_buckets", "Buckets refused (bad checksum or size) and asked again.")
        # Series known in advance start at 0 (so rate() is 0, not "no data", until the first one).
        for kind in ERROR_KINDS:
            self._l(self._reward_errors, kind=kind)
        self._l(self._sync_rejected)

    def _l(self, metric, **extra):
        return metric.labels(**self._values, **extra)

    def generated(self, samples: int, tokens: int, seconds: float) -> None:
        self._l(self._samples).inc(samples)
        self._l(self._tokens).inc(tokens)
        self._l(self._generate_seconds).observe(seconds)

    def rewarded(self, seconds: float, errors_by_kind: dict[str, int]) -> None:
        self._l(self._reward_seconds).observe(seconds)
        for kind, n in errors_by_kind.items():
            self._l(self._reward_errors, kind=kind).inc(n)

    def request_done(self, outcome: str) -> None:
        self._l(self._requests, outcome=outcome).inc()

    def in_flight(self) -> "_InFlight":
        return _InFlight(self._l(self._in_flight))

    def set_policy_version(self, version: int) -> None:
        self._l(self._policy_version).set(version)

    def weights_loaded(self, backend: str, nbytes: int) -> None:
        self._l(self._sync_bytes, backend=backend).inc(nbytes)

    def weight_sync_done(self, backend: str, seconds: float) -> None:
        self._l(self._sync_seconds, backend=backend).observe(seconds)

    def bucket_rejected(self) -> None:
        self._l(self._sync_rejected).inc()


class _InFlight:
    def __init__(self, gauge):
        self._gauge = gauge

    def __enter__(self):
        self._gauge.inc()

    def __exit__(self, *exc):
        self._gauge.dec()


def serve_http(registry: CollectorRegistry, port: int, ready: Callable[[], bool], host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """`/metrics` (Prometheus text format) and `/ready` (200 when `ready()`, else 503; for the
    pod's readiness probe, which can't send the gRPC token). Runs in a daemon thread; port 0
    picks a free one (`server.server_address[1]`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] == "/metrics":
                body, status, ctype = generate_latest(registry), 200, CONTENT_TYPE_LATEST
            elif self.path == "/ready":
                ok = ready()
                body, status, ctype = (b"ready\n" if ok else b"not ready\n"), (200 if ok else 503), "text/plain"
            else:
                body, status, ctype = b"not found\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # scrapes every few seconds: not worth a log line each
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
