"""A rollout server's log is kept in the job's storage (GRPO_LOG_URI, which the operator sets to
`<run>/logs/<pod>.log`): a finished job scales its rollout pods away, and their logs with them
(issue 36). The real `grpo rollout` process, file:// storage."""

from __future__ import annotations

import secrets
import subprocess

import pytest

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from integration_helpers import RolloutServer, child_env, grpo_cli, wait_until, write_job

pytestmark = pytest.mark.integration


def test_a_rollout_servers_log_is_kept_in_storage_and_in_the_pods_own_log(tmp_path, tiny_model, quickstart_data,
                                                                          monkeypatch):
    job = write_job(tmp_path / "job.yaml", name="logs", model=tiny_model, train=quickstart_data[0],
                    storage=tmp_path / "store")
    kept = tmp_path / "store" / "logs" / "rollout-0.log"
    monkeypatch.setenv("GRPO_LOG_URI", f"file://{kept}")
    server = RolloutServer(job, tmp_path / "rollout.log", secrets.token_hex(16), "rollout-0")
    try:
        assert server.health().ready
    finally:
        server.stop()
    assert server.proc.returncode == 0
    text = kept.read_text()
    # what Python logged (stderr) and printed (stdout), up to the graceful stop
    assert "rollout server rollout-0 listening on port" in text and "stopping: letting running calls finish" in text
    assert "GRPO_ROLLOUT_READY " in text                   # stdout's line
    own = (tmp_path / "rollout.log").read_text()          # the pod's stdout/stderr still has it all
    assert "stopping: letting running calls finish" in own


def test_a_rollout_server_that_fails_to_start_keeps_its_error(tmp_path, tiny_model, quickstart_data):
    job = write_job(tmp_path / "job.yaml", name="logs", model=tmp_path / "no-such-model", train=quickstart_data[0],
                    storage=tmp_path / "store")
    kept = tmp_path / "store" / "logs" / "rollout-0.log"
    proc = subprocess.run([*grpo_cli(), "rollout", "--spec", str(job), "--port", "0", "--metrics-port", "-1",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300,
                          env=child_env(GRPO_RPC_TOKEN=secrets.token_hex(16), GRPO_LOG_URI=f"file://{kept}"))
    assert proc.returncode == BAD_INPUT_EXIT_CODE, proc.stdout + proc.stderr
    wait_until(kept.exists, 10, what="the kept log")
    assert "no-such-model" in kept.read_text() and "no-such-model" in proc.stdout + proc.stderr
