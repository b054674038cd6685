"""The run's lease: one trainer at a time writes a run folder.

Trainer rank 0 takes `<run>/trainer.lease` (RunLayout.lease) before it writes anything there and
renews it every ttl/4 seconds while it runs; it deletes it when it exits. The file names the
holder (host, pid, job uid), so a second trainer of the same run, say a second `grpo run` of the
job beside an orphaned trainer, stops with exit code 2 and a message naming the first one instead
of writing into its run. It is a plain object in the run's storage, so it works for file:// and
s3:// runs and across pods.

A lease whose holder stopped renewing is taken over: one older than its TTL at once; one in this
process namespace (same boot, same PID namespace, same pid with the same start time) whose process
is gone at once; any other (another node, or a pod restarted after a crash: same hostname, a new
PID namespace, which may even get the dead one's inode number, where the old pid means nothing)
once it goes one TTL without a renewal. A holder that still renews is alive: the newcomer is refused.
Two trainers taking a free lease at the same moment: the last write wins and the other reads
that back and is refused.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.fs as pafs

from grpo_api.storage import Storage

log = logging.getLogger("grpo.trainer")

LEASE_TTL_S = 60.0
"""A lease not renewed for this long is stale (rank 0 renews it every TTL/4: a storage hiccup or a
slow step doesn't lose it)."""


class LeaseHeld(RuntimeError):
    """Another live trainer holds the run; the message names it."""


@dataclass(frozen=True)
class LeaseRecord:
    """The lease file's content (JSON)."""

    holder: str
    """This holding's own id (a fresh one per trainer start)."""
    host: str
    pid: int
    job_uid: str | None
    renewed_at: float
    """Wall-clock seconds (time.time()) of the last renewal."""
    renewals: int
    ttl_s: float
    pid_namespace: str = ""
    """The holder's kernel boot and PID namespace (`_pid_namespace`): only a newcomer in the same one
    can ask whether `pid` is alive. Empty in leases from before it was recorded."""
    pid_start: str = ""
    """The holder process's start time (`_process_start`): a namespace's inode number is reused once
    it is freed (a restarted container gets its dead predecessor's, on the 12-04 CI run), and so is
    a pid; with the start time they name one process."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LeaseRecord | None:
        """None for a file that isn't a lease (then it protects nothing and is replaced)."""
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, job uid {self.job_uid or '-'}"


def _pid_namespace() -> str:
    """This process's boot and PID namespace, e.g. '<boot id>/pid:[4026532510]'; '' where /proc
    doesn't say (then no pid is trusted and a fresh lease is waited out)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks after boot (/proc/<pid>/stat, field 22); '' when there
    is no such process or /proc doesn't say."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class RunLease:
    """Rank 0's lease on the run (module doc): `acquire()`, then renewed in a thread until
    `release()` (also at interpreter exit)."""

    def __init__(self, storage: Storage, uri: str, *, job_uid: str | None, ttl_s: float = LEASE_TTL_S,
                 host: str | None = None, pid: int | None = None, clock: Callable[[], float] = time.time,
                 on_lost: Callable[[LeaseRecord], None] | None = None):
        self.storage, self.uri, self.ttl_s, self.clock = storage, uri, ttl_s, clock
        pid = os.getpid() if pid is None else pid
        self.record = LeaseRecord(holder=uuid.uuid4().hex, host=host or socket.gethostname(), pid=pid,
                                  job_uid=job_uid, renewed_at=0.0, renewals=0, ttl_s=ttl_s,
                                  pid_namespace=_pid_namespace(), pid_start=_process_start(pid))
        self.on_lost = on_lost or _exit_on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._made: list[Path] = []     # local folders the lease's write created, removed with it if empty

    def _read(self) -> LeaseRecord | None:
        if not self.storage.exists(self.uri):
            return None
        try:
            return LeaseRecord.from_json(self.storage.read_bytes(self.uri))
        except FileNotFoundError:        # released meanwhile
            return None

    def _write(self) -> None:
        self.record = LeaseRecord(**{**asdict(self.record), "renewed_at": self.clock(),
                                     "renewals": self.record.renewals + 1})
        self.storage.write_bytes(self.uri, self.record.to_json())

    def acquire(self, *, renew: bool = True) -> None:
        """Take the lease or raise LeaseHeld naming its live holder; then renew it every ttl/4 s."""
        current = self._read()
        if current is not None and current.holder != self.record.holder:
            self._wait_out(current)
        fs, path = self.storage.resolve(self.uri)
        if isinstance(fs, pafs.LocalFileSystem):
            folder = Path(path).parent
            while not folder.exists():
                self._made.append(folder)
                folder = folder.parent
        self._write()
        won = self._read()
        if won is None or won.holder != self.record.holder:
            raise LeaseHeld(self._held_message(won or self.record))
        if renew:
            self._thread = threading.Thread(target=self._renew_loop, name="run-lease", daemon=True)
            self._thread.start()
            atexit.register(self.release)
            _HELD.append(self)

    def _wait_out(self, current: LeaseRecord) -> None:
        """Return once `current` is stale (or gone); raise LeaseHeld while its holder renews it."""
        age = self.clock() - current.renewed_at
        if age > current.ttl_s:
            log.warning("Taking over the run's lease from a trainer that stopped renewing it %.0fs ago (%s)",
                        age, current.describe())
            return
        if (current.host == self.record.host and current.pid_namespace == self.record.pid_namespace != ""
                and current.pid_start != ""):
            if _process_start(current.pid) == current.pid_start:
                raise LeaseHeld(self._held_message(current))
            log.warning("Taking over the run's lease: its holder's process is gone (%s)", current.describe())
            return
        # Another machine or PID namespace (a restarted pod keeps its hostname, and its predecessor's
        # pid may be anyone's here), or a lease without the start time: its process can't be asked.
        # Alive iff it renews within its TTL.
        wait = current.ttl_s - max(age, 0.0) + 1.0
        log.info("The run's lease is held by %s, renewed %.0fs ago: waiting up to %.0fs to see whether it "
                 "still renews it", current.describe(), age, wait)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(1.0, current.ttl_s / 8))
            now = self._read()
            if now is None:
                return
            if (now.holder, now.renewals) != (current.holder, current.renewals):
                raise LeaseHeld(self._held_message(now))
        log.warning("Taking over the run's lease from %s: not renewed for %.0fs", current.describe(), wait)

    def _held_message(self, holder: LeaseRecord) -> str:
        run = self.uri.rsplit("/", 1)[0]
        return (f"another trainer is writing the run {run} ({holder.describe()}; its lease {self.uri} is renewed "
                f"every {holder.ttl_s / 4:.0f}s): stop it first; a trainer that died leaves the lease to the "
                f"next start after {holder.ttl_s:.0f}s")

    def renew(self) -> None:
        """Renew the lease, unless another trainer took it (then `on_lost`)."""
        current = self._read()
        if current is not None and current.holder != self.record.holder:
            self._stop.set()
            self.on_lost(current)
            return
        self._write()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except Exception as exc:  # noqa: BLE001 - a storage hiccup: the next renewal retries
                log.warning("Can't renew the run's lease %s (retrying in %.0fs): %s", self.uri, self.ttl_s / 4, exc)

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            current = self._read()
            if current is not None and current.holder == self.record.holder:
                self.storage.delete(self.uri)
                for folder in self._made:        # a run stopped before it wrote anything else
                    try:
                        folder.rmdir()
                    except OSError:              # the run wrote there: it stays
                        break
        except Exception as exc:  # noqa: BLE001 - at exit: the next start sees a stale lease instead
            log.warning("Can't release the run's lease %s: %s", self.uri, exc)


_HELD: list[RunLease] = []
"""The leases this process renews: released at exit (atexit), or by `release_held` before an
os._exit, which skips atexit (the trainer's exit on bad input leaves nothing in the run)."""


def release_held() -> None:
    while _HELD:
        _HELD.pop().release()


def _exit_on_lost(holder: LeaseRecord) -> None:
    # Another trainer took the run over (ours went a whole TTL without a renewal): writing on
    # would mix two trainers' steps in one run.
    log.error("Another trainer took over this run's lease (%s): stopping without writing anything more",
              holder.describe())
    os._exit(1)
