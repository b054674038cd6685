"""A broken reward function stops the run, loudly (issue 48 item 1): through `grpo run`, as a user
meets it. verl stops on an exception in compute_score; here every sample it fails scores 0 and
is counted, and past spec.reward.maxErrorFraction (unset: every sample of a step) the trainer stops before training
on them, with exit code 2 and one line naming the function and its error."""

from __future__ import annotations

import subprocess

import pytest

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from integration_helpers import child_env, grpo_cli, run_root, write_job

pytestmark = pytest.mark.integration


def test_a_raising_reward_function_stops_grpo_run_with_its_error(tmp_path, tiny_model, quickstart_data):
    reward = tmp_path / "broken_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise KeyError('answer')     # e.g. a field the dataset's rows don't have\n")
    job = write_job(tmp_path / "job.yaml", name="broken-reward", model=tiny_model, train=quickstart_data[0],
                    storage=tmp_path / "store", reward={"function": f"{reward}:compute_score"},
                    rollout={"replicas": 1})
    out = subprocess.run([*grpo_cli(), "run", str(job)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=child_env(GRPO_CACHE=str(tmp_path / ".cache")))
    assert out.returncode == BAD_INPUT_EXIT_CODE, out.stderr[-4000:]
    # 4 prompts x 4 samples, every one failed; said once, by the trainer, with the function's own error
    error = (f"error: the reward function failed for 16 of 16 samples of step 1 (exception 16), more than "
             f"spec.reward.maxErrorFraction (unset: all but every sample) allows; the first: "
             f"{reward}:compute_score: KeyError: 'answer'")
    assert out.stderr.count(error) == 1, out.stderr[-4000:]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    # nothing was trained on the zeros
    root = run_root(tmp_path / "store", "broken-reward")
    assert not (root / "checkpoints").exists() and not (root / "metrics.jsonl").exists()
