"""grpo_api.storage on the local file system and on a real S3-compatible server."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from grpo_api.jobfile import parse_job
from grpo_api.records import ROLLOUT_SCHEMA, RunLayout
from grpo_api.spec import StorageSpec
from grpo_api.storage import Storage, StorageError, job_root


def rollout_shard(rows: int = 3) -> pa.Table:
    return pa.Table.from_pydict({
        "uid": [f"0-{i}" for i in range(rows)], "prompt_index": list(range(rows)), "sample_index": [0] * rows,
        "prompt_ids": [[1, 2, 3]] * rows, "response_ids": [[4, 5]] * rows, "response_logprobs": [[-0.5, -1.5]] * rows,
        "reward": [1.0, 0.0, 0.5][:rows], "reward_extra": ["{}"] * rows, "finish_reason": ["stop"] * rows,
        "policy_version": [3] * rows, "data_source": ["openai/gsm8k"] * rows, "ground_truth": ["72"] * rows,
        "worker": ["w0"] * rows, "response_mask": [None] * rows, "num_turns": [None] * rows,   # single-turn
        "agent": [None] * rows, "reward_error": [None] * rows, "images": [None] * rows}, schema=ROLLOUT_SCHEMA)


def exercise(storage: Storage, root: str) -> None:
    """What the trainer and rollout servers do with storage, on any backend."""
    layout = RunLayout(root)
    shard_uri = layout.rollout_shard(3, "w0")
    storage.write_table(shard_uri, rollout_shard())
    assert storage.read_table(shard_uri, ROLLOUT_SCHEMA).equals(rollout_shard())
    storage.write_table(shard_uri, rollout_shard(2))   # overwrite: readers see one version whole
    assert storage.read_table(shard_uri).num_rows == 2
    storage.write_bytes(layout.progress, b'{"step": 3}')
    assert storage.read_bytes(layout.progress) == b'{"step": 3}'
    assert storage.exists(shard_uri) and not storage.exists(layout.rollout_shard(4, "w0"))
    assert storage.list(layout.step_dir("rollouts", 3)) == [shard_uri]
    assert storage.list(root, recursive=True) == sorted(
        [f"{root}/rollouts", layout.step_dir("rollouts", 3), shard_uri, layout.progress])
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(layout.metrics)
    with pytest.raises(ValueError, match="missing column"):
        storage.read_table(shard_uri, pa.schema([("nope", pa.int64())]))
    storage.delete_dir(layout.step_dir("rollouts", 3))
    assert storage.list(layout.step_dir("rollouts", 3)) == []
    storage.delete_dir(layout.step_dir("rollouts", 99))   # absent: nothing to do


def test_local_files(tmp_path):
    storage = Storage()
    exercise(storage, f"file://{tmp_path}/run")
    # Writes go through a temporary file that is renamed: none is left behind.
    storage.write_bytes(f"file://{tmp_path}/a/b/c.bin", b"x" * 1000)
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["c.bin"]


READ_AND_EXIT = """
import sys
from grpo_api.storage import Storage
for _ in range(6):
    Storage().read_table(sys.argv[1]).to_pylist()
"""


def test_a_short_process_that_reads_shards_exits_cleanly(tmp_path):
    """`grpo rollouts export` exited -6 after writing its output (CI, twice): a process that ends
    soon after a threaded parquet read can abort at exit (apache/arrow#39862). This test with the
    reads threaded: 8, 8 and 10 of 30 processes aborted (idle 2-core machine); with
    `use_threads=False` alone (IO pool still pre-buffering) 1 of 30 in a loaded CI run; with no
    Arrow thread at all 0 of 200 with both cores busy."""
    shard = tmp_path / "shard.parquet"
    Storage().write_table(str(shard), rollout_shard())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    failures = []
    for _ in range(15):
        procs = [subprocess.Popen([sys.executable, "-c", READ_AND_EXIT, str(shard)], env=env,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        failures += [(p.wait(60), p.stderr.read()[-300:]) for p in procs]
    failures = [f for f in failures if f[0] != 0]
    assert not failures, f"{len(failures)} of 30 processes failed: {failures[:3]}"


@pytest.mark.s3
def test_s3_round_trip_on_a_real_server(s3_server):
    storage = Storage(StorageSpec(endpoint=s3_server.endpoint, region=s3_server.region), env=s3_server.env())
    exercise(storage, f"s3://{s3_server.bucket}/team-a/default/job-{time.time_ns()}")
    # A large object (multipart upload under the hood) arrives intact.
    big = os.urandom(12 << 20)
    storage.write_bytes(f"s3://{s3_server.bucket}/big.bin", big)
    assert storage.read_bytes(f"s3://{s3_server.bucket}/big.bin") == big


@pytest.mark.s3
def test_s3_wrong_credentials_fail_at_once(s3_server):
    storage = Storage(StorageSpec(endpoint=s3_server.endpoint), attempts=5, backoff_seconds=1.0,
                      env={"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": "wrong-secret"})
    started = time.monotonic()
    with pytest.raises(OSError) as err:
        storage.write_bytes(f"s3://{s3_server.bucket}/x.bin", b"x")
    assert time.monotonic() - started < 3  # a permanent error: not retried
    assert "wrong-secret" not in str(err.value)


def test_unreachable_s3_is_retried_then_named(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    storage = Storage(StorageSpec(endpoint=f"http://127.0.0.1:{closed_port}"), attempts=3, backoff_seconds=0.05,
                      env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s3cr3t"})
    with pytest.raises(StorageError, match=r"write s3://bucket/x.bin: failed 3 times") as err:
        storage.write_bytes("s3://bucket/x.bin", b"x")
    assert "s3cr3t" not in str(err.value)


def test_s3_without_credentials_says_what_to_set():
    with pytest.raises(StorageError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        Storage(env={}).read_bytes("s3://bucket/key")


def test_unsupported_uri():
    with pytest.raises(ValueError, match="unsupported URI"):
        Storage().read_bytes("gs://bucket/key")


def job(**spec):
    return parse_job({"metadata": {"name": "qwen3-gsm8k", "namespace": "team-a"},
                      "spec": {"model": {"path": "m"}, "data": {"trainFiles": ["f"]},
                               "trainer": {"projectName": "proj", "experimentName": "exp"}, **spec}})


def test_job_root(tmp_path):
    assert job_root(job(), local=True, cwd=tmp_path) == f"file://{tmp_path}/outputs/proj/exp"
    s3 = job(storage={"uri": "s3://grpo-runs/prefix/"})
    assert job_root(s3, local=False) == "s3://grpo-runs/prefix/team-a/qwen3-gsm8k"
    assert job_root(s3, local=True) == "s3://grpo-runs/prefix/team-a/qwen3-gsm8k"
    # On Kubernetes each object (uid) has its own run: a re-created same-named job starts anew;
    # a local run of a file carrying a uid (copied from kubectl get -o yaml) still resumes.
    on_kube = parse_job({**s3.model_dump(mode="json", by_alias=True, exclude_none=True),
                         "metadata": {"name": "qwen3-gsm8k", "namespace": "team-a", "uid": "3f2a-11"}})
    assert job_root(on_kube, local=False) == "s3://grpo-runs/prefix/team-a/qwen3-gsm8k/3f2a-11"
    assert job_root(on_kube, local=True) == "s3://grpo-runs/prefix/team-a/qwen3-gsm8k"
    relative = job(storage={"uri": "file://runs"})
    assert job_root(relative, local=True, cwd=tmp_path) == f"file://{tmp_path}/runs/team-a/qwen3-gsm8k"
    with pytest.raises(ValueError, match="spec.storage.uri: required on Kubernetes"):
        job_root(job(), local=False)
