"""Object storage failing (issue 12): a real S3-compatible server (versitygw) stopped for a while
and for good, under Storage and under a running job; writers SIGKILLed mid-write.

What must hold: a short outage costs retries (with a doubling backoff), not the run; a lasting
one stops the run with an error naming the operation and the URI; and no reader ever sees part
of an object (file://: temp + rename; S3: an object exists only once its upload completed).
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml

from faults_helpers import Hold, kill_tree, kill_writer_leaving, kill_writer_mid_write, paused, trainer_log_tail
from grpo_api.storage import StorageError
from integration_helpers import child_env, start_rollout_servers, trainer_argv, wait_until, write_job

pytestmark = [pytest.mark.faults]

CALLS_PER_STEP = 4 * 4      # trainBatchSize x n: reward calls of the one server per step
OUTAGE = 5.0                # seconds: beyond the S3 client's own retries, within Storage's (5 attempts)


# --- Storage itself -------------------------------------------------------------------------------

@pytest.mark.s3
def test_an_outage_is_retried_with_backoff_and_the_write_completes(s3, caplog):
    storage = s3.storage(attempts=8, backoff_seconds=0.2, max_backoff_seconds=2.0)
    before = f"s3://{s3.BUCKET}/outage/before.bin"
    storage.write_bytes(before, b"kept")
    s3.stop()
    # longer than the S3 client's own retries (~2 s per operation), so Storage's are needed
    restart = threading.Timer(OUTAGE, s3.start)
    restart.start()
    uri = f"s3://{s3.BUCKET}/outage/during.bin"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="grpo_api.storage"):
        storage.write_bytes(uri, b"x" * 1000)
    elapsed = time.monotonic() - started
    restart.join()
    assert elapsed >= OUTAGE - 0.5                     # it waited for the server, it didn't give up
    retries = [r.getMessage() for r in caplog.records if "transient error" in r.getMessage()]
    assert retries and all(m.startswith(f"write {uri}: transient error") for m in retries), retries
    delays = [float(m.split("retrying in ")[1].split("s:")[0]) for m in retries]
    assert delays[:3] == [0.2, 0.4, 0.8][:len(delays[:3])]       # exponential backoff
    assert storage.read_bytes(uri) == b"x" * 1000 and storage.read_bytes(before) == b"kept"
    assert s3.SECRET not in caplog.text


@pytest.mark.s3
def test_a_server_gone_for_good_is_a_storage_error_naming_operation_and_uri(s3):
    storage = s3.storage(attempts=3, backoff_seconds=0.05)
    uri = f"s3://{s3.BUCKET}/gone/x.bin"
    storage.write_bytes(uri, b"old")
    s3.stop()
    for op, call in (("write", lambda: storage.write_bytes(uri, b"new")), ("read", lambda: storage.read_bytes(uri)),
                     ("list", lambda: storage.list(f"s3://{s3.BUCKET}/gone"))):
        with pytest.raises(StorageError) as err:
            call()
        target = uri if op != "list" else f"s3://{s3.BUCKET}/gone"
        assert str(err.value).startswith(f"{op} {target}: failed 3 times, last error:"), str(err.value)
        assert s3.SECRET not in str(err.value)
    s3.start()
    assert storage.read_bytes(uri) == b"old"           # the failed write changed nothing


def test_a_local_write_that_cannot_happen_names_operation_and_uri(tmp_path):
    from grpo_api.storage import Storage
    (tmp_path / "a-file").write_text("in the way")
    uri = f"file://{tmp_path}/a-file/run/progress.json"
    with pytest.raises(StorageError, match=rf"^write {uri}: .*Not a directory"):
        Storage().write_bytes(uri, b"{}")
    with pytest.raises(FileNotFoundError):            # a missing file stays FileNotFoundError for readers
        Storage().read_bytes(f"file://{tmp_path}/missing.json")


# --- a writer SIGKILLed mid-write: the object is one whole version or absent -----------------------

def _check_whole(data: bytes | None, size: int, last_done: int) -> None:
    assert data is not None, "the object vanished"
    assert len(data) == size, f"a partial object: {len(data)} of {size} bytes"
    (value,) = set(data[:1024 * 1024]) | set(data[-1024 * 1024:])      # one version, not a mix
    assert value in {last_done % 251, (last_done + 1) % 251}
    assert data.count(value) == size


def test_a_local_writer_killed_mid_write_leaves_a_whole_file(tmp_path):
    from grpo_api.storage import Storage
    size = 48 << 20
    uri = f"file://{tmp_path}/run/rollouts/step-1/shard.parquet"
    last = kill_writer_mid_write(uri, size, {})
    storage = Storage()
    _check_whole(storage.read_bytes(uri), size, last)
    # a temp file cut short may be left on disk, but never listed (readers list, then read)
    assert storage.list(f"file://{tmp_path}/run/rollouts/step-1") == [uri]


@pytest.mark.s3
def test_an_s3_writer_killed_mid_upload_leaves_a_whole_object(s3):
    size = 24 << 20                # above pyarrow's part size: a multipart upload
    uri = f"s3://{s3.BUCKET}/run/rollouts/step-1/shard.parquet"
    last = kill_writer_mid_write(uri, size, {**s3.env(), "S3_ENDPOINT": s3.endpoint})
    storage = s3.storage()
    _check_whole(storage.read_bytes(uri), size, last)
    assert storage.list(f"s3://{s3.BUCKET}/run/rollouts/step-1") == [uri]


@pytest.mark.parametrize("backend", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_leftovers_of_killed_writers_are_removed_at_the_jobs_next_start(backend, tmp_path, request):
    """Writers SIGKILLed mid-write in a job's prefix and in another job's leave a temporary file
    (file://) or an incomplete multipart upload (S3). At the job's next start (the trainer calls
    `clean_leftovers` on its root with its start time) the job's leftovers go, and nothing else:
    not the other job's, not the whole objects, not a write begun after the start."""
    from grpo_api.storage import Storage
    if backend == "s3":
        s3 = request.getfixturevalue("s3")
        base, env, storage = f"s3://{s3.BUCKET}/runs/default", {**s3.env(), "S3_ENDPOINT": s3.endpoint}, s3.storage()
        client = storage._s3_client()

        def leftovers(root: str) -> list[str]:
            return sorted(u.key for u in client.list_uploads(s3.BUCKET, root.removeprefix(f"s3://{s3.BUCKET}/") + "/"))
    else:
        base, env, storage = f"file://{tmp_path}/runs/default", {}, Storage()

        def leftovers(root: str) -> list[str]:
            return sorted(str(p) for p in Path(root.removeprefix("file://")).rglob(".tmp-*"))
    job, other = f"{base}/job", f"{base}/job-2"              # one a prefix of the other's name
    for root in (job, other):
        kill_writer_leaving(f"{root}/rollouts/step-1/shard.parquet", 24 << 20, env, lambda r=root: leftovers(r))
    left_by_other = leftovers(other)
    started = time.time()
    time.sleep(math.ceil(started) - started + 0.1)           # S3 stamps an upload's start in whole seconds
    fs, path = storage.resolve(f"{job}/rollouts/step-2/shard.parquet")
    if backend == "s3":
        now_writing = fs.open_output_stream(path)            # an upload of now, under way
        now_writing.write(b"n" * (24 << 20))
    else:
        Path(path).parent.mkdir(parents=True)
        now_writing = open(Path(path).parent / ".tmp-shard.parquet.now", "wb")
        now_writing.write(b"n")
        now_writing.flush()
    assert len(leftovers(job)) == 2
    removed = storage.clean_leftovers(job, before=started)
    assert len(removed) == 1 and removed[0].startswith(f"{job}/rollouts/step-1/"), removed
    assert len(leftovers(job)) == 1 and "step-2" in leftovers(job)[0]           # the write of now is kept
    assert leftovers(other) == left_by_other                                      # another job's: not ours
    now_writing.close()
    for root in (job, other):                  # the objects themselves: whole, untouched
        assert len(storage.read_bytes(f"{root}/rollouts/step-1/shard.parquet")) == 24 << 20


# --- a reader while the object is being replaced: one whole version ------------------------------------

@pytest.mark.parametrize("backend", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_read_during_overwrites_returns_one_whole_version(backend, tmp_path, request):
    """A large object read while another writer keeps replacing it (same size, then other
    sizes) is always one version, whole. (On S3 an input stream reads a large object with
    several ranged GETs: before the fix, every such read came back as pieces of 2-4 versions.)"""
    if backend == "s3":
        s3 = request.getfixturevalue("s3")
        storage, uri = s3.storage(), f"s3://{s3.BUCKET}/run/metrics.bin"
    else:
        from grpo_api.storage import Storage
        storage, uri = Storage(), f"file://{tmp_path}/run/metrics.bin"
    size = 24 << 20
    storage.write_bytes(uri, bytes([0]) * size)
    stop = threading.Event()
    sizes = [size]

    def overwrite():
        version = 0
        while not stop.is_set():
            version += 1
            storage.write_bytes(uri, bytes([version % 251]) * sizes[version % len(sizes)])
            stop.wait(0.05)
    writer = threading.Thread(target=overwrite, daemon=True)
    writer.start()
    try:
        for k in range(12):
            if k == 6:
                sizes.extend([size + 1_000_000, size - 1_000_000])     # versions of other sizes too
            data = storage.read_bytes(uri)
            assert len(data) in (size, size + 1_000_000, size - 1_000_000), len(data)
            assert data.count(data[:1]) == len(data), f"read {k}: pieces of several versions"
    finally:
        stop.set()
        writer.join(60)
    # and the reads left nothing behind (on S3 a torn-looking read reads a server-side copy)
    fs, folder = storage.resolve(uri.rsplit("/", 1)[0])
    assert [i.base_name for i in fs.get_file_info(pafs.FileSelector(folder))] == ["metrics.bin"]


# --- a job on S3: a short outage is ridden out, a lasting one stops it clearly ----------------------

@pytest.mark.s3
@pytest.mark.integration
def test_a_run_rides_out_an_s3_outage_and_stops_clearly_when_s3_is_gone(tmp_path, tiny_model, train_data, token,
                                                                       s3, monkeypatch):
    for key, value in s3.env().items():      # what the pods get from spec.storage.secretRef
        monkeypatch.setenv(key, value)
    hold = Hold(tmp_path / "hold")
    prefix = f"s3://{s3.BUCKET}/runs"
    job = write_job(tmp_path / "job.yaml", name="on-s3", model=tiny_model, train=train_data, storage=tmp_path,
                    reward={"function": hold.function, "workers": 1, "timeoutSeconds": 600},
                    rollout={"replicas": 1}, weightSync={"backend": "grpc"},
                    trainer={"nprocPerNode": 1, "totalSteps": 6, "saveFreq": 2})
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["storage"] = {"uri": prefix, "endpoint": s3.endpoint}
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    root = f"{prefix}/default/on-s3"
    (server,) = start_rollout_servers(job, token, 1, tmp_path)
    log_path = tmp_path / "trainer.log"
    try:
        with open(log_path, "wb") as out:
            trainer = subprocess.Popen(trainer_argv(job, server.address, 1), stdout=out, stderr=subprocess.STDOUT,
                                       env=child_env(GRPO_RPC_TOKEN=token), cwd=tmp_path, start_new_session=True)
        try:
            # 1. S3 down for a while just as the server is about to write step 2's rollout shard
            hold.arm(server.proc.pid, after=CALLS_PER_STEP)
            hold.wait_holding(server.proc.pid, 300, also=lambda: trainer.poll() is not None)
            s3.stop()
            hold.release()
            time.sleep(OUTAGE)
            s3.start()
            # 2. S3 gone for good at step 5, as the trainer is about to read the rollout shard:
            #    the trainer is paused while the server writes it and replies, then S3 stops.
            hold.arm(server.proc.pid, after=4 * CALLS_PER_STEP)
            hold.wait_holding(server.proc.pid, 300, also=lambda: trainer.poll() is not None)
            with paused(trainer.pid):
                hold.release()
                wait_until(lambda: f"-> {root}/rollouts/step-5/" in server.log(), 60, what="step 5's shard written")
                s3.stop()
            code = trainer.wait(300)
        finally:
            if trainer.poll() is None:
                kill_tree(trainer.pid)
                trainer.wait()
    finally:
        hold.release()
        server.stop()
    out = trainer_log_tail(log_path, 20000)
    rollout_log = server.log()
    # the outage: the server's write was retried and went through; the run went on to step 4
    assert f"write {root}/rollouts/step-2/" in rollout_log and "transient error (attempt 1/" in rollout_log
    # gone for good: the run stops, saying which operation on which object failed
    assert code != 0, out
    last = [ln for ln in out.splitlines() if "Error" in ln and ln.startswith("[rank0]: ")][-1]
    shard = f"{root}/rollouts/step-5/train-shard-000-attempt-1.parquet"
    assert last.startswith(f"[rank0]: grpo_api.storage.StorageError: read {shard}: failed 5 times"), last
    assert s3.SECRET not in out + rollout_log

    # back up for inspection: what was written is whole, and consistent
    s3.start()
    storage = s3.storage()
    files = [u for u in storage.list(root, recursive=True) if not storage.list(u)]
    fs, base = storage.resolve(root)
    raw = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    assert not [i.path for i in raw if ".tmp-" in i.path], "a temporary object is visible"
    for uri in files:
        data = storage.read_bytes(uri)
        if uri.endswith(".parquet"):
            pq.read_table(pa.BufferReader(data))
        elif uri.endswith(".json"):
            json.loads(data)
        elif uri.endswith(".jsonl"):
            [json.loads(ln) for ln in data.decode().splitlines() if ln]
    metrics = [json.loads(ln) for ln in storage.read_bytes(f"{root}/metrics.jsonl").decode().splitlines() if ln]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert json.loads(storage.read_bytes(f"{root}/progress.json"))["step"] == 4
    assert shard in files                          # the shard the trainer could not read: whole (parsed above)
    assert storage.exists(f"{root}/checkpoints/step-4/manifest.json")
    assert json.loads(storage.read_bytes(f"{root}/checkpoints/step-4/trainer_state.json"))["trainer"]["step"] == 4
