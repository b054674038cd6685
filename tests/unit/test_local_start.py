"""`grpo run` tells a rollout server that could not start from one that died after it served: the
first stops the run with the server's own last line, the second is restarted. Here the servers
are real processes that print what a server prints (its ready line, or an error) and exit; the
exit comes before the launcher looks, the order that failed CI (a server killed 3 s into a fast
run, while the launcher's first Health call was still backing off, stopped the run)."""

from __future__ import annotations

import os

import pytest

from grpo_api.contracts import ROLLOUT_READY_PREFIX
from grpo_api.jobfile import parse_job
from grpo_operator.local import LaunchError, LocalRun


@pytest.fixture
def local_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = parse_job({"spec": {"model": {"path": "Qwen/Qwen3-0.6B"},
                              "data": {"trainFiles": ["t.parquet"], "trainBatchSize": 4},
                              "trainer": {"miniBatchSize": 4}}})
    run = LocalRun(job)
    run.trainer.argv = ["sleep", "60"]          # a trainer that is still running
    yield run
    run.stop_all()


def _server_that_prints(run: LocalRun, text: str, then: str) -> None:
    [server] = run.rollouts
    server.argv = ["sh", "-c", f"printf '%s\\n' '{text}'; {then}"]
    server.start(dict(os.environ))
    server.proc.wait()


def test_a_server_that_exits_after_its_ready_line_is_left_to_the_restarts(local_run):
    _server_that_prints(local_run, ROLLOUT_READY_PREFIX + '{"port": 1}', "kill -9 $$")
    local_run.trainer.start(dict(os.environ))
    local_run._wait_started([(local_run.rollouts[0], ROLLOUT_READY_PREFIX)], timeout=30,
                             unless_exited=local_run.trainer)         # returns: _supervise restarts it


def test_a_server_that_exits_before_its_ready_line_stops_the_run_with_its_error(local_run):
    _server_that_prints(local_run, "error: model.path /nowhere: no such folder", "exit 2")
    local_run.trainer.start(dict(os.environ))
    with pytest.raises(LaunchError, match=r"rollout-0 exited with 2: error: model.path /nowhere: no such folder"):
        local_run._wait_started([(local_run.rollouts[0], ROLLOUT_READY_PREFIX)], timeout=30,
                             unless_exited=local_run.trainer)
