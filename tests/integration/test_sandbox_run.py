"""`grpo run` with the `python` tool on sandbox servers (issue 32 item 5): the launcher starts
`python.replicas` sandbox servers as local processes before the rollout server, which sends every
program there. The lookup task's model also writes a `python` call (tool_task.PYTHON_CALL_TOKEN,
a program that prints 1). One sandbox server is SIGKILLed once it has run programs: the launcher
restarts it, the programs go to the other one meanwhile, and the run completes every step."""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from integration_helpers import LauncherRun, cmdline, descendants, read_metrics, read_step_tables, wait_until

pytestmark = pytest.mark.integration

STEPS = 8


def _job(tmp, model, train):
    doc = {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "sandbox-run"}, "spec": {
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"trainFiles": [str(train)], "trainBatchSize": 16, "maxPromptLength": 24, "maxResponseLength": 14},
        "algorithm": {"useKLLoss": False},
        "reward": {"function": "grpo_rollout.tool_task:compute_score"},
        "rollout": {"engine": "hf", "n": 8, "replicas": 1, "multiTurn": {
            "enable": True, "tools": ["grpo_rollout.tool_task:lookup", "python"], "maxAssistantTurns": 3,
            "python": {"replicas": 2, "timeoutSeconds": 5}}},
        "trainer": {"device": "cpu", "nprocPerNode": 1, "miniBatchSize": 16, "microBatchSizePerGPU": 128,
                    "totalSteps": STEPS, "testFreq": -1, "saveFreq": -1, "valBeforeTrain": False},
        "storage": {"uri": f"file://{tmp / 'store'}"}}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _runs_logged(logs) -> int:
    return sum(line.count(": ok in ") for f in logs.glob("sandbox-*.log") for line in f.read_text().splitlines())


def test_the_python_tool_runs_on_sandbox_servers_and_a_killed_one_is_restarted(tmp_path, grpo_cache):
    from grpo_rollout import tool_task
    model = tool_task.build_model(tmp_path / "model", calls=(tool_task.CALL_TOKEN, tool_task.PYTHON_CALL_TOKEN))
    train, _ = tool_task.write_dataset(tmp_path / "data", n_train=64, n_val=4)
    run = LauncherRun(_job(tmp_path, model, train), tmp_path, grpo_cache, [])
    root = tmp_path / "store" / "default" / "sandbox-run"
    try:
        wait_until(lambda: _runs_logged(root / "logs") > 0, 900, what="a program run on a sandbox server")
        victim = next(pid for pid in descendants(run.proc.pid) if "sandbox" in cmdline(pid))
        os.kill(victim, signal.SIGKILL)
        code = run.wait(1200)
    finally:
        if run.proc.poll() is None:
            run.kill_tree()
    log = run.log()
    assert code == 0, log[-6000:]
    assert "exited with -9; restarting it (1/" in log and "sandbox-" in log, log[-6000:]
    assert [r["step"] for r in read_metrics(root)] == list(range(1, STEPS + 1))
    calls = [c for step in range(1, STEPS + 1) for r in read_step_tables(root, "rollouts", step).to_pylist()
             for c in json.loads(r["agent"])["tool_calls"] if c["name"] == "python"]
    ran = [c for c in calls if not c["error"]]
    assert ran, f"no python call ran: {calls[:5]}"
    # Each program that answered was run, and logged, by a sandbox server (a retried one may be
    # logged twice: run by the killed server, its answer lost).
    assert _runs_logged(root / "logs") >= len(ran)
    # With a second replica up, no call found the sandbox unavailable for its whole timeout.
    assert {c["error"] for c in calls} <= {"", "parse"}, {c["error"] for c in calls}
    rollout_log = (root / "logs" / "rollout-0.log").read_text()
    assert "python runs on sandbox servers 127.0.0.1:" in rollout_log, rollout_log[-3000:]
