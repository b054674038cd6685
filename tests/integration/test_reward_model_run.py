"""Issue 31 end to end: `grpo run` of the quickstart with a tiny random classifier reward model
(combine: replace, verl's semantics: the model's score is the reward). The launcher starts the
reward server as a local process; the rollout server scores every sample with it.

- The reward rises against the same run at a learning rate too small to change anything: a random
  RM's score is a fixed function of the text that the policy can learn to please. Measured on this
  machine (2 loaded CPU cores): 0.119 -> 0.17 in 20 steps, 0.19 in 35 (the RM's scores span about
  0.08-0.26), so 20 steps with a 0.02 margin over the control's gain is reliable.
- The reward server is SIGKILLed at step 3: the launcher restarts it, the rollout server's client
  waits for it (or another replica), and the run completes every step; every sample of every
  step has exactly one reward-model score, and it is the sample's reward.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
from pathlib import Path

import pytest
import yaml

from integration_helpers import (QUICKSTART, LauncherRun, cmdline, descendants, parent, read_metrics,
                                 read_step_tables, wait_until)

pytestmark = pytest.mark.integration

RUN_DIR = Path("outputs") / "quickstart" / "tiny_qwen3_grpo"
STEPS = 20
K = 5
CONTROL_LR = 1e-12


def _job(tmp: Path, rm: Path) -> Path:
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["reward"] = {"rewardModels": [{"name": "rm", "path": str(rm), "maxTokensPerBatch": 8192}]}
    doc["spec"]["trainer"].update(totalSteps=STEPS, testFreq=-1, saveFreq=-1, valBeforeTrain=False)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _steps_done(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, grpo_cache):
    from grpo_rollout.tiny import build_tiny_reward_model
    tmp = tmp_path_factory.mktemp("rm-run")
    job = _job(tmp, build_tiny_reward_model(tmp / "tiny-rm", seed=1))
    out = {}
    for name, extra in (("learn", []), ("control", [f"trainer.lr={CONTROL_LR}"])):
        (tmp / name).mkdir()
        out[name] = LauncherRun(job, tmp / name, grpo_cache, extra)
    learn = out["learn"]
    try:
        wait_until(lambda: _steps_done(learn.cwd / RUN_DIR) >= 3, 900, what="step 3")
        [victim] = [pid for pid in descendants(learn.proc.pid)
                    if parent(pid) == learn.proc.pid and "reward" in cmdline(pid)]
        os.kill(victim, signal.SIGKILL)
        codes = {name: run.wait(1800) for name, run in out.items()}
    finally:
        for run in out.values():
            if run.proc.poll() is None:
                run.kill_tree()
    for name, code in codes.items():
        assert code == 0, f"{name}: {out[name].log()[-6000:]}"
    return {name: (run.cwd / RUN_DIR, run.log()) for name, run in out.items()}


def _gain(run_dir: Path) -> tuple[float, float]:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    score = [r["critic/score/mean"] for r in rows]
    return statistics.fmean(score[:K]), statistics.fmean(score[-K:])


def test_reward_model_reward_rises_beyond_a_no_learning_control(runs):
    (l0, l1), (c0, c1) = _gain(runs["learn"][0]), _gain(runs["control"][0])
    detail = f"learn {l0:.4f} -> {l1:.4f}; control (lr={CONTROL_LR}) {c0:.4f} -> {c1:.4f}"
    print(detail)
    assert abs(c1 - c0) < 0.01, detail
    assert (l1 - l0) > (c1 - c0) + 0.02, detail


def test_a_reward_server_that_cannot_start_is_named(tmp_path, grpo_cache):
    run = LauncherRun(QUICKSTART, tmp_path, grpo_cache, ["reward.rewardModels=[{name: rm, path: /nonexistent/rm, gpus: 0}]"])
    assert run.wait(300) == 1
    assert ("error: reward-rm-0 exited with 2: grpo reward: spec.reward.rewardModels[0].path: '/nonexistent/rm' "
            "does not exist") in run.log(), run.log()[-3000:]
    assert not list((tmp_path / RUN_DIR).glob("rollouts/*")), "nothing may be generated"


def test_killed_reward_server_is_restarted_and_every_sample_is_scored_once(runs):
    run_dir, log = runs["learn"]
    assert "reward-rm-0 exited with -9; restarting it (1/" in log, log[-6000:]
    for step in range(1, STEPS + 1):
        rows = read_step_tables(run_dir, "rollouts", step).to_pylist()
        # The accepted shards cover the batch once: 64 prompts x 8 samples, each scored by the RM.
        assert len(rows) == 64 * 8 and len({(r["uid"], r["sample_index"]) for r in rows}) == len(rows)
        for r in rows:
            extra = json.loads(r["reward_extra"])
            assert r["reward"] == pytest.approx(extra["rm/rm"], abs=1e-6)   # combine replace
            assert "rule_score" in extra
