"""Issue 9: every query of the training and rollout Grafana dashboards, evaluated by a real
Prometheus (Debian's `prometheus` package; scripts/test.sh installs it) scraping a running local
job, returns data.

`grpo run examples/quickstart.yaml --metrics` (shortened with --set, in a temp cwd; GRPO_CACHE as
the user has it, so the builtin:// model and data are reused) exposes the trainer's and the rollout
server's /metrics on fixed ports and writes <run>/metrics-targets.json; Prometheus scrapes those
targets (file_sd, 1s interval, honor_labels so the series keep their job/namespace labels). Once
the run has made a few steps (validation and a checkpoint included), each panel expression, its
Grafana variables substituted, goes to /api/v1/query: the result must be non-empty. The queries
run while the job runs (a finished target's series go stale and vanish from instant queries);
then the test Ctrl-Cs the launcher and checks that no process outlives it.

The run is set up so that every panel has something to show:
- algorithm.useKLLoss=true: actor/kl_loss (the KL panel) exists only with the KL loss on;
- GRPO_PEAK_FLOPS: on CPU the trainer knows no peak FLOP/s and exports no perf/mfu (the MFU panel
  is then legitimately empty); the documented override makes MFU computable here;
- trainer.testFreq / saveFreq = 5: val/score and timing_s/checkpoint exist once step 5 is done.
No query is exempt (EXCEPTIONS below is empty); add one only with its reason.

The operator dashboard is not covered here: its series come from `grpo operator` under a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from integration_helpers import QUICKSTART, REPO, alive, child_env, descendants, grpo_cli, wait_until

pytestmark = pytest.mark.integration

DASHBOARDS = REPO / "charts" / "grpo-operator" / "dashboards"
RUN_DIR = Path("outputs") / "quickstart" / "tiny_qwen3_grpo"
JOB, NAMESPACE = "quickstart", "default"      # quickstart.yaml's metadata.name; the launcher's namespace
TOTAL_STEPS = 200                             # not reached: the test stops the run (Ctrl-C) once it has queried
QUERY_AFTER_STEP = 7                          # past step 5's validation and checkpoint
OVERRIDES = [f"trainer.totalSteps={TOTAL_STEPS}", "trainer.testFreq=5", "trainer.saveFreq=5",
             "algorithm.useKLLoss=true", "data.trainBatchSize=16", "trainer.miniBatchSize=16",
             "trainer.microBatchSizePerGPU=128"]
# Grafana's variables, as the dashboards would be viewed on this run.
VARIABLES = {"namespace": NAMESPACE, "job": JOB, "__rate_interval": "30s", "__interval": "1s",
             "__range": "30s", "__range_s": "30"}
# expression -> why it may legitimately return no data in this run (none so far).
EXCEPTIONS: dict[str, str] = {}


def _prometheus() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        msg = "prometheus not installed (scripts/test.sh installs Debian's package)"
        if os.environ.get("GRPO_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(msg + " and GRPO_REQUIRE_PROMETHEUS=1")
        pytest.skip(msg)
    return exe


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def substitute(expr: str) -> str:
    for name in sorted(VARIABLES, key=len, reverse=True):   # $__range_s before $__range
        expr = expr.replace("${" + name + "}", VARIABLES[name]).replace("$" + name, VARIABLES[name])
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
    def __init__(self, exe: str, workdir: Path, targets: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({     # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "grpo-local", "honor_labels": True,
                                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}],
        }))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self._ready, 60, 0.5, "prometheus ready")

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


class MetricsRun:
    """`grpo run QUICKSTART --metrics --set ...` in its own cwd and session."""

    def __init__(self, cwd: Path):
        self.cwd, self.log_path = cwd, cwd / "run.log"
        sets = [a for kv in OVERRIDES for a in ("--set", kv)]
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([*grpo_cli(), "run", str(QUICKSTART), "--metrics", *sets], cwd=cwd,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=child_env(GRPO_PEAK_FLOPS="1e12"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        assert self.proc.poll() is None, f"grpo run exited with {self.proc.returncode}:\n{self.log()[-6000:]}"

    def stop(self) -> dict[int, int]:
        """Ctrl-C the launcher (it stops its children), then SIGKILL whatever is left under it;
        returns the tree that ran ({pid: start time})."""
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        leftover = {pid: start for pid, start in tree.items() if alive(pid, start)}
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        return leftover


def test_every_training_and_rollout_dashboard_query_returns_data(tmp_path):
    exe = _prometheus()
    t0 = time.monotonic()
    run = MetricsRun(tmp_path)
    prom = None
    try:
        targets = tmp_path / RUN_DIR / "metrics-targets.json"
        wait_until(lambda: run.check_alive() or targets.exists(), 300, 0.5, "metrics-targets.json")
        expected = json.loads(targets.read_text())
        assert {g["labels"]["component"] for g in expected} == {"trainer", "rollout"}
        prom = Prometheus(exe, tmp_path, targets)

        def stepped() -> bool:
            run.check_alive()
            step = prom.query(f'max(grpo_trainer_training_step{{job="{JOB}", namespace="{NAMESPACE}"}})')
            return bool(step) and float(step[0]["value"][1]) >= QUERY_AFTER_STEP
        wait_until(stepped, 900, 1.0, f"the trainer's step >= {QUERY_AFTER_STEP} in Prometheus")
        time.sleep(3)                                   # a few more scrapes: rates over two samples at least
        run.check_alive()
        up = prom.query('up{job=~".+"}')
        assert len(up) == len(expected) and all(r["value"][1] == "1" for r in up), \
            [(t["labels"], t["health"], t["lastError"]) for t in prom.api("targets")["activeTargets"]]

        missing = []
        for dashboard in ("training", "rollout"):
            for name, label, selector in variable_queries(dashboard):
                values = prom.api(f"label/{label}/values", **{"match[]": substitute(selector)})
                want = {"namespace": NAMESPACE, "job": JOB}[name]
                if want not in values:
                    missing.append(f"{dashboard} variable ${name}: label_values({selector}, {label}) -> {values}")
            for title, expr in panel_queries(dashboard):
                if expr in EXCEPTIONS:
                    continue
                if not prom.query(substitute(expr)):
                    missing.append(f"{dashboard} / {title}: {substitute(expr)}")
        run.check_alive()   # the queries saw a live run, not stale series
        assert all(r["value"][1] == "1" for r in prom.query('up{job=~".+"}'))
        assert not missing, "dashboard queries without data:\n" + "\n".join(missing)
        print(f"{sum(len(panel_queries(d)) for d in ('training', 'rollout'))} queries returned data "
              f"after {time.monotonic() - t0:.0f}s")
    finally:
        leftover = run.stop()
        if prom is not None:
            prom.stop()
    assert not leftover, f"processes outlived the launcher's Ctrl-C: {leftover}"
    assert run.proc.returncode == 130, run.log()[-3000:]
