"""A rollout pod's log, kept in the job's storage: `<run>/logs/<pod>.log` (GRPO_LOG_URI, set by
the operator).

A finished job scales its rollout Deployment to zero (its pods hold GPUs), and their logs go
with them; a Job's trainer pods stay, so the trainer needs none of this. (The reward and sandbox
pods have no storage credentials, by design: the operator keeps their logs, grpo_operator.server_logs.) The
mirror takes the process's stdout and stderr at the file-descriptor level, so it has what
Python, C extensions (vLLM, NCCL) and child processes that inherit them (the reward workers)
write, and passes every byte on to the pod's own stdout and stderr: `kubectl logs` is unchanged. The copy
in storage is rewritten every `interval` seconds while it changes, and at exit (after an
uncaught exception's traceback is printed); only the last `max_bytes` are kept.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from grpo_api.contracts import LOG_URI_ENV
from grpo_api.storage import Storage


class LogMirror:
    def __init__(self, uri: str, storage: Storage, *, interval: float = 30.0, max_bytes: int = 16 << 20):
        self.uri, self.storage, self.interval, self.max_bytes = uri, storage, interval, max_bytes
        self._buf = bytearray()
        self._dropped = 0                 # bytes cut from the front (max_bytes)
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._closed = threading.Event()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._pod_fds: dict[int, int] = {}       # 1, 2 -> the pod's own stdout, stderr
        self._copiers = []
        for fd in (1, 2):
            self._pod_fds[fd] = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            copier = threading.Thread(target=self._copy, args=(read_end, self._pod_fds[fd]),
                                      name=f"log-mirror-copy-{fd}", daemon=True)
            copier.start()
            self._copiers.append(copier)
        threading.Thread(target=self._upload_while_open, name="log-mirror-upload", daemon=True).start()
        atexit.register(self.close)

    def _copy(self, read_end: int, pod_fd: int) -> None:
        """Pipe -> the pod's stream and the buffer. It must never stop reading: a full pipe would
        block every write of the process."""
        while chunk := os.read(read_end, 1 << 16):
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(pod_fd, view):]
                except OSError:           # the pod's stream is gone: keep the storage copy going
                    break
            with self._lock:
                self._buf += chunk
                if len(self._buf) > self.max_bytes:
                    cut = len(self._buf) - self.max_bytes
                    del self._buf[:cut]
                    self._dropped += cut
            self._changed.set()

    def _upload_while_open(self) -> None:
        while not self._closed.wait(self.interval):
            if self._changed.is_set():
                self._upload()

    def _upload(self) -> None:
        self._changed.clear()
        with self._lock:
            data = bytes(self._buf)
            head = f"[... {self._dropped} earlier bytes dropped]\n".encode() if self._dropped else b""
        try:
            self.storage.write_bytes(self.uri, head + data)
        except Exception as exc:  # noqa: BLE001 - a log copy that fails must not fail the server
            print(f"log mirror: could not write {self.uri}: {exc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Put the pod's stdout back and write the last copy (idempotent; also at exit)."""
        if self._closed.is_set():
            return
        self._closed.set()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, pod_fd in self._pod_fds.items():
            os.dup2(pod_fd, fd)
        # The copy threads read to the pipes' end (everything written before this), unless child
        # processes still hold their write ends: then they get a moment.
        for copier in self._copiers:
            copier.join(timeout=1.0)
        self._upload()


def mirror_from_env(storage: Storage) -> LogMirror | None:
    """The mirror GRPO_LOG_URI asks for (None outside a pod, e.g. under `grpo run`)."""
    uri = os.environ.get(LOG_URI_ENV)
    return LogMirror(uri, storage) if uri else None
