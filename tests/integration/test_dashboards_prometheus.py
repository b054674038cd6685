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
- a reward model (builtin://tiny-qwen3-rm, weight 0 under combine sum: the rule's reward unchanged): the
  reward-model panels (issue 31).
No query is exempt (EXCEPTIONS below is empty); add one only with its reason.

The operator dashboard is covered by tests/operator/test_operator_dashboard.py (its series come
from `grpo operator` under the control plane); the Prometheus helpers are in tests/prometheus_helpers.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import prometheus_helpers
from integration_helpers import QUICKSTART, alive, child_env, descendants, grpo_cli, wait_until
from prometheus_helpers import Prometheus, panel_queries, variable_queries

pytestmark = pytest.mark.integration

RUN_DIR = Path("outputs") / "quickstart" / "tiny_qwen3_grpo"
JOB, NAMESPACE = "quickstart", "default"      # quickstart.yaml's metadata.name; the launcher's namespace
TOTAL_STEPS = 200                             # not reached: the test stops the run (Ctrl-C) once it has queried
QUERY_AFTER_STEP = 7                          # past step 5's validation and checkpoint
OVERRIDES = [f"trainer.totalSteps={TOTAL_STEPS}", "trainer.testFreq=5", "trainer.saveFreq=5",
             "algorithm.useKLLoss=true", "data.trainBatchSize=16", "trainer.miniBatchSize=16",
             "trainer.microBatchSizePerGPU=128",
             # The reward-model panels: a tiny classifier whose score adds nothing (weight 0, combine sum).
             "reward.combine=sum", "reward.rewardModels=[{name: rm, path: 'builtin://tiny-qwen3-rm', weight: 0, gpus: 0}]"]
# Grafana's variables, as the dashboards would be viewed on this run.
VARIABLES = {"namespace": NAMESPACE, "job": JOB, "__rate_interval": "30s", "__interval": "1s",
             "__range": "30s", "__range_s": "30"}
# expression -> why it may legitimately return no data in this run (none so far).
EXCEPTIONS: dict[str, str] = {}


def substitute(expr: str) -> str:
    return prometheus_helpers.substitute(expr, VARIABLES)


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
    exe = prometheus_helpers.require_prometheus()
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
