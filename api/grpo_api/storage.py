"""Object storage for everything that crosses processes: prompt and rollout shards, checkpoints,
progress. One `Storage` over `pyarrow.fs` for `file://` and `s3://` URIs (docs/ARCHITECTURE.md §5).

- Writes are atomic: on a file system the bytes go to a temporary file in the same folder that
  is then renamed over the target; on S3 an object becomes visible only when its upload
  completes (a single PUT, or a completed multipart upload for large objects).
- Transient failures (network, throttling, 5xx, I/O errors) are retried with exponential
  backoff, a bounded number of times; then `StorageError` names the operation and the URI.
  Permanent ones (access denied, read-only, a file in the way) are raised at once, as a
  `StorageError` naming the operation and the URI; a missing file or object being read stays
  a `FileNotFoundError`.
- S3 credentials come only from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
  optionally `AWS_SESSION_TOKEN`), which the pods get from `spec.storage.secretRef`. They are
  never logged or put in an error message.

No torch import here.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from grpo_api.s3_uploads import S3Client
from grpo_api.spec import StorageSpec

if TYPE_CHECKING:
    from grpo_api.spec import GRPOJob

log = logging.getLogger(__name__)
T = TypeVar("T")

# pyarrow reports S3 errors as OSError("... AWS Error <CODE> ..."): these codes won't go away
# by trying again.
_PERMANENT_S3_ERRORS = ("ACCESS_DENIED", "NO_SUCH_BUCKET", "NO_SUCH_KEY", "INVALID_ACCESS_KEY_ID",
                        "SIGNATURE_DOES_NOT_MATCH", "RESOURCE_NOT_FOUND", "INVALID_PARAMETER",
                        "Forbidden", "InvalidAccessKeyId", "NoSuchBucket")
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR}


class StorageError(OSError):
    """A storage operation failed for good (after retries, if the failure looked transient)."""


def is_transient(exc: BaseException) -> bool:
    """Whether trying again may succeed: network, throttling and server errors are; a missing
    object, a denied request or a full disk are not."""
    if not isinstance(exc, OSError) or isinstance(exc, StorageError):
        return False
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError)):
        return False
    if exc.errno in _PERMANENT_ERRNOS:
        return False
    return not any(code in str(exc) for code in _PERMANENT_S3_ERRORS)


def _s3_settings(spec: StorageSpec, env: Mapping[str, str]) -> dict:
    access, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        raise StorageError("s3:// storage needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment "
                           "(from spec.storage.secretRef on Kubernetes)")
    return dict(access_key=access, secret_key=secret, session_token=env.get("AWS_SESSION_TOKEN") or None,
                region=spec.region or env.get("AWS_REGION") or "us-east-1")


def _s3_filesystem(spec: StorageSpec, env: Mapping[str, str]) -> pafs.S3FileSystem:
    kwargs = _s3_settings(spec, env)
    if spec.endpoint:
        url = urlparse(spec.endpoint)
        # S3-compatible servers are addressed by path (http://host:port/bucket/key): most of them
        # have no wildcard DNS for virtual-host buckets.
        kwargs.update(endpoint_override=url.netloc, scheme=url.scheme, force_virtual_addressing=False)
    return pafs.S3FileSystem(**kwargs)


class Storage:
    """Reads and writes `file://` and `s3://` URIs. Thread-safe (pyarrow file systems are)."""

    def __init__(self, spec: StorageSpec | None = None, *, env: Mapping[str, str] | None = None,
                 attempts: int = 5, backoff_seconds: float = 0.2, max_backoff_seconds: float = 5.0):
        """spec: endpoint and region for s3:// URIs (its `uri` is not used here: callers pass full
        URIs, see `job_root`). attempts: tries per operation for transient errors."""
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1 (got {attempts})")
        self._spec = spec or StorageSpec()
        self._env = dict(os.environ if env is None else env)
        self._attempts = attempts
        self._backoff = backoff_seconds
        self._max_backoff = max_backoff_seconds
        self._local = pafs.LocalFileSystem()
        self._s3: pafs.S3FileSystem | None = None

    @property
    def spec(self) -> StorageSpec:
        """The endpoint and region this reads s3:// with (a model beside a run is fetched with them)."""
        return self._spec

    # -- URI resolution --------------------------------------------------------------------

    def resolve(self, uri: str) -> tuple[pafs.FileSystem, str]:
        """The pyarrow file system and the path within it for a URI, for callers that stream
        large files themselves (e.g. checkpoints). A plain path is a local file, as in verl's
        data.train_files."""
        if uri.startswith("file://") or "://" not in uri:
            path = uri.removeprefix("file://")
            return self._local, str(Path(path).absolute()) if path else os.getcwd()
        if uri.startswith("s3://"):
            if self._s3 is None:
                self._s3 = _s3_filesystem(self._spec, self._env)
            path = uri[len("s3://"):].rstrip("/")
            if not path:
                raise ValueError(f"{uri!r}: an s3:// URI needs a bucket")
            return self._s3, path
        raise ValueError(f"{uri!r}: unsupported URI; use file://PATH or s3://BUCKET/KEY")

    def _retry(self, op: str, uri: str, fn: Callable[[], T]) -> T:
        delay = self._backoff
        for attempt in range(1, self._attempts + 1):
            try:
                return fn()
            except Exception as exc:
                if not is_transient(exc):
                    if _name_permanent(op, exc):
                        raise StorageError(f"{op} {uri}: {exc}") from exc
                    raise
                if attempt == self._attempts:
                    raise StorageError(f"{op} {uri}: failed {attempt} times, last error: {exc}") from exc
                log.warning("%s %s: transient error (attempt %d/%d), retrying in %.1fs: %s",
                            op, uri, attempt, self._attempts, delay, exc)
                time.sleep(delay)
                delay = min(delay * 2, self._max_backoff)
        raise AssertionError("unreachable")

    def check_writable(self, uri: str) -> None:
        """Write and delete an empty probe object under the folder/prefix `uri`: a location that
        can't be written (read-only, denied, a file in the way) fails here with a StorageError
        naming it, before a run has done any work. Nothing is left behind: not the probe (its
        name is a temporary one, which `list` never shows, even if deleting it fails), not the
        folders it needed."""
        probe = f"{uri.rstrip('/')}/{_TMP_PREFIX}write-check-{uuid.uuid4().hex}"
        fs, path = self.resolve(probe)
        existing = Path(path).parent
        while isinstance(fs, pafs.LocalFileSystem) and not existing.exists():
            existing = existing.parent
        self.write_bytes(probe, b"")
        self.delete(probe)
        if isinstance(fs, pafs.LocalFileSystem):   # and the folders the probe made: nothing is left
            made = Path(path).parent
            while made != existing and made.is_relative_to(existing):
                try:
                    made.rmdir()
                except OSError:
                    break
                made = made.parent

    def delete(self, uri: str) -> None:
        """Delete one file/object; nothing happens when it's absent."""
        fs, path = self.resolve(uri)

        def delete() -> None:
            try:
                fs.delete_file(path)
            except FileNotFoundError:
                pass
        self._retry("delete", uri, delete)

    # -- bytes -----------------------------------------------------------------------------

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Write an object/file atomically: readers see the old content or the new, never a part."""
        fs, path = self.resolve(uri)
        if isinstance(fs, pafs.LocalFileSystem):
            self._retry("write", uri, lambda: _write_local_atomic(path, data))
        else:
            self._retry("write", uri, lambda: _write_stream(fs, path, data))

    def read_bytes(self, uri: str) -> bytes:
        """The whole file/object, as one version: never the start of one write and the rest of
        another, even while it is being replaced."""
        fs, path = self.resolve(uri)
        if isinstance(fs, pafs.LocalFileSystem):
            def read() -> bytes:
                with fs.open_input_stream(path) as f:     # one open file: one version (rename)
                    return f.read()
        else:
            read = lambda: _read_object_whole(fs, path)  # noqa: E731
        return self._retry("read", uri, read)

    def download(self, uri: str, dest: str | Path) -> tuple[int, str]:
        """Copy a file/object to the local file `dest` in chunks (bounded memory); returns the
        (size, sha256 hex) of what was copied, for the caller to check against a manifest."""
        fs, path = self.resolve(uri)

        def copy() -> tuple[int, str]:
            digest, size = hashlib.sha256(), 0
            with fs.open_input_stream(path) as src, open(dest, "wb") as out:
                while chunk := src.read(8 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            return size, digest.hexdigest()
        return self._retry("read", uri, copy)

    # -- arrow tables ----------------------------------------------------------------------

    def write_table(self, uri: str, table: pa.Table) -> None:
        """Write a table as one parquet file, atomically (serialized in memory first: shards are
        small, and a single write is what makes the S3 upload atomic)."""
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        self.write_bytes(uri, sink.getvalue().to_pybytes())

    def read_table(self, uri: str, schema: pa.Schema | None = None) -> pa.Table:
        """Read a parquet file; with `schema`, columns are selected and cast to it, and a missing
        column is a ValueError naming it."""
        table = read_parquet(pa.BufferReader(self.read_bytes(uri)))
        if schema is None:
            return table
        missing = [f.name for f in schema if f.name not in table.column_names]
        if missing:
            raise ValueError(f"{uri}: missing column(s) {missing}; expected {schema.names}")
        return table.select(schema.names).cast(schema)

    # -- listing ---------------------------------------------------------------------------

    def exists(self, uri: str) -> bool:
        fs, path = self.resolve(uri)
        return self._retry("stat", uri, lambda: fs.get_file_info(path).type != pafs.FileType.NotFound)

    def list(self, uri: str, *, recursive: bool = False) -> list[str]:
        """URIs of the files and folders under `uri`, sorted; empty when it doesn't exist."""
        fs, path = self.resolve(uri)
        selector = pafs.FileSelector(path, recursive=recursive, allow_not_found=True)
        infos = self._retry("list", uri, lambda: fs.get_file_info(selector))
        scheme = "file://" if isinstance(fs, pafs.LocalFileSystem) else "s3://"
        return sorted(scheme + info.path for info in infos if not _is_temporary(info.base_name))

    def delete_dir(self, uri: str) -> None:
        """Delete a folder/prefix and everything under it; nothing happens when it's absent."""
        fs, path = self.resolve(uri)

        def delete() -> None:
            try:
                fs.delete_dir(path)
            except FileNotFoundError:
                pass
        self._retry("delete", uri, delete)

    def clean_leftovers(self, uri: str, *, before: float) -> list[str]:
        """Remove what writers killed mid-write left under the folder/prefix `uri` (a job's own
        root): temporary files (`.tmp-*`) last changed before `before` (a Unix time), and on S3
        the multipart uploads started before it. A writer of now is never touched. Returns what
        was removed (URIs; an upload as `<uri> (incomplete upload)`)."""
        fs, path = self.resolve(uri)
        selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
        infos = self._retry("list", uri, lambda: fs.get_file_info(selector))
        scheme = "file://" if isinstance(fs, pafs.LocalFileSystem) else "s3://"
        removed = [scheme + i.path for i in infos if i.type == pafs.FileType.File and _is_temporary(i.base_name)
                   and i.mtime is not None and i.mtime.timestamp() < before]
        for tmp in removed:
            self.delete(tmp)
        if scheme == "s3://":
            client = self._s3_client()
            bucket, _, prefix = path.partition("/")
            prefix = prefix.rstrip("/") + "/" if prefix else ""
            for upload in self._retry("list uploads", uri, lambda: client.list_uploads(bucket, prefix)):
                if upload.initiated.timestamp() < before:
                    self._retry("abort upload", f"s3://{bucket}/{upload.key}", lambda u=upload: client.abort(bucket, u))
                    removed.append(f"s3://{bucket}/{upload.key} (incomplete upload)")
        return removed

    def _s3_client(self) -> S3Client:
        return S3Client(endpoint=self._spec.endpoint, **_s3_settings(self._spec, self._env))


_TMP_PREFIX = ".tmp-"


def _name_permanent(op: str, exc: BaseException) -> bool:
    """Whether a permanent error is re-raised as a StorageError naming the operation and the
    URI (a bare OSError names at most a local path). A missing file stays FileNotFoundError
    for readers, which test for it; a write that finds no place to go is named."""
    if not isinstance(exc, OSError) or isinstance(exc, StorageError):
        return False
    return op == "write" or not isinstance(exc, FileNotFoundError)


def _is_temporary(name: str) -> bool:
    return name.startswith(_TMP_PREFIX)


def _write_local_atomic(path: str, data: bytes) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{_TMP_PREFIX}{target.name}.{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the rename must not be durable before the bytes are
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def read_parquet(source, columns: list[str] | None = None) -> pa.Table:
    """Every parquet read of the project, on the calling thread alone. A process that exits soon
    after a read that started Arrow's pool threads can abort at exit (`terminate called without
    an active exception`, SIGABRT: apache/arrow#39862); CI saw `grpo rollouts export` do it. With
    `use_threads=False` alone `read_table` still pre-buffers on Arrow's IO pool, and one short
    process in 30 still aborted in a loaded CI run (tests/api/test_storage.py); without
    pre-buffering the read starts no thread. Our files are shards and datasets, read once:
    parallel decoding gains little there."""
    with pq.ParquetFile(source, pre_buffer=False) as parquet_file:
        return parquet_file.read(columns=columns, use_threads=False)


class _ObjectChanged(OSError):
    """The object was replaced while it was read (transient: read it again)."""


def _read_object_whole(fs: pafs.FileSystem, path: str) -> bytes:
    # An input *stream* reads a large object with several ranged GETs: an object replaced
    # meanwhile comes back as pieces of two versions. One GET for the whole size returns one
    # version; a replacement of another size between the size lookup and the GET (a truncated
    # or short read) shows in the size, checked again after the read.
    with fs.open_input_file(path) as f:
        size = f.size()
        data = f.read_at(size, 0) if size else b""
    if len(data) == size and fs.get_file_info(path).size == size:
        return bytes(data)
    # Replaced while it was read (or just after: the check can't tell). Under a writer that keeps
    # replacing it, every direct read may look torn, so read a server-side copy instead:
    # CopyObject copies one version whole, and no one writes the copy. (Without write access the
    # copy fails, and the caller's retries read directly again.)
    snapshot = f"{path.rsplit('/', 1)[0]}/{_TMP_PREFIX}read-{uuid.uuid4().hex}"
    try:
        fs.copy_file(path, snapshot)
    except OSError as exc:
        raise _ObjectChanged(f"{path} changed while it was read ({size} bytes, then {len(data)}); "
                             f"a copy to read could not be made: {exc}") from exc
    try:
        with fs.open_input_file(snapshot) as f:
            return bytes(f.read_at(f.size(), 0))
    finally:
        try:
            fs.delete_file(snapshot)
        except OSError as exc:      # a leftover temporary: hidden from list(), removed by clean_leftovers
            log.warning("could not delete the read copy %s: %s", snapshot, exc)


def _write_stream(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def check_local_model_path(path: str, field: str = "spec.model.path") -> None:
    """A model path that can only be a local folder (absolute, ./, ../) must exist: transformers
    would take it for a hub id and answer with a confusing repo-id error."""
    if path.startswith(("/", "./", "../")) and not Path(path).exists():
        raise FileNotFoundError(f"{field}: {path!r} does not exist (give a local model folder, "
                                f"or a Hugging Face model id such as Qwen/Qwen3-8B)")


def job_root(job: "GRPOJob", *, local: bool, cwd: str | Path | None = None) -> str:
    """The URI under which a job's files live (grpo_api.records.RunLayout takes it).

    Local runs without `spec.storage.uri` use `file://<abs cwd>/outputs/<project>/<experiment>`
    (verl's habit); otherwise `<storage.uri>/<namespace>/<name>`, so jobs sharing a bucket never
    collide, and on Kubernetes `.../<name>/<uid>`: a job deleted and applied again under the same
    name is a new object with a new run (its status never shows the old one's progress, and the
    old one's checkpoints, signed with a key deleted with it, are not its own). A local run of the
    same file resumes where it stopped (no uid)."""
    uri = job.spec.storage.uri
    if uri is None:
        if not local:
            raise ValueError("spec.storage.uri: required on Kubernetes (e.g. s3://bucket/prefix): "
                             "the trainer and the rollout pods exchange files through it")
        base = Path(cwd or os.getcwd()).absolute()
        trainer = job.spec.trainer
        return f"file://{base / 'outputs' / trainer.project_name / trainer.experiment_name}"
    if uri.startswith("file://"):
        path = uri[len("file://"):]
        # A relative file:// URI would mean different folders to processes with different cwds.
        uri = f"file://{(Path(cwd or os.getcwd()) / path).absolute()}" if not path.startswith("/") else uri
    root = f"{uri.rstrip('/')}/{job.metadata.namespace}/{job.metadata.name}"
    return f"{root}/{job.metadata.uid}" if job.metadata.uid and not local else root
