"""Every query of the operator's Grafana dashboard (charts/grpo-operator/dashboards/operator.json),
evaluated by a real Prometheus (Debian's `prometheus` package; scripts/test.sh installs it)
scraping `grpo operator` (the session's operator: a subprocess under the chart's RBAC against the
real control plane, its /metrics on GRPO_OPERATOR_METRICS_PORT), returns data.

Two GRPOJobs (file:// storage) give every panel something to show:
- `running`: its pods reported Running, so it goes Pending -> Running (jobs by phase, transitions);
- `restarted`: rank 0 of its trainer fails, so the operator replaces the trainer Job (trainer
  restarts, the $job variable), as tests/operator/test_operator_controlplane.py does.
Reconciles (every event and the 1 s resync) give the latency and rate panels; the error panel's
counter exists at 0 for every kind (metrics.ERROR_KINDS) without any failed reconcile.
The stat panels of phases no job is in (Suspended, Succeeded, Failed) show 0: the operator
reports every phase of a namespace it has jobs in. No query is exempt (EXCEPTIONS is empty).

Like tests/integration/test_dashboards_prometheus.py: skipped without the prometheus binary
unless GRPO_REQUIRE_PROMETHEUS=1 (then it fails).
"""

from __future__ import annotations

import json
import time

import pytest

import prometheus_helpers
from prometheus_helpers import Prometheus, panel_queries, variable_queries
from test_operator_controlplane import Cluster

pytestmark = pytest.mark.controlplane

DASHBOARD = "operator"
RUNNING, RESTARTED = "running", "restarted"
# expression -> why it may legitimately return no data in this run (none so far).
EXCEPTIONS: dict[str, str] = {}


def test_every_operator_dashboard_query_returns_data(admin_client, namespace, storage_root, operator, tmp_path):
    exe = prometheus_helpers.require_prometheus()
    t0 = time.monotonic()
    k = Cluster(admin_client, namespace, storage_root)
    variables = {"namespace": namespace, "job": RESTARTED, "__rate_interval": "30s", "__interval": "1s",
                 "__range": "30s", "__range_s": "30"}
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps([{"targets": [f"127.0.0.1:{operator.metrics_port}"], "labels": {}}]))
    prom = Prometheus(exe, tmp_path, targets, job_name="grpo-operator")
    try:
        k.create(RUNNING)
        k.create(RESTARTED, **{"runPolicy.backoffLimit": 1})
        k.run_all(RUNNING)
        k.wait_phase("Running", RUNNING)
        first = k.trainer_pods(RESTARTED, attempt=0)
        k.kubelet(first[0], "Failed", exit_code=1)       # rank 0 crashed: the operator restarts the trainer
        assert k.wait_phase("Restarting", RESTARTED)["restarts"] == 1

        def scraped(expr: str, value: float):
            return lambda: any(float(r["value"][1]) == value for r in prom.query(expr))
        ns = namespace
        prometheus_helpers.wait_until(scraped(
            f'grpo_operator_trainer_restarts_total{{namespace="{ns}", job="{RESTARTED}"}}', 1), 60, 0.5,
            "the restart in Prometheus")
        prometheus_helpers.wait_until(scraped(
            f'grpo_operator_transitions_total{{namespace="{ns}", phase="Running"}}', 1), 60, 0.5,
            "the Running transition in Prometheus")
        time.sleep(3)                                       # a few more scrapes: rates over two samples at least
        assert operator.healthy()
        up = prom.query('up{job="grpo-operator"}')
        assert len(up) == 1 and up[0]["value"][1] == "1", prom.api("targets")["activeTargets"]

        missing = []
        for name, label, selector in variable_queries(DASHBOARD):
            values = prom.api(f"label/{label}/values",
                              **{"match[]": prometheus_helpers.substitute(selector, variables)})
            want = {"namespace": [ns], "job": [RUNNING, RESTARTED]}[name]
            if not set(want) <= set(values):
                missing.append(f"variable ${name}: label_values({selector}, {label}) -> {values}, want {want}")
        queries = panel_queries(DASHBOARD)
        assert len(queries) >= 10, queries
        for title, expr in queries:
            if expr in EXCEPTIONS:
                continue
            if not prom.query(prometheus_helpers.substitute(expr, variables)):
                missing.append(f"{title}: {prometheus_helpers.substitute(expr, variables)}")
        assert operator.healthy()       # the queries saw a live operator, not stale series
        assert not missing, "operator dashboard queries without data:\n" + "\n".join(missing)
        print(f"{len(queries)} operator dashboard queries returned data after {time.monotonic() - t0:.0f}s")
    finally:
        prom.stop()
    assert prom.proc.returncode is not None
