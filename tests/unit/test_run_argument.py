"""RUN (a run's folder or URI) and --endpoint, as grpo replay, grpo ui and grpo rollouts export take them
(grpo_api.run_argument)."""

import argparse

import pytest

from grpo_api.run_argument import RunNotFound, add_run_arguments, open_run, run_uri
from grpo_trainer.replay import replay
from grpo_trainer.rollouts_export import rollouts
from grpo_trainer.ui import ui


def test_a_folder_is_read_as_its_absolute_file_uri(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "progress.json").write_text('{"step": 3}')
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    uri, storage = open_run(parser.parse_args(["run/"]))
    assert uri == f"file://{tmp_path}/run"
    assert storage.read_bytes(f"{uri}/progress.json") == b'{"step": 3}'


def test_a_run_uri_is_kept_and_an_empty_run_is_refused():
    assert run_uri("s3://bucket/team-a/demo/1234/") == "s3://bucket/team-a/demo/1234"
    assert run_uri("file:///runs/demo") == "file:///runs/demo"
    with pytest.raises(RunNotFound, match="RUN is empty"):
        run_uri("  ")


@pytest.mark.parametrize("command", [lambda a: replay([*a, "--step", "2"]), ui, lambda a: rollouts(["export", *a])])
def test_the_three_commands_take_run_and_endpoint_alike(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        command(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())     # argparse wraps the help
    assert "RUN" in out and "the run's URI (status.runUri: s3://..., file://...) or folder" in out
    assert "--endpoint ENDPOINT" in out and "S3-compatible endpoint URL" in out
    # A RUN that names nothing is bad input (exit 2, one error line), the same for each.
    assert command([""]) == 2
    assert capsys.readouterr().err.strip() == "error: RUN is empty"
