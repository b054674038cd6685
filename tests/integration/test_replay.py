"""Issue 35 item 3, `grpo replay RUN --step N`, on a real run (conftest's `resumed_run`): torchrun
(2 ranks, gloo), a `grpo rollout` server, file:// storage, the tiny model; 2 steps, then the run
resumed (totalSteps 3, so step 3's trainer has another spec than checkpoint step-2's), a
checkpoint after every step, storage.keepRolloutsSteps 1 (item 4).

- steps 2 and 3 (the resumed trainer's) trained again match what the run logged, bit for bit on
  CPU, and the run's files are left as they were;
- step 3 replayed under a changed spec (`--set`) differs: exit 1, naming what differs;
- retention deleted step 1's rollouts and prompts only, kept step 2's (the checkpoint before it is
  kept) and step 3's (the last), and export says so;
- bad input (step 1, which no checkpoint precedes; a step not logged; a deleted checkpoint; the
  resumed trainer's spec with its checkpoints deleted; no key) is one `error:` line and exit 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from integration_helpers import child_env, grpo_cli

pytestmark = pytest.mark.integration

UPDATE_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/advantages/mean",
                  "critic/advantages/std", "critic/score/mean")


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
        assert res.returncode == BAD_INPUT_EXIT_CODE and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], \
            (args, res.stdout, res.stderr)


def test_retention_deletes_only_what_no_resume_or_replay_needs(resumed_run, tmp_path):
    # After step 2: step 1 is older than the last 1 and no checkpoint precedes it (0 is none);
    # step 2 is kept for checkpoint step-1 (replayed above), step 3 is the last.
    for kind in ("rollouts", "prompts"):
        assert sorted(p.name for p in (resumed_run / kind).iterdir() if p.is_dir()) == ["step-2", "step-3"], kind
    assert json.loads((resumed_run / "rollouts" / "retention.json").read_text()) == \
        {"keepRolloutsSteps": 1, "deleted": [[1, 1]]}
    out = tmp_path / "rollouts.jsonl"
    res = subprocess.run([*grpo_cli(), "rollouts", "export", str(resumed_run), "--no-text", "-o", str(out)],
                         capture_output=True, text=True, env=child_env(), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "step 1 deleted by storage.keepRolloutsSteps (1)" in res.stdout, res.stdout
    assert sorted({json.loads(line)["step"] for line in out.read_text().splitlines()}) == [2, 3]
