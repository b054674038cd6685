"""Issue 25, the experiment trackers for real: `trainer.loggers: [jsonl, wandb, mlflow]` on a
2-rank CPU trainer, 2 steps, then resumed for 2 more.

- MLflow: a real `mlflow server` (sqlite backend, local artifacts, basic auth) started here; the
  metrics are read back with `MlflowClient`: one run, named as the job, whose every metric has
  the values and steps of metrics.jsonl, across the resume (validation included).
- W&B in offline mode (no network): the run files it writes (`run-<id>.wandb`, one per attempt,
  the same run id) are parsed with wandb's own record schema; same comparison.
- The credentials come from the environment (the server refuses the trainer without them) and
  appear in no log and no file of the run.
"""

from __future__ import annotations

import json
import math
import secrets
import struct
import subprocess
import sys
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration_helpers import (child_env, free_port, read_metrics, run_root, run_trainer, start_rollout_servers,
                                 wait_until, write_job)

pytestmark = pytest.mark.integration

NAME = "tracked"
PASSWORD = "mlflow-" + secrets.token_hex(12)           # recognisable, to look for in logs and files
WANDB_KEY = "local-" + secrets.token_hex(20)


@dataclass
class MlflowServer:
    uri: str
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on sqlite with basic auth (user admin, PASSWORD); ready once /health answers."""
    home = tmp_path_factory.mktemp("mlflow")
    (home / "auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{home}/auth.db\nadmin_username = admin\nadmin_password = {PASSWORD}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    port = free_port()
    log = home / "server.log"
    env = child_env(MLFLOW_AUTH_CONFIG_PATH=str(home / "auth.ini"), MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(8),
                    MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
             "--default-artifact-root", str(home / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--app-name", "basic-auth"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=home)
    uri = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, f"mlflow server exited:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5) as reply:
                return reply.status == 200
        except OSError:
            return False
    try:
        wait_until(healthy, timeout=600, interval=1, what="mlflow server /health")   # migrations, on a busy machine
        yield MlflowServer(uri, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tracker_env(server: MlflowServer, wandb_dir: Path, **changes: str | None) -> dict[str, str | None]:
    """What a trainer pod gets from spec.trainer.trackerSecretRef (here: the test's environment)."""
    env = {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_TRACKING_USERNAME": "admin",
           "MLFLOW_TRACKING_PASSWORD": PASSWORD, "MLFLOW_DISABLE_TELEMETRY": "true",
           "WANDB_MODE": "offline", "WANDB_API_KEY": WANDB_KEY, "WANDB_DIR": str(wandb_dir),
           "WANDB_ERROR_REPORTING": "false"}
    return {**env, **changes}


@dataclass
class Run:
    tmp: Path             # everything the runs wrote: the job's files, W&B's, every process log
    root: Path            # the job's files (metrics.jsonl, checkpoints/)
    wandb_dir: Path
    outputs: list[str]    # each attempt's trainer output


def _train(tmp: Path, job: Path, total: int, attempt: int) -> str:
    token = secrets.token_hex(16)
    logs = tmp / f"attempt-{attempt}"
    logs.mkdir()
    servers = start_rollout_servers(job, token, 1, logs, ready=False)
    try:
        result = run_trainer(job, rollout=servers[0].address, token=token, overrides=(f"trainer.totalSteps={total}",),
                             log_path=logs / "trainer.log")
    finally:
        for s in servers:
            s.stop()
    assert result.returncode == 0, result.output[-8000:]
    return result.output


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, mlflow_server, tiny_model, quickstart_data, dense_reward):
    """2 steps, then a resumed run to 4; validation at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("tracked")
    wandb_dir = tmp / "wandb-dir"
    wandb_dir.mkdir()
    job = write_job(tmp / "job.yaml", name=NAME, model=tiny_model, train=quickstart_data[0], val=quickstart_data[1],
                    storage=tmp / "store", reward={"function": dense_reward}, rollout={"replicas": 1},
                    trainer={"totalSteps": 4, "saveFreq": 2, "testFreq": 2,
                             "loggers": ["console", "jsonl", "wandb", "mlflow"]},
                    weightSync={"backend": "grpc"})
    with pytest.MonkeyPatch.context() as mp:
        for key, value in tracker_env(mlflow_server, wandb_dir).items():
            mp.setenv(key, value)
        outputs = [_train(tmp, job, 2, 0)]
        outputs.append(_train(tmp, job, 4, 1))
    assert "Resumed from" in outputs[1] and "checkpoints/step-2" in outputs[1]
    return Run(tmp, run_root(tmp / "store", NAME), wandb_dir, outputs)


@pytest.fixture
def mlflow_client(mlflow_server, monkeypatch):
    from mlflow import MlflowClient
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    return MlflowClient(tracking_uri=mlflow_server.uri)


def jsonl_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value)]} of metrics.jsonl (what every tracker must show)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time") and value is not None:
                series.setdefault(key, []).append((row["step"], float(value)))
    return series


def same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(
        x == y or (math.isnan(x) and math.isnan(y)) for (_, x), (_, y) in zip(a, b))


def checkpoint_trackers(root: Path, step: int) -> dict[str, str]:
    return json.loads((root / "checkpoints" / f"step-{step}" / "trainer_state.json").read_text())["metrics"]["trackers"]


# --- the W&B run files, read with wandb's own record schema ------------------------------------------

def wandb_records(path: Path):
    """The records of a `run-<id>.wandb` file: wandb's transaction log (LevelDB's log framing,
    32 KiB blocks of crc-checked chunks) of `wandb_internal_pb2.Record`s. wandb >= 0.26 writes it
    from its Go core and no longer ships a Python reader, so the framing is read here and each
    record parsed with the package's own protobuf."""
    from wandb.proto.wandb_internal_pb2 import Record
    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, pending = header, b""
    while pos + header <= len(data):
        if block - pos % block < header:            # the rest of a block too small for a chunk: padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        chunk = data[pos + header:pos + header + length]
        if kind == 0:                               # zeros: the writer stopped here
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: corrupt chunk at {pos}"
        pos += header + length
        pending += chunk
        if kind in (1, 4):                          # FULL, or the LAST of FIRST/MIDDLE.../LAST
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(wandb_dir: Path, run_id: str) -> list[list]:
    """Each attempt's records of the W&B run `run_id` (one offline run folder per attempt)."""
    files = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    return [list(wandb_records(f)) for f in files]


# --- tests ---------------------------------------------------------------------------------------

def test_mlflow_run_has_every_metric_of_metrics_jsonl_across_the_resume(tracked_run, mlflow_client):
    rows = read_metrics(tracked_run.root)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    expected = jsonl_series(rows)
    assert [s for s, _ in expected["val/score"]] == [2, 4]          # validation metrics too
    client = mlflow_client
    experiment = client.get_experiment_by_name("it")                 # trainer.projectName
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "a resumed job continues its MLflow run: one curve, not two"
    (run,) = runs
    assert run.info.run_name == NAME and run.info.status == "FINISHED"   # trainer.experimentName
    assert run.info.run_id == checkpoint_trackers(tracked_run.root, 4)["mlflow"]
    assert set(run.data.metrics) == set(expected)
    for key, series in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert same(history, series), (key, history, series)
    # the resolved spec as the run's params, dotted as in `--set`
    params = run.data.params
    assert params["trainer.experimentName"] == NAME and params["rollout.n"] == "4"
    assert params["trainer.loggers.2"] == "wandb" and params["algorithm.advEstimator"] == "grpo"
    assert params["storage.uri"].startswith("file://")


def test_wandb_offline_run_has_every_metric_of_metrics_jsonl_across_the_resume(tracked_run):
    expected = jsonl_series(read_metrics(tracked_run.root))
    run_id = checkpoint_trackers(tracked_run.root, 2)["wandb"]
    assert checkpoint_trackers(tracked_run.root, 4)["wandb"] == run_id
    attempts = wandb_runs(tracked_run.wandb_dir, run_id)
    assert len(attempts) == 2, "each attempt writes to the same W&B run id"
    logged: dict[str, list[tuple[int, float]]] = {}
    for records in attempts:
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert run.project == "it" and run.display_name == NAME and run.run_id == run_id
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["trainer"]["experimentName"] == NAME and config["rollout"]["n"] == 4
        for r in records:
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                for key, value in items.items():
                    if not key.startswith("_"):             # wandb's own _step, _runtime, _timestamp
                        logged.setdefault(key, []).append((items["_step"], float(value)))
    assert set(logged) == set(expected)
    for key, series in expected.items():
        assert same(sorted(logged[key]), series), (key, logged[key], series)


def test_credentials_are_written_nowhere(tracked_run):
    # checkpoints, metrics.jsonl, progress.json (the status' source), W&B's files, every process log
    files = [p for p in tracked_run.tmp.rglob("*") if p.is_file()]
    assert any(p.name == "trainer.log" for p in files) and any(p.suffix == ".wandb" for p in files)
    for path in files:
        data = path.read_bytes()
        assert PASSWORD.encode() not in data and WANDB_KEY.encode() not in data, path


def test_a_tracker_that_refuses_the_run_stops_the_trainer_naming_the_field(tmp_path, mlflow_server, tiny_model,
                                                                         quickstart_data, dense_reward, monkeypatch):
    job = write_job(tmp_path / "job.yaml", name="refused", model=tiny_model, train=quickstart_data[0],
                    storage=tmp_path / "store", reward={"function": dense_reward}, rollout={"replicas": 1},
                    trainer={"totalSteps": 1, "loggers": ["console", "mlflow"]}, weightSync={"backend": "grpc"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    token = secrets.token_hex(16)
    servers = start_rollout_servers(job, token, 1, tmp_path, ready=False)
    try:
        result = run_trainer(job, rollout=servers[0].address, token=token)
    finally:
        for s in servers:
            s.stop()
    assert result.returncode != 0
    assert "error: spec.trainer.loggers: mlflow could not start a run:" in result.output
    assert "401" in result.output and "spec.trainer.trackerSecretRef" in result.output
    assert "Generating rollouts" not in result.output          # stopped before the first step
