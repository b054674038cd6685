"""The trainer's compile caches kept in the job's run (spec.storage.compileCache): torch.compile's
(inductor's) and Triton's kernels, so that a restarted trainer pod, or `grpo run` run again,
skips the compiling its first steps pay.

Before anything compiles, the trainer points the compilers' cache folders
(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) into one local folder and unpacks
`<run>/compile-cache/<name>.tar` there; after a step that compiled new files it packs the folders
and uploads them again. The compilers key their own entries (the graph, their versions, the
device), so a stale archive costs a download, never a wrong kernel; the archive's name
(component, versions, GPU, model config) keeps runs that could never share an entry apart.

A cache holds code the compilers load (inductor's Python modules, compiled shared objects), so
it is trusted as a checkpoint is: `<name>.tar.manifest.json` carries the archive's size and
sha256 under an HMAC of the job's checkpoint key (grpo_api.signing), and an archive is unpacked
only when its bytes match a manifest signed with this job's key. Hence per job, not shared
between jobs (each has its own key), and not for the rollout servers, which hold no key. The
cache is an optimisation: every failure here is logged and the run goes on.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import tempfile
import time
from pathlib import Path

from grpo_api import signing
from grpo_api.records import RunLayout
from grpo_api.spec import StorageSpec
from grpo_api.storage import Storage

log = logging.getLogger(__name__)

ROOT_ENV = "GRPO_COMPILE_CACHE_DIR"
"""The local folder that holds the compilers' caches (default: <tmp>/grpo-compile-cache-<uid>)."""
COMPILER_ENVS = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR"}
MANIFEST_SUFFIX = ".manifest.json"
MARKER = ".grpo-restored.json"
"""In the local folder: the archive unpacked there and its files (the machine's other processes read it)."""
MAX_BYTES = 2 << 30
"""A cache folder larger than this is not uploaded (it is rebuilt by compiling instead)."""


def archive_name(component: str, **facts: object) -> str:
    """`<component>-<16 hex>.tar`: the facts that decide whether two processes could share entries."""
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{component}-{digest}.tar"


def model_config_digest(model_path: str) -> str:
    """The model's architecture (config.json), which shapes every compiled graph; not its weights."""
    try:
        return hashlib.sha256(Path(model_path, "config.json").read_bytes()).hexdigest()
    except OSError:
        return model_path


class CompileCache:
    def __init__(self, storage: Storage, uri: str, folder: str | Path, key: bytes):
        self.storage, self.uri, self.folder, self.key = storage, uri, Path(folder), key
        self.name = uri.rsplit("/", 1)[1]     # the archive's name, as its manifest lists it
        self.manifest_uri = uri + MANIFEST_SUFFIX
        self._known: dict[str, int] = {}      # what the archive in storage holds: path -> size

    @classmethod
    def for_run(cls, spec: StorageSpec, storage: Storage, run_root: str, key: bytes, component: str,
                **facts: object) -> CompileCache | None:
        """The cache of one kind of process of the run at `run_root`, its compilers pointed into it
        (None when storage.compileCache is off: the compilers keep their local defaults)."""
        if not spec.compile_cache:
            return None
        root = Path(os.environ.get(ROOT_ENV) or Path(tempfile.gettempdir(), f"grpo-compile-cache-{os.getuid()}"))
        cache = cls(storage, RunLayout(run_root).compile_cache(archive_name(component, **facts)), root / component, key)
        cache.point_compilers()
        return cache

    def folders(self) -> dict[str, Path]:
        """Each compiler's cache folder (an archive member prefix -> folder)."""
        return {name: self.folder / name for name in COMPILER_ENVS}

    def point_compilers(self) -> None:
        """Each compiler's cache folder into ours. Set, not defaulted: importing torch._dynamo
        already sets TORCHINDUCTOR_CACHE_DIR to its machine-wide default (storage.compileCache:
        false leaves the compilers' folders alone). Inductor and Triton read these when they compile."""
        for name, env in COMPILER_ENVS.items():
            os.environ[env] = str(self.folder / name)

    def restore(self) -> int:
        """Unpack the archive into the folders; the number of files it held (0 when there is none
        or it can't be read). Every process of a machine may call it: under a file lock, the first
        unpacks and leaves a marker the others read instead of downloading again, and a file
        already there is never rewritten (another process's compiler may be reading it)."""
        import fcntl
        started = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        marker = self.folder / MARKER
        try:
            with open(self.folder.with_name(self.folder.name + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if marker.exists() and (done := json.loads(marker.read_text())).get("uri") == self.uri:
                    self._known = done["files"]
                    return len(self._known)
                if not self.storage.exists(self.manifest_uri):
                    log.info("compile cache: none yet at %s; the first steps compile and save it", self.uri)
                    return 0
                data = self._read_signed()
                self._known = self._unpack(data)
                self._write_marker()
        except Exception as exc:      # noqa: BLE001 (an optimisation: any failure only costs the compile)
            log.warning("compile cache: could not restore %s (%s: %s); compiling instead", self.uri,
                        type(exc).__name__, exc)
            return 0
        log.info("compile cache: restored %d files (%.1f MB) from %s in %.1fs", len(self._known),
                 len(data) / 1e6, self.uri, time.monotonic() - started)
        return len(self._known)

    def _read_signed(self) -> bytes:
        """The archive's bytes, once they match the manifest signed with the job's key (ManifestError if not)."""
        body = signing.verify(self.storage.read_bytes(self.manifest_uri), self.key, self.manifest_uri,
                              what="the compile cache")
        entry = body["files"].get(self.name)
        if entry is None:
            raise signing.ManifestError(f"{self.manifest_uri}: the manifest is of another archive; not loaded")
        data = self.storage.read_bytes(self.uri)
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise signing.ManifestError(f"{self.uri}: its bytes do not match the signed manifest (changed or "
                                        f"replaced since the trainer wrote it); not loaded")
        return data

    def _unpack(self, data: bytes) -> dict[str, int]:
        folders, unpacked = self.folders(), {}
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for m in tar.getmembers():
                top, _, rest = m.name.partition("/")
                if top not in folders or not rest or not m.isfile():
                    continue
                if not (folders[top] / rest).exists():
                    m.name = rest
                    tar.extract(m, folders[top], filter="data")     # "data": nothing lands outside the folder
                unpacked[f"{top}/{rest}"] = m.size
        return unpacked

    def _write_marker(self) -> None:
        tmp = self.folder / f".tmp-{os.getpid()}-{MARKER}"
        tmp.write_text(json.dumps({"uri": self.uri, "files": self._known}))
        os.replace(tmp, self.folder / MARKER)

    def _files(self) -> dict[str, int]:
        out = {}
        for name, folder in self.folders().items():
            for path in folder.rglob("*") if folder.is_dir() else ():
                if path.is_file() and not path.is_symlink() and not _transient(path.name):
                    out[f"{name}/{path.relative_to(folder).as_posix()}"] = path.stat().st_size
        return out

    def save_if_grown(self) -> bool:
        """Upload the folders when compiling added or changed files since the last restore or
        save; True when it uploaded. (One caller: trainer rank 0, between steps.)"""
        try:
            files = self._files()
            if all(self._known.get(k) == v for k, v in files.items()):
                return False
            total = sum(files.values())
            if total > MAX_BYTES:
                log.warning("compile cache: %.1f GB is over the %.1f GB kept; not saved", total / 1e9, MAX_BYTES / 1e9)
                self._known = files
                return False
            started = time.monotonic()
            sink = io.BytesIO()
            folders = self.folders()
            with tarfile.open(fileobj=sink, mode="w") as tar:
                for member in sorted(files):
                    top, rest = member.split("/", 1)
                    tar.add(folders[top] / rest, arcname=member, recursive=False)
            data = sink.getvalue()
            self.storage.write_bytes(self.uri, data)
            entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            self.storage.write_bytes(self.manifest_uri, signing.sign(
                {"kind": "compile-cache", "files": {self.name: entry}}, self.key))
        except Exception as exc:      # noqa: BLE001
            log.warning("compile cache: could not save %s (%s: %s)", self.uri, type(exc).__name__, exc)
            return False
        new = sum(1 for k in files if k not in self._known)
        self._known = files
        try:
            self._write_marker()      # this machine's other processes now know the archive as saved
        except OSError:
            pass
        log.info("compile cache: saved %d files (%d new, %.1f MB) to %s in %.1fs", len(files), new,
                 len(data) / 1e6, self.uri, time.monotonic() - started)
        return True


def _transient(name: str) -> bool:
    """A compiler's file being written (renamed into place when done) or a lock, not a cache entry."""
    return name.endswith((".tmp", ".lock")) or name.startswith((".tmp", ".grpo-"))
