"""`grpo ui` without the run's tokenizer (issue 48, the chart's viewer): a run before its first
checkpoint shows token ids and is looked at again; a model on a volume the viewer doesn't mount
shows ids with one warning; a run not written yet is waited for under --wait."""

from __future__ import annotations

import json

import pytest

from grpo_api.run_argument import RunNotFound
from grpo_api.storage import Storage
from grpo_trainer.rollout_history import RolloutHistory
from grpo_trainer.rollouts_export import run_tokenizer
from grpo_trainer.ui import _history
from grpo_trainer.ui.text import IdsText, RunText


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def run(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "progress.json").write_text("{}")
    return root


@pytest.fixture()
def tokenizer_dir(tmp_path):
    from grpo_rollout.tiny import build_tokenizer
    out = tmp_path / "tokenizer"
    tok = build_tokenizer()
    tok.save_pretrained(out)
    return out


def _text(run, clock, logs):
    storage = Storage()
    history = RolloutHistory(str(run), storage)
    return RunText(lambda: run_tokenizer(history, storage, None), log=logs.append, retry_seconds=60, clock=clock)


def test_ids_until_the_run_records_its_model_then_text(run, tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    clock, logs = Clock(), []
    text = _text(run, clock, logs)
    assert text.batch_decode([[5, 6, 7], []]) == ["5 6 7", ""] and not text.final
    assert len(logs) == 1 and "records no model" in logs[0] and "60 s" in logs[0]
    # The model appears (here `grpo run`'s job.yaml; on Kubernetes the first checkpoint).
    (run / "job.yaml").write_text(json.dumps({"spec": {"model": {"path": str(tokenizer_dir)}}}))
    clock.now = 59.0
    assert text.batch_decode([[5, 6, 7]]) == ["5 6 7"] and len(logs) == 1      # not looked at again yet
    clock.now = 60.0
    from transformers import AutoTokenizer
    expected = AutoTokenizer.from_pretrained(tokenizer_dir).batch_decode([[5, 6, 7]])
    assert text.batch_decode([[5, 6, 7]]) == expected != ["5 6 7"] and text.final
    assert logs[-1] == "decoding with the run's tokenizer"


def test_a_model_on_a_volume_this_pod_lacks_is_ids_for_good_with_one_warning(run, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = tmp_path / "volume" / "qwen3-8b"
    (run / "job.yaml").write_text(json.dumps({"spec": {"model": {"path": str(missing)}}}))
    clock, logs = Clock(), []
    text = _text(run, clock, logs)
    for now in (0.0, 600.0):
        clock.now = now
        assert text.batch_decode([[1, 2]]) == ["1 2"]
    assert text.final and len(logs) == 1 and logs[0].startswith("warning: showing token ids")
    assert str(missing) in logs[0]


def test_no_text_shows_ids_that_tokenize_one_per_token():
    ids = IdsText()
    assert ids.batch_decode([[151644, 872], [3]]) == ["151644 872", "3"]


def test_wait_looks_for_the_run_until_it_appears(tmp_path, capsys):
    root = tmp_path / "run"
    with pytest.raises(RunNotFound):
        _history(str(root), Storage(), wait=False)
    naps = []

    def sleep(seconds):
        naps.append(seconds)
        if len(naps) == 2:          # the job's trainer writes its first progress
            root.mkdir()
            (root / "progress.json").write_text("{}")

    history = _history(str(root), Storage(), wait=True, sleep=sleep)
    assert history.layout.root.endswith("/run") and naps == [30.0, 30.0]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("waiting for the run: ") and "not a run" in line for line in err)


def test_the_runs_algorithm_is_looked_for_until_the_run_records_its_job(run):
    """A step page's advantages follow the run's estimator: before the first checkpoint the spec's
    defaults, then the job's (here `grpo run`'s job.yaml)."""
    from grpo_trainer.ui.run_view import RunView
    view = RunView(RolloutHistory(str(run), Storage()), IdsText(), None)
    assert view.algorithm == ("grpo", True, 1.0)
    (run / "job.yaml").write_text(json.dumps({"spec": {"algorithm": {"advEstimator": "rloo", "gamma": 0.5}}}))
    assert view.algorithm[0] == "rloo" and view.algorithm[2] == 0.5
