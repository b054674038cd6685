"""The trainer dying (issue 12; with PPO's critic, issue 30): SIGKILL in the middle of a step, and a checkpoint whose write
was cut short. Real processes on CPU: the trainer under torchrun (1 rank, gloo), one `grpo
rollout` server, file:// storage, the tiny Qwen3 model.

What must hold: the restarted trainer resumes from the latest *complete* checkpoint (one with
manifest.json), redoes exactly the steps after it with the same prompts in the same order, and
ends where an uninterrupted run ends. (A SIGTERM, the graceful stop, is covered by
tests/integration/test_local_run.py::test_ctrl_c_stops_everything_and_a_rerun_resumes.)
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import pytest

from faults_helpers import Hold, accepted_rollouts, kill_tree, prompts_of, trainer_log_tail
from integration_helpers import (child_env, load_safetensors, read_metrics, run_root, run_trainer,
                                 start_rollout_servers, trainer_argv, wait_until, write_job)

pytestmark = [pytest.mark.faults, pytest.mark.integration]

STEPS = 4
CALLS_PER_STEP = 4 * 4        # trainBatchSize x n: reward calls the one server makes per step


def _complete(root) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in (root / "checkpoints").glob("step-*/manifest.json"))


def _sorted_responses(root, step: int) -> list:
    table = accepted_rollouts(root, step).sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")])
    return table.column("response_ids").to_pylist()


# PPO: the critic (its weights, optimizer and schedule) is in the checkpoint and resumes with it.
ALGORITHMS = {"grpo": {}, "ppo": {"algorithm": {"advEstimator": "gae", "lam": 0.95}, "critic": {"lr": 1e-4}}}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_trainer_killed_mid_step_resumes_from_the_last_complete_checkpoint(algorithm, tmp_path, tiny_model,
                                                                            train_data, token):
    hold = Hold(tmp_path / "hold")
    common = dict(model=tiny_model, train=train_data, storage=tmp_path / "store", **ALGORITHMS[algorithm],
                  reward={"function": hold.function, "workers": 1, "timeoutSeconds": 600},
                  rollout={"replicas": 1}, weightSync={"backend": "grpc"},
                  trainer={"nprocPerNode": 1, "totalSteps": STEPS, "saveFreq": 1})    # keepCheckpoints: 2
    job = write_job(tmp_path / "job.yaml", name="killed", **common)
    reference_job = write_job(tmp_path / "reference.yaml", name="reference", **common)
    root, reference = run_root(tmp_path / "store", "killed"), run_root(tmp_path / "store", "reference")
    (server,) = start_rollout_servers(job, token, 1, tmp_path)
    try:
        # 1. SIGKILL the trainer (torchrun and its rank) while step 3's Generate is in flight:
        #    the server is held at its first reward call of step 3.
        hold.arm(server.proc.pid, after=2 * CALLS_PER_STEP)
        log_path = tmp_path / "killed.log"
        with open(log_path, "wb") as out:
            trainer = subprocess.Popen(trainer_argv(job, server.address, 1), stdout=out, stderr=subprocess.STDOUT,
                                       env=child_env(GRPO_RPC_TOKEN=token), cwd=tmp_path, start_new_session=True)
        try:
            hold.wait_holding(server.proc.pid, 300, also=lambda: trainer.poll() is not None)
            kill_tree(trainer.pid)
            trainer.wait()
        finally:
            if trainer.poll() is None:
                kill_tree(trainer.pid)
                trainer.wait()
        hold.release()
        assert _complete(root) == [1, 2], trainer_log_tail(log_path)
        assert [r["step"] for r in read_metrics(root)] == [1, 2]
        killed_step3_uids = prompts_of(root, 3).column("uid").to_pylist()
        # the server finishes the orphaned request: a late rollout shard nobody accepted
        late = root / "rollouts" / "step-3" / "train-shard-000-attempt-1.parquet"
        wait_until(late.exists, 120, what="the orphaned request's late write")

        # 2. A checkpoint write cut short: step 3's DCP files are there, its manifest is not.
        partial = root / "checkpoints" / "step-3"
        shutil.copytree(root / "checkpoints" / "step-2", partial)
        (partial / "manifest.json").unlink()
        assert _complete(root) == [1, 2]

        # 3. Restart: resume: auto takes step 2, the latest complete checkpoint.
        resumed = run_trainer(job, rollout=server.address, token=token, nproc=1, log_path=tmp_path / "resumed.log")
        assert resumed.returncode == 0, resumed.output[-8000:]
        assert f"Resumed from file://{root}/checkpoints/step-2 (step 2, policy version 2)" in resumed.output
        assert "Step 1 / " not in resumed.output and "Step 2 / " not in resumed.output   # kept, not redone
        assert "Step 3 / " in resumed.output and "Step 4 / " in resumed.output           # redone / new
        # progress.json (the status) says the run resumed, and from where
        progress = json.loads((root / "progress.json").read_text())
        assert progress["resumedFromStep"] == 2 and progress["resumedAt"].endswith("Z"), progress

        # 4. The same job without a fault, on the same server.
        straight = run_trainer(reference_job, rollout=server.address, token=token, nproc=1,
                               log_path=tmp_path / "reference.log")
        assert straight.returncode == 0, straight.output[-8000:]
        assert "resumedFromStep" not in json.loads((reference / "progress.json").read_text())
    finally:
        hold.release()
        server.stop()

    # the same prompts in the same order, step by step (step 3 also as the killed run sent it)
    for step in range(1, STEPS + 1):
        assert prompts_of(root, step).column("uid").to_pylist() == \
            prompts_of(reference, step).column("uid").to_pylist(), step
        assert _sorted_responses(root, step) == _sorted_responses(reference, step), step
    assert killed_step3_uids == prompts_of(reference, 3).column("uid").to_pylist()
    # each step logged once; the same learning curve
    got, want = read_metrics(root), read_metrics(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert a["critic/score/mean"] == pytest.approx(b["critic/score/mean"]), a["step"]
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], rel=1e-4, abs=1e-6), a["step"]
        if algorithm == "ppo":   # the critic resumed too: the same values and value loss
            assert a["critic/vf_loss"] == pytest.approx(b["critic/vf_loss"], rel=1e-4, abs=1e-6), a["step"]
            assert a["critic/values/mean"] == pytest.approx(b["critic/values/mean"], rel=1e-4, abs=1e-6), a["step"]
    # the partial checkpoint was never used, and step 3's real one replaced it
    assert _complete(root) == [3, 4]
    assert json.loads((partial / "trainer_state.json").read_text())["step"] == 3
    import torch
    final, expected = load_safetensors(root / "hf" / f"step-{STEPS}"), load_safetensors(reference / "hf" / f"step-{STEPS}")
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_stop_while_the_rollout_servers_are_gone_ends_the_trainer_at_once(tmp_path, tiny_model, train_data, token):
    """A GRPOJob deleted mid-run may lose its rollout pods before its trainer: the step in flight
    can't finish, so on SIGTERM the trainer stops itself (it used to wait on the servers until
    the grace period's SIGKILL). The server dies after step 1; the request timeout is 600 s."""
    job = write_job(tmp_path / "job.yaml", name="orphaned", model=tiny_model, train=train_data,
                    storage=tmp_path / "store", rollout={"replicas": 1, "requestTimeoutSeconds": 600},
                    weightSync={"backend": "grpc"}, trainer={"nprocPerNode": 1, "totalSteps": 50, "saveFreq": 1})
    root = run_root(tmp_path / "store", "orphaned")
    (server,) = start_rollout_servers(job, token, 1, tmp_path)
    log_path = tmp_path / "trainer.log"
    with open(log_path, "wb") as out:
        trainer = subprocess.Popen(trainer_argv(job, server.address, 1), stdout=out, stderr=subprocess.STDOUT,
                                   env=child_env(GRPO_RPC_TOKEN=token), cwd=tmp_path, start_new_session=True)
    try:
        wait_until(lambda: (root / "checkpoints" / "step-1" / "manifest.json").exists()
                   or trainer.poll() is not None, 300, what="step 1's checkpoint")
        kill_tree(server.proc.pid)
        server.proc.wait()
        wait_until(lambda: "failed (attempt" in trainer_log_tail(log_path), 120, what="a dispatch to the dead server")
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(120)      # well inside the 600 s the dispatcher would wait for a server
    finally:
        if trainer.poll() is None:
            kill_tree(trainer.pid)
            trainer.wait()
        server.stop()
    log = trainer_log_tail(log_path)
    assert "Stopping on SIGTERM during step" in log and "a resume redoes it from" in log, log
    assert trainer.returncode != 0, log
