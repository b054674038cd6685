"""Issue 35 item 3, `grpo replay RUN --step N`, on a real run: torchrun (2 ranks, gloo), a `grpo
rollout` server, file:// storage, the tiny model; 2 steps, then the run resumed (totalSteps 3, so
step 3's trainer has another spec than checkpoint step-2's), a checkpoint after every step.

- steps 2 and 3 (the resumed trainer's) trained again match what the run logged, bit for bit on
  CPU, and the run's files are left as they were;
- step 3 replayed under a changed spec (`--set`) differs: exit 1, naming what differs;
- bad input (step 1, which no checkpoint precedes; a step not logged; a deleted checkpoint; the
  resumed trainer's spec with its checkpoints deleted; no key) is one `error:` line and exit 2.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from integration_helpers import child_env, grpo_cli, run_root, run_trainer, start_rollout_servers, write_job

pytestmark = pytest.mark.integration

UPDATE_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/advantages/mean",
                  "critic/advantages/std", "critic/score/mean")


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, tiny_model, quickstart_data, dense_reward) -> Path:
    tmp = tmp_path_factory.mktemp("replay")
    token = secrets.token_hex(16)
    job = write_job(tmp / "replay.yaml", name="replay", model=tiny_model, train=quickstart_data[0],
                    storage=tmp / "store", reward={"function": dense_reward},
                    trainer={"totalSteps": 2, "saveFreq": 1, "keepCheckpoints": None})
    servers = start_rollout_servers(job, token, 1, tmp)
    try:
        rollout = servers[0].address
        result = run_trainer(job, rollout=rollout, token=token)
        assert result.returncode == 0, result.output[-8000:]
        result = run_trainer(job, rollout=rollout, token=token, overrides=("trainer.totalSteps=3",),
                             log_path=tmp / "resumed.log")
        assert result.returncode == 0 and "Resumed from" in result.output, result.output[-8000:]
    finally:
        for s in servers:
            s.stop()
    return run_root(tmp / "store", "replay")


def replay(run: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*grpo_cli(), "replay", str(run), *map(str, args)], capture_output=True, text=True,
                          env=child_env(**env), timeout=300)


def table(stdout: str) -> dict[str, tuple[float, float, float]]:
    """{metric: (logged, replayed, |diff|)} of replay's table."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and "/" in parts[0]:
            rows[parts[0]] = tuple(float(p) for p in parts[1:4])
    return rows


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_a_replayed_step_matches_its_log_exactly_and_leaves_the_run_alone(resumed_run):
    before = files(resumed_run)
    for step in (2, 3):
        res = replay(resumed_run, "--step", step)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"from checkpoints/step-{step - 1} on 2 cpu ranks" in res.stdout
        rows = table(res.stdout)
        for name in UPDATE_METRICS:
            logged, replayed, diff = rows[name]
            assert logged == replayed and diff == 0, (step, name, rows[name])
        assert rows["actor/grad_norm"][0] > 0           # a real update, not two zeros
        assert f"All {len(rows)} metrics match (exactly)" in res.stdout
    assert files(resumed_run) == before


def test_a_replay_under_another_spec_differs(resumed_run):
    # A 10x KL loss: the same samples, losses and advantages (taken before the update), another gradient.
    res = replay(resumed_run, "--step", 3, "--set", "algorithm.klLossCoef=0.01")
    assert res.returncode == 1, res.stdout + res.stderr
    rows = table(res.stdout)
    assert rows["actor/grad_norm"][2] > 0, rows["actor/grad_norm"]
    assert all(rows[name][2] == 0 for name in UPDATE_METRICS if name != "actor/grad_norm"), rows
    assert res.stdout.splitlines()[-1] == f"1 of {len(rows)} metrics differ beyond the tolerance (0): actor/grad_norm"


def test_bad_input_is_one_error_line(resumed_run, tmp_path):
    run = Path(shutil.copytree(resumed_run, tmp_path / "run"))
    shutil.rmtree(run / "checkpoints" / "step-1")
    shutil.rmtree(run / "checkpoints" / "step-3")      # the only one of the trainer that trained step 3
    cases = [(["--step", 1], {}, "--step 1: no checkpoint before it"),
             (["--step", 7], {}, "--step 7: no such step"),
             (["--step", 2], {}, "checkpoints of steps [2]"),
             (["--step", 3], {}, "no checkpoint keeps the spec it was trained under"),
             (["--step", 3], {"GRPO_CHECKPOINT_KEY": ""}, "no checkpoint key")]
    for args, env, says in cases:
        res = replay(run, *args, **env)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], \
            (args, res.stdout, res.stderr)
