"""The operator's own Prometheus metrics (docs/ARCHITECTURE.md §7), on their own registry (no global state).

    grpo_operator_jobs{namespace,phase}                    GRPOJobs by phase (at scrape time)
    grpo_operator_reconcile_duration_seconds{trigger}      one reconcile, observe to act
    grpo_operator_reconcile_errors_total{kind}             failed reconciles (transient/permanent)
    grpo_operator_trainer_restarts_total{namespace,job}    trainer Jobs replaced after a failure
    grpo_operator_transitions_total{namespace,phase}       jobs entering a phase
    grpo_operator_api_requests_total{verb,code}            the reconciler's Kubernetes API calls
                                                           (kopf's watches not included)
    grpo_operator_resyncs_total                            resync passes completed (each one
                                                           reconciles every known job)

The dashboards (charts/grpo-operator/dashboards/operator.json) use exactly these names.

A resync pass (reconciler.Reconciler.resync) requests a reconcile of every job known when it
starts, reading progress.json, and is counted when it ends; `_count{trigger="resync"}` of the
duration histogram counts those reconciles one per job instead, so it says nothing about a
given job. Once grpo_operator_resyncs_total has grown by 2 since a moment T, a whole pass has
run after T (the first may have been under way at T): every job has been reconciled since T,
or, when a watch event's reconcile of the job was running at its turn, that one runs once more
after it (reconciler.Reconciler.request). The control-plane tests wait on it instead of sleeping.

The counters exist at 0 before their first increment (a series that appears only at its first
increment has no data on the dashboard until then, and `rate`/`increase` miss that increment):
reconcile errors for every kind in ERROR_KINDS from the start, a job's restarts from the first
time the operator sees the job (removed again when the job is forgotten, like its phase).
"""

from __future__ import annotations

import threading
from collections import Counter as _Tally

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from grpo_api.spec import Phase

JOBS = "grpo_operator_jobs"
RECONCILE_SECONDS = "grpo_operator_reconcile_duration_seconds"
RECONCILE_ERRORS = "grpo_operator_reconcile_errors_total"
RESTARTS = "grpo_operator_trainer_restarts_total"
TRANSITIONS = "grpo_operator_transitions_total"
API_REQUESTS = "grpo_operator_api_requests_total"
RESYNCS = "grpo_operator_resyncs_total"
METRIC_NAMES = (JOBS, RECONCILE_SECONDS, RECONCILE_ERRORS, RESTARTS, TRANSITIONS, API_REQUESTS, RESYNCS)
ERROR_KINDS = ("transient", "permanent", "bug")   # reconciler.Reconciler._timed's kinds


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self.reconcile_seconds = Histogram(
            RECONCILE_SECONDS, "Duration of one reconcile of a GRPOJob.",
            ["trigger"], registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.reconcile_errors = Counter(
            RECONCILE_ERRORS, "Reconciles that failed, by kind (transient: retried).",
            ["kind"], registry=self.registry)
        for kind in ERROR_KINDS:
            self.reconcile_errors.labels(kind=kind)
        self.restarts = Counter(
            RESTARTS, "Trainer Jobs replaced after a failure.",
            ["namespace", "job"], registry=self.registry)
        self.transitions = Counter(
            TRANSITIONS, "GRPOJobs entering a phase.",
            ["namespace", "phase"], registry=self.registry)
        self.api_requests = Counter(
            API_REQUESTS, "Kubernetes API calls of the reconciler, by verb and HTTP status (0: no answer).",
            ["verb", "code"], registry=self.registry)
        self.resyncs = Counter(
            RESYNCS, "Resync passes completed; each reconciles every known GRPOJob, reading progress.json.",
            registry=self.registry)
        self.registry.register(_PhaseCollector(self))

    def api_request(self, verb: str, code: int) -> None:
        self.api_requests.labels(verb=verb, code=str(code)).inc()

    def set_phase(self, namespace: str, name: str, phase: str) -> None:
        with self._lock:
            old = self._phases.get((namespace, name))
            self._phases[(namespace, name)] = phase
        if old is None:
            self.restarts.labels(namespace=namespace, job=name)   # 0 until its first restart
        elif old != phase:
            self.transitions.labels(namespace=namespace, phase=phase).inc()

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._phases.pop((namespace, name), None)
        try:
            self.restarts.remove(namespace, name)
        except KeyError:
            pass

    def phase_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(_Tally((ns, phase) for (ns, _), phase in self._phases.items()))

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)


class _PhaseCollector:
    """`grpo_operator_jobs` from the operator's view at scrape time: a deleted job's series
    disappears instead of lingering at its last value; every phase is reported, zeros too."""

    def __init__(self, metrics: OperatorMetrics):
        self._metrics = metrics

    def collect(self):
        family = GaugeMetricFamily(JOBS, "GRPOJobs by phase.", labels=["namespace", "phase"])
        counts = self._metrics.phase_counts()
        for ns in sorted({ns for ns, _ in counts}):
            for phase in Phase:
                family.add_metric([ns, phase.value], counts.get((ns, phase.value), 0))
        yield family
