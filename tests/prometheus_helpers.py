"""A real Prometheus (Debian's `prometheus` package; scripts/test.sh installs it) for the
dashboard tests, and the Grafana dashboards' queries (charts/grpo-operator/dashboards/*.json).

Used by tests/integration/test_dashboards_prometheus.py (training and rollout dashboards, a local
run) and tests/operator/test_operator_dashboard.py (operator dashboard, the operator under the
control plane). tests/ is on sys.path (the root conftest.py is not in a package).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from polling import wait_until
from ports import free_port

DASHBOARDS = Path(__file__).resolve().parents[1] / "charts" / "grpo-operator" / "dashboards"


def require_prometheus() -> str:
    """The prometheus binary; skips without it, fails instead with GRPO_REQUIRE_PROMETHEUS=1."""
    exe = shutil.which("prometheus")
    if exe is None:
        msg = "prometheus not installed (scripts/test.sh installs Debian's package)"
        if os.environ.get("GRPO_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(msg + " and GRPO_REQUIRE_PROMETHEUS=1")
        pytest.skip(msg)
    return exe


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with Grafana's variables ($name and ${name}) replaced by `variables`' values."""
    for name in sorted(variables, key=len, reverse=True):   # $__range_s before $__range
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def panel_queries(dashboard: str) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel (rows' nested panels included)."""
    doc = json.loads((DASHBOARDS / f"{dashboard}.json").read_text())
    out, panels = [], list(doc["panels"])
    while panels:
        p = panels.pop(0)
        panels += p.get("panels", [])
        out += [(p.get("title", ""), t["expr"]) for t in p.get("targets", []) if t.get("expr")]
    return out


def variable_queries(dashboard: str) -> list[tuple[str, str, str]]:
    """(variable, label, series selector) of each `label_values(selector, label)` variable."""
    doc = json.loads((DASHBOARDS / f"{dashboard}.json").read_text())
    out = []
    for v in doc.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if isinstance(q, str) and q.startswith("label_values("):
            selector, _, label = q[len("label_values("):-1].rpartition(",")
            out.append((v["name"], label.strip(), selector.strip()))
    return out


class Prometheus:
    """Prometheus scraping the targets of a file_sd file (`targets`) every second, honor_labels
    (the series keep their own job/namespace labels, as the chart's monitors do)."""

    def __init__(self, exe: str, workdir: Path, targets: Path, job_name: str = "grpo-local"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({     # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job_name, "honor_labels": True,
                                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}],
        }))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(self._ready, 60, 0.5, "prometheus ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log_path.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def pod_monitor_targets(pod_monitor: dict, pods: dict[str, dict]) -> set[tuple[str, str]]:
    """The (pod, port name) targets Prometheus scrapes for `pod_monitor` among `pods` (name ->
    pod template), as the Prometheus Operator configures it: the selector's labels and NotIn
    expressions, an endpoint's `port` by name (every declared container port without one), then
    its `keep` relabelings over the pod's meta labels (regexes anchored, as Prometheus's are)."""
    import re
    spec, targets = pod_monitor["spec"], set()
    for pod_name, pod in pods.items():
        labels = pod["metadata"].get("labels", {})
        if any(labels.get(k) != v for k, v in spec["selector"].get("matchLabels", {}).items()):
            continue
        if any(e["operator"] == "NotIn" and labels.get(e["key"]) in e["values"]
               for e in spec["selector"].get("matchExpressions", [])):
            continue
        meta = {f"__meta_kubernetes_pod_label_{re.sub('[^a-zA-Z0-9_]', '_', k)}": v for k, v in labels.items()}
        ports = [p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        for endpoint in spec["podMetricsEndpoints"]:
            for port in ports:
                if endpoint.get("port", port) != port:
                    continue
                values = {**meta, "__meta_kubernetes_pod_container_port_name": port}
                if all(rule["action"] == "keep" and re.fullmatch(
                        rule["regex"], ";".join(values.get(s, "") for s in rule["sourceLabels"]))
                       for rule in endpoint.get("relabelings", [])):
                    targets.add((pod_name, port))
    return targets
