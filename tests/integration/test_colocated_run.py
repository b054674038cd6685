"""Issue 46, colocated placement under `grpo run`: the quickstart with two trainer ranks, each with
its own hf rollout server started by the trainer process (`grpo trainer --colocate`), not by the
launcher. Both servers generate the run's rollouts and sleep through every update; a server that dies fails the trainer (as it
fails the trainer pod on Kubernetes), and nothing of the run outlives it."""

from __future__ import annotations

import json
import os
import signal

import pyarrow.parquet as pq
import pytest

from integration_helpers import QUICKSTART, LauncherRun, alive, cmdline, descendants, read_metrics, wait_until

pytestmark = pytest.mark.integration

RUN_DIR = ("outputs", "quickstart", "tiny_qwen3_grpo")
COLOCATED = ["trainer.testFreq=-1", "trainer.saveFreq=-1", "trainer.valBeforeTrain=false", "trainer.totalSteps=50",
             "trainer.nprocPerNode=2", "rollout.placement=colocated", "rollout.replicas=2"]


def _step(run_dir) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_each_rank_has_its_server_and_a_dead_server_fails_the_trainer(tmp_path, grpo_cache):
    run = LauncherRun(QUICKSTART, tmp_path, grpo_cache, COLOCATED)
    run_dir = tmp_path.joinpath(*RUN_DIR)
    try:
        wait_until(lambda: _step(run_dir) >= 2, 600, what="step 2")
        tree = descendants(run.proc.pid)
        servers = {pid: " ".join(cmdline(pid)) for pid in tree if "rollout" in cmdline(pid)}
        # the launcher started no server: the trainer process did, one per rank (tensorParallelSize 1)
        assert sorted(c.split("--worker-id ")[1].split()[0] for c in servers.values()) == [
            "trainer-0-rollout-0", "trainer-0-rollout-1"], servers
        workers = {w for f in run_dir.rglob("rollouts/**/*.parquet")
                   for w in pq.read_table(f, columns=["worker"]).column("worker").to_pylist()}
        assert workers == {"trainer-0-rollout-0", "trainer-0-rollout-1"}, workers
        # the servers slept through each update and woke for the weight sync, each transition timed
        rows = read_metrics(run_dir)
        assert rows and all(r["timing_s/sleep"] >= 0 and r["timing_s/wake"] >= 0 for r in rows), rows[-1]
        victim = next(pid for pid, c in servers.items() if "trainer-0-rollout-1" in c)
        os.kill(victim, signal.SIGKILL)
        code = run.wait(300)
    finally:
        if run.proc.poll() is None:
            run.kill_tree()
    out = run.log()
    assert code == 1, out[-6000:]
    assert "colocated rollout server 1" in out and "exited with -9" in out, out[-6000:]
    assert "restarting it" not in out                      # the launcher restarts no colocated server
    survivors = {pid: cmdline(pid) for pid, start in tree.items() if alive(pid, start)}
    assert not survivors, survivors
