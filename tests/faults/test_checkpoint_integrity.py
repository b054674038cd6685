"""Issue 24: nothing from storage runs as code. DCP unpickles a checkpoint's `.metadata`, so a
checkpoint is loaded only when its manifest is signed with the job's checkpoint key and every
file matches the manifest (grpo_api.signing, grpo_trainer.checkpoint).

Real checkpoints written by the trainer under torchrun, then changed as someone who can write
the job's storage prefix would: a pickle that writes a marker file when it is loaded (on
file:// and on S3, versitygw), a file from another checkpoint, a truncated file, a manifest
rewritten to match, a checkpoint signed with another key. The trainer (and `grpo export`)
refuse each, naming the file, and the payload never runs.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from faults_helpers import kill_writer_leaving
from integration_helpers import child_env, grpo_cli, run_root, run_trainer, start_rollout_servers, write_job

pytestmark = [pytest.mark.faults, pytest.mark.integration]

NAME = "signed"


class _Plant:
    """Unpickling this runs `open(marker, "w").write("ran")`: the payload of a planted checkpoint."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _payload(marker: Path) -> bytes:
    """The planted `.metadata`. It is live: DCP's own reader, given it, runs it (checked here on
    a probe, in a folder of its own)."""
    probe_dir, probe = marker.parent / "probe", marker.parent / "probe-ran"
    probe_dir.mkdir()
    (probe_dir / ".metadata").write_bytes(pickle.dumps(_Plant(probe)))
    subprocess.run([sys.executable, "-c", "import sys, torch.distributed.checkpoint as dcp; "
                    "dcp.FileSystemReader(sys.argv[1]).read_metadata()", str(probe_dir)], capture_output=True, timeout=120)
    assert probe.read_text() == "ran", "the payload would not run: the test proves nothing"
    return pickle.dumps(_Plant(marker))


def _job(path: Path, storage, tiny_model, train_data, **trainer) -> Path:
    return write_job(path, name=NAME, model=tiny_model, train=train_data, storage=storage,
                     rollout={"replicas": 1}, weightSync={"backend": "grpc"},
                     trainer={"nprocPerNode": 1, "totalSteps": 2, "saveFreq": 1, **trainer})


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory, tiny_model, train_data) -> Path:
    """A 2-step run with checkpoints at steps 1 and 2; returns its storage folder."""
    tmp = tmp_path_factory.mktemp("signed")
    token = secrets.token_hex(16)
    job = _job(tmp / "job.yaml", tmp / "store", tiny_model, train_data)
    (server,) = start_rollout_servers(job, token, 1, tmp, ready=False)
    try:
        result = run_trainer(job, rollout=server.address, token=token, nproc=1)
    finally:
        server.stop()
    assert result.returncode == 0, result.output[-8000:]
    manifest = json.loads((run_root(tmp / "store", NAME) / "checkpoints/step-2/manifest.json").read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "trainer_state.json"} and manifest["hmac_sha256"]
    return tmp / "store"


def _copy(signed_run: Path, tmp_path: Path) -> Path:
    """A copy of the run's storage under tmp_path/store (the job's prefix: store/default/signed)."""
    shutil.copytree(signed_run, tmp_path / "store")
    return run_root(tmp_path / "store", NAME) / "checkpoints"


def _resume_refused(job: Path, nproc: int = 1, key: str | None = None) -> str:
    """Start the trainer on the job (resume: auto), expect it to refuse; returns the error line.
    No rollout server: it must stop while loading the checkpoint, before talking to one."""
    overrides = ("trainer.totalSteps=3", f"trainer.nprocPerNode={nproc}")
    env = child_env(GRPO_RPC_TOKEN="t", **({"GRPO_CHECKPOINT_KEY": key} if key else {}))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--no-python", *grpo_cli(), "trainer", "--spec", str(job), "--rollout", "127.0.0.1:9",
            *[a for kv in overrides for a in ("--set", kv)]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=job.parent, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, out[-4000:]                       # said once, by rank 0
    assert not re.search(r"^\[rank\d+\]:", out, flags=re.M), out[-4000:]     # no rank's traceback
    assert "Step 3" not in out
    return errors[0]


def test_a_planted_pickle_never_runs(signed_run, tmp_path, tiny_model, train_data):
    """`.metadata` of the latest checkpoint replaced by a pickle that writes a marker file: the
    trainer (2 ranks) refuses it naming the file, before anything unpickles it. The same with the
    manifest rewritten to match the planted file (the attacker can write manifest.json too, but
    has no key): refused on the signature."""
    ckpts = _copy(signed_run, tmp_path)
    manifest = json.loads((ckpts / "step-2" / "manifest.json").read_text())
    marker = tmp_path / "pwned"
    planted = _payload(marker)
    (ckpts / "step-2" / ".metadata").write_bytes(planted)
    job = _job(tmp_path / "job.yaml", tmp_path / "store", tiny_model, train_data)
    error = _resume_refused(job, nproc=2)
    assert error == (f"error: file://{ckpts}/step-2/.metadata: {len(planted)} bytes, the signed manifest says "
                     f"{manifest['files']['.metadata']['size']} (truncated or replaced); refusing to load the checkpoint")
    assert not marker.exists()

    manifest = json.loads((ckpts / "step-2" / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": len(planted), "sha256": hashlib.sha256(planted).hexdigest()}
    for forged in ({k: v for k, v in manifest.items() if k != "hmac_sha256"}, {**manifest, "hmac_sha256": "0" * 64}):
        (ckpts / "step-2" / "manifest.json").write_text(json.dumps(forged))
        error = _resume_refused(job)
        assert error.startswith(f"error: file://{ckpts}/step-2/manifest.json: the manifest"), error
        assert "refusing to load the checkpoint" in error
        assert not marker.exists()


@pytest.mark.s3
def test_a_planted_pickle_never_runs_on_s3(tmp_path, tiny_model, train_data, s3, monkeypatch):
    """The same on S3: a run writes its checkpoint to versitygw, the pickle is planted there, the
    trainer refuses to resume from it; with the original file back, it resumes (and removes the
    incomplete upload a writer of the job killed mid-write left)."""
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    job = _job(tmp_path / "job.yaml", tmp_path, tiny_model, train_data, totalSteps=1)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["storage"] = {"uri": f"s3://{s3.BUCKET}/runs", "endpoint": s3.endpoint}
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    ckpt = f"s3://{s3.BUCKET}/runs/default/{NAME}/checkpoints/step-1"
    token = secrets.token_hex(16)
    (server,) = start_rollout_servers(job, token, 1, tmp_path, ready=False)
    try:
        assert run_trainer(job, rollout=server.address, token=token, nproc=1).returncode == 0
        storage = s3.storage()
        original = storage.read_bytes(f"{ckpt}/.metadata")
        marker = tmp_path / "pwned"
        storage.write_bytes(f"{ckpt}/.metadata", _payload(marker))
        error = _resume_refused(job)
        assert error.startswith(f"error: {ckpt}/.metadata: ") and error.endswith("refusing to load the checkpoint")
        assert not marker.exists()
        storage.write_bytes(f"{ckpt}/.metadata", original)
        # and a writer of the job killed mid-upload: its parts go at the trainer's next start
        root = f"s3://{s3.BUCKET}/runs/default/{NAME}"
        uploads = lambda: storage._s3_client().list_uploads(s3.BUCKET, f"runs/default/{NAME}/")  # noqa: E731
        kill_writer_leaving(f"{root}/rollouts/step-1/late.parquet", 24 << 20, {**s3.env(), "S3_ENDPOINT": s3.endpoint},
                            uploads)
        resumed = run_trainer(job, rollout=server.address, token=token, nproc=1, overrides=("trainer.totalSteps=2",))
    finally:
        server.stop()
    assert resumed.returncode == 0, resumed.output[-8000:]
    assert f"Resumed from {ckpt} (step 1" in resumed.output
    assert (f"Removed 1 leftovers of writers killed mid-write under {root}: {root}/rollouts/step-1/late.parquet "
            f"(incomplete upload)") in resumed.output
    assert uploads() == []
    assert storage.exists(f"s3://{s3.BUCKET}/runs/default/{NAME}/checkpoints/step-2/manifest.json")


def _export(ckpt: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*grpo_cli(), "export", str(ckpt), "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env=child_env(**env))


def test_a_swapped_or_truncated_file_is_refused_naming_it(signed_run, tmp_path):
    """`grpo export` (which loads the checkpoint as the trainer does) of step 2 with step 1's
    weights file swapped in, or with its own cut short: refused, naming the file; the untouched
    copy exports."""
    ckpts = _copy(signed_run, tmp_path)
    assert _export(ckpts / "step-2", tmp_path / "ok").returncode == 0
    weights = ckpts / "step-2" / "__0_0.distcp"
    original = weights.read_bytes()
    shutil.copyfile(ckpts / "step-1" / "__0_0.distcp", weights)
    swapped = _export(ckpts / "step-2", tmp_path / "swapped")
    assert swapped.returncode == BAD_INPUT_EXIT_CODE, swapped.stderr[-3000:]
    assert swapped.stderr.strip() == (f"error: file://{weights}: its sha256 does not match the signed manifest "
                                      f"(changed or replaced since the trainer wrote it); refusing to load the checkpoint")
    weights.write_bytes(original[: len(original) // 2])
    truncated = _export(ckpts / "step-2", tmp_path / "truncated")
    assert truncated.returncode == BAD_INPUT_EXIT_CODE
    assert truncated.stderr.strip() == (f"error: file://{weights}: {len(original) // 2} bytes, the signed manifest says "
                                        f"{len(original)} (truncated or replaced); refusing to load the checkpoint")
    assert not (tmp_path / "swapped").exists() and not (tmp_path / "truncated").exists()


def test_a_whole_checkpoint_of_another_step_or_key_is_refused(signed_run, tmp_path, tiny_model, train_data):
    """Step 1's checkpoint copied whole over step 2 (its manifest is validly signed: a roll-back)
    is refused; so is a checkpoint the trainer can't verify with its own key (another job's, or
    this job's after its Secret was made anew)."""
    ckpts = _copy(signed_run, tmp_path)
    shutil.rmtree(ckpts / "step-2")
    shutil.copytree(ckpts / "step-1", ckpts / "step-2")
    rolled_back = _export(ckpts / "step-2", tmp_path / "o")
    assert rolled_back.returncode == BAD_INPUT_EXIT_CODE
    assert rolled_back.stderr.strip() == (f"error: file://{ckpts}/step-2/manifest.json: the manifest is of step 1 "
                                          f"(torch.distributed.checkpoint), not of this folder; refusing to load it")
    job = _job(tmp_path / "job.yaml", tmp_path / "store", tiny_model, train_data)
    error = _resume_refused(job, key=secrets.token_hex(32))
    assert error.startswith(f"error: file://{ckpts}/step-2/manifest.json: the manifest's signature does not match "
                            f"this job's checkpoint key"), error
