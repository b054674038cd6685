"""Prometheus metrics of a rollout server (docs/ARCHITECTURE.md §7), and the small HTTP endpoint
that serves them together with the readiness and liveness probes.

Names are prefixed `grpo_rollout_` and labelled with the job and namespace. Each server owns
its own CollectorRegistry (no process-global state), so tests can run several in one process.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from grpo_rollout.rewards.pool import ERROR_KINDS

OLDEST_REQUEST = "oldest_request_seconds"
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
        self._started: list[float] = []       # monotonic start of each request in flight
        self._started_lock = threading.Lock()
        self._l(gauge(OLDEST_REQUEST, "Age of the oldest Generate request in flight (0 when idle): an engine that "
                      "hangs makes it grow without bound.")).set_function(self._oldest_age)
        self._generate_seconds = histogram("generate_seconds", "Time the engine spent generating one request.")
        self._reward_seconds = histogram("reward_seconds", "Time spent scoring one request's samples.")
        self._reward_errors = counter("reward_errors", "Samples whose reward function failed and scored 0, by kind "
                                      "(error, timeout, invalid, crash).", ("kind",))
        self._policy_version = gauge("policy_version", "Version of the weights held; -1 while an update is half-applied.")
        self._sync_seconds = histogram("weight_sync_seconds", "Duration of a complete weight update.", ("backend",))
        self._sync_bytes = counter("weight_sync_bytes", "Weight bytes received and loaded.", ("backend",))
        self._sync_rejected = counter("weight_sync_rejected_buckets", "Buckets refused (bad checksum or size) and asked again.")
        # Reward models (issue 31): per model, the scoring calls' latency and batch size, and the
        # calls a replica failed (each retried on another replica, or failing the Generate call).
        self._rm_seconds = histogram("reward_model_seconds", "Time one reward-model call took to score a batch.",
                                     ("model",))
        self._rm_batch = Histogram("grpo_rollout_reward_model_batch_size", "Samples per reward-model call.",
                                   labels + ("model",), buckets=(1, 4, 16, 64, 256, 1024, 4096), registry=self.registry)
        self._rm_errors = counter("reward_model_errors", "Reward-model calls that failed, by model and gRPC code.",
                                  ("model", "code"))
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

    def reward_model_scored(self, model: str, items: int, seconds: float) -> None:
        self._l(self._rm_seconds, model=model).observe(seconds)
        self._l(self._rm_batch, model=model).observe(items)

    def reward_model_known(self, model: str) -> None:
        """Zero series for the failures a dying or overrunning replica gives, before the first one."""
        for code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            self._l(self._rm_errors, model=model, code=code)

    def reward_model_error(self, model: str, code: str) -> None:
        self._l(self._rm_errors, model=model, code=code).inc()

    def request_done(self, outcome: str) -> None:
        self._l(self._requests, outcome=outcome).inc()

    def in_flight(self) -> "_InFlight":
        return _InFlight(self._l(self._in_flight), self._started, self._started_lock)

    def _oldest_age(self) -> float:
        with self._started_lock:
            return time.monotonic() - min(self._started) if self._started else 0.0

    def set_policy_version(self, version: int) -> None:
        self._l(self._policy_version).set(version)

    def weights_loaded(self, backend: str, nbytes: int) -> None:
        self._l(self._sync_bytes, backend=backend).inc(nbytes)

    def weight_sync_done(self, backend: str, seconds: float) -> None:
        self._l(self._sync_seconds, backend=backend).observe(seconds)

    def bucket_rejected(self) -> None:
        self._l(self._sync_rejected).inc()


class _InFlight:
    def __init__(self, gauge, started: list[float], lock: threading.Lock):
        self._gauge, self._started, self._lock = gauge, started, lock
        self._t = 0.0

    def __enter__(self):
        self._gauge.inc()
        self._t = time.monotonic()
        with self._lock:
            self._started.append(self._t)

    def __exit__(self, *exc):
        self._gauge.dec()
        with self._lock:
            self._started.remove(self._t)


def serve_http(registry: CollectorRegistry, port: int, ready: Callable[[], bool], host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """`/metrics` (Prometheus text format), `/ready` (200 when `ready()`, else 503; for the
    pod's readiness probe, which can't send the gRPC token) and `/live?stuckAfterSeconds=N`
    (503 once a Generate request has been in flight longer than N seconds: a hung engine, for
    the liveness probe). Runs in a daemon thread; port 0 picks a free one
    (`server.server_address[1]`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/metrics":
                body, status, ctype = generate_latest(registry), 200, CONTENT_TYPE_LATEST
            elif url.path == "/ready":
                ok = ready()
                body, status, ctype = (b"ready\n" if ok else b"not ready\n"), (200 if ok else 503), "text/plain"
            elif url.path == "/live":
                body, status = _liveness(registry, urllib.parse.parse_qs(url.query))
                ctype = "text/plain"
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


def _liveness(registry: CollectorRegistry, query: dict[str, list[str]]) -> tuple[bytes, int]:
    """From the exported gauge, so the probe and a Prometheus alert see the same number."""
    try:
        limit = float(query.get("stuckAfterSeconds", ["inf"])[0])
    except ValueError:
        return b"stuckAfterSeconds must be a number\n", 400
    age = max((s.value for family in registry.collect() if family.name == f"grpo_rollout_{OLDEST_REQUEST}"
               for s in family.samples), default=0.0)
    if age > limit:
        return f"a Generate request has been in flight for {age:.0f}s (> {limit:.0f}s): engine stuck\n".encode(), 503
    return b"live\n", 200
