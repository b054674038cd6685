"""The run's lease (grpo_trainer.lease): one trainer at a time writes a run folder; a second one is
refused naming the holder, a dead holder's lease is taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from grpo_api.records import RunLayout
from grpo_api.storage import Storage
from grpo_trainer.lease import LeaseHeld, LeaseRecord, RunLease


@pytest.fixture
def run(tmp_path):
    return Storage(), RunLayout(f"file://{tmp_path}/runs/default/job").lease


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_second_trainer_is_refused_naming_the_live_holder(run):
    storage, uri = run
    first = RunLease(storage, uri, job_uid="uid-1", host="node-a")
    first.acquire()
    try:
        record = LeaseRecord.from_json(storage.read_bytes(uri))
        assert (record.host, record.pid, record.job_uid) == ("node-a", first.record.pid, "uid-1")
        second = RunLease(storage, uri, job_uid="uid-1", host="node-a")
        with pytest.raises(LeaseHeld, match=rf"another trainer is writing the run file://.*/job \(host node-a, "
                                            rf"pid {first.record.pid}, job uid uid-1;"):
            second.acquire(renew=False)
        assert LeaseRecord.from_json(storage.read_bytes(uri)).holder == first.record.holder   # untouched
    finally:
        first.release()
    assert not storage.exists(uri)          # released at exit: the next start takes it at once
    RunLease(storage, uri, job_uid=None, host="node-a").acquire(renew=False)


def test_a_lease_whose_holder_is_gone_is_taken_over(run):
    storage, uri = run
    # on this host, a process that exited (kill -9 of every trainer process, then a new `grpo run`):
    # its lease names the start time it had while it lived
    RunLease(storage, uri, job_uid=None, host="node-a", pid=_dead_pid()).acquire(renew=False)
    storage.write_bytes(uri, json.dumps({**json.loads(storage.read_bytes(uri)), "pid_start": "4242"}).encode())
    taker = RunLease(storage, uri, job_uid=None, host="node-a")
    taker.acquire(renew=False)
    assert LeaseRecord.from_json(storage.read_bytes(uri)).holder == taker.record.holder
    # anywhere, one not renewed for longer than its TTL
    storage.delete(uri)
    RunLease(storage, uri, job_uid=None, host="node-b", ttl_s=60, clock=lambda: 1000.0).acquire(renew=False)
    later = RunLease(storage, uri, job_uid=None, host="node-c", clock=lambda: 1061.0)
    later.acquire(renew=False)
    assert LeaseRecord.from_json(storage.read_bytes(uri)).host == "node-c"


def test_on_another_host_a_holder_that_renews_is_alive_and_one_that_does_not_is_taken_over(run):
    # A pod restarted after a crash finds its predecessor's fresh lease: it waits one TTL for a
    # renewal instead of failing the job; a live holder on another node renews and is kept.
    storage, uri = run
    live = RunLease(storage, uri, job_uid="u", host="pod-a", ttl_s=4.0)
    live.acquire()
    try:
        with pytest.raises(LeaseHeld, match="host pod-a"):
            RunLease(storage, uri, job_uid="u", host="pod-b", ttl_s=4.0).acquire(renew=False)
    finally:
        live.release()
    RunLease(storage, uri, job_uid="u", host="pod-a", ttl_s=0.5).acquire(renew=False)     # then it crashed
    restarted = RunLease(storage, uri, job_uid="u", host="pod-b", ttl_s=0.5)
    restarted.acquire(renew=False)
    assert LeaseRecord.from_json(storage.read_bytes(uri)).host == "pod-b"


def test_a_restarted_pod_waits_out_its_predecessors_lease_though_hostname_and_pid_match(run):
    # Kubernetes restarts a crashed trainer pod under the same hostname, and its new trainer often
    # gets the dead one's pid: only the PID namespace tells them apart. The newcomer must wait the
    # TTL out (the predecessor no longer renews), not take the live-looking pid for a holder and
    # fail the job (the CI failure of 12-03: exit 2, "another trainer is writing the run").
    storage, uri = run
    dead = RunLease(storage, uri, job_uid="u", host="trainer-0", ttl_s=0.5)
    dead.acquire(renew=False)
    record = json.loads(storage.read_bytes(uri))
    record.update(pid=os.getpid(), pid_namespace="other-boot/pid:[1]")   # our own pid: "alive" here
    storage.write_bytes(uri, json.dumps(record).encode())
    restarted = RunLease(storage, uri, job_uid="u", host="trainer-0", ttl_s=0.5)
    restarted.acquire(renew=False)
    assert LeaseRecord.from_json(storage.read_bytes(uri)).holder == restarted.record.holder


def test_a_restarted_container_that_gets_its_predecessors_namespace_number_and_pid_takes_over(run):
    # The 12-04 CI failure: the restarted container's PID namespace got the dead one's inode number
    # (freed, then reused) and its trainer the dead one's pid. The start time tells them apart: the
    # holder is gone at once; while it lives (same pid and start time) the newcomer is refused.
    storage, uri = run
    RunLease(storage, uri, job_uid="u", host="trainer-0", ttl_s=60).acquire(renew=False)
    record = json.loads(storage.read_bytes(uri))
    storage.write_bytes(uri, json.dumps({**record, "pid_start": "1"}).encode())   # our pid, started at boot
    restarted = RunLease(storage, uri, job_uid="u", host="trainer-0", ttl_s=60)
    restarted.acquire(renew=False)                                                  # at once: no TTL wait
    assert LeaseRecord.from_json(storage.read_bytes(uri)).holder == restarted.record.holder
    with pytest.raises(LeaseHeld, match="host trainer-0"):                         # the live holder itself
        RunLease(storage, uri, job_uid="u", host="trainer-0", ttl_s=60).acquire(renew=False)


def test_a_holder_whose_lease_was_taken_over_stops_writing(run):
    storage, uri = run
    lost = threading.Event()
    old = RunLease(storage, uri, job_uid=None, host="pod-a", on_lost=lambda holder: lost.set())
    old.acquire(renew=False)
    RunLease(storage, uri, job_uid=None, host="pod-b", clock=lambda: old.record.renewed_at + 61).acquire(renew=False)
    old.renew()
    assert lost.is_set()
    assert LeaseRecord.from_json(storage.read_bytes(uri)).host == "pod-b"    # not overwritten
