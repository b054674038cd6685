"""spec.model.path in S3 (versitygw) and the model cache (`grpo model fetch`, what the pods' init
container runs): fetched once however many pods ask at the same moment, byte for byte, nothing
half-written left behind, loadable by transformers; and a whole `grpo run` training from a
model that lives in S3."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from integration_helpers import child_env, grpo_cli, run_grpo, write_job

pytestmark = pytest.mark.integration

MODEL_PREFIX = "models/tiny-qwen3"


@pytest.fixture(scope="module")
def model_in_s3(s3_server, tiny_model) -> str:
    fs = s3_server.filesystem()
    for f in tiny_model.rglob("*"):
        if f.is_file():
            with fs.open_output_stream(f"{s3_server.bucket}/{MODEL_PREFIX}/{f.relative_to(tiny_model)}") as out:
                out.write(f.read_bytes())
    return f"s3://{s3_server.bucket}/{MODEL_PREFIX}"


def _s3_job(path: Path, s3_server, model: str, tiny_model: Path, quickstart_data, **sections) -> Path:
    """A job reading its model from S3 (`tiny_model` is only a placeholder for write_job)."""
    job = write_job(path, name="from-s3", model=tiny_model, train=quickstart_data[0], storage=path.parent / "store",
                    **sections)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["model"] = {"path": model, "cache": {"claimName": "models"}, "dtype": "float32"}
    doc["spec"]["storage"] = {"uri": f"s3://{s3_server.bucket}/runs", "endpoint": s3_server.endpoint,
                              "secretRef": "s3-creds"}
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    return job


def _files(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_pods_fetching_at_once_download_the_model_once(tmp_path, s3_server, model_in_s3, tiny_model,
                                                       quickstart_data):
    job = _s3_job(tmp_path / "job.yaml", s3_server, model_in_s3, tiny_model, quickstart_data)
    cache = tmp_path / "cache"
    # A fetcher killed mid-download left its partial folder: the next one removes it.
    from grpo_api.model_cache import folder_name
    stale = cache / f".partial-{folder_name(model_in_s3)}-99999"
    (stale / "sub").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    env = child_env(**s3_server.env())
    fetchers = [subprocess.Popen([*grpo_cli(), "model", "fetch", "--spec", str(job), "--cache", str(cache)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                for _ in range(3)]
    outputs = [p.communicate(timeout=300)[0] for p in fetchers]
    assert [p.returncode for p in fetchers] == [0, 0, 0], outputs
    assert sum(f"{model_in_s3}: copied " in out for out in outputs) == 1, outputs
    assert sum("cached in" in out for out in outputs) == 2, outputs
    folder = cache / folder_name(model_in_s3)
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [folder.name]
    assert _files(folder) == _files(tiny_model)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoTokenizer.from_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(folder)


def test_a_model_that_is_not_there_fails_naming_it_and_leaves_nothing(tmp_path, s3_server, tiny_model,
                                                                      quickstart_data):
    missing = f"s3://{s3_server.bucket}/models/no-such-model"
    job = _s3_job(tmp_path / "job.yaml", s3_server, missing, tiny_model, quickstart_data)
    cache = tmp_path / "cache"
    proc = subprocess.run([*grpo_cli(), "model", "fetch", "--spec", str(job), "--cache", str(cache)],
                          capture_output=True, text=True, timeout=300, env=child_env(**s3_server.env()))
    assert proc.returncode == 1
    assert f"spec.model.path: {missing} holds no files" in proc.stderr
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_grpo_run_trains_a_model_that_lives_in_s3(tmp_path, s3_server, model_in_s3, tiny_model, quickstart_data,
                                                  dense_reward, grpo_cache, monkeypatch):
    """The launcher fetches the model into the user's cache once; the trainer and the rollout
    server load it from there; the checkpoint still names the S3 model."""
    job = _s3_job(tmp_path / "job.yaml", s3_server, model_in_s3, tiny_model, quickstart_data,
                  reward={"function": dense_reward},
                  trainer={"nprocPerNode": 1, "totalSteps": 2, "saveFreq": 2})
    xdg = tmp_path / "xdg"
    for key, value in {**s3_server.env(), "XDG_CACHE_HOME": str(xdg)}.items():
        monkeypatch.setenv(key, value)                     # LauncherRun passes the environment on
    code, log = run_grpo(job, tmp_path / "cwd", grpo_cache, [], timeout=600)
    assert code == 0, log[-6000:]
    from grpo_api.model_cache import folder_name
    assert _files(xdg / "grpo-operator" / "models" / folder_name(model_in_s3)) == _files(tiny_model)
    assert log.count(f"{model_in_s3}: copied ") == 1, log[-6000:]
    fs = s3_server.filesystem()
    state = fs.open_input_stream(f"{s3_server.bucket}/runs/default/from-s3/checkpoints/step-2/trainer_state.json")
    assert model_in_s3 in state.read().decode()

