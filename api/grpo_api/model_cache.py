"""Models fetched once into a cache folder that the pods share (spec.model.cache), and models in
object storage (`model.path: s3://...` or `file://...`).

On Kubernetes the trainer and rollout pods run `grpo model fetch` as an init container: it
copies the model (object storage, or the Hugging Face hub) into `<cache>/<name>-<hash>/` of the
job's PersistentVolumeClaim, or of an emptyDir when the model is in object storage and there is
no claim. The main containers get `GRPO_MODEL_CACHE` and load from that folder
(`local_model`), read-only. Kubeflow Trainer's model initializer does the same with a JobSet
step; here it is one init container per pod, so a pod never starts without its model and a
restarted pod finds it already there.

Pods fetching at once: one downloads while holding a lock on `<cache>/.<folder>.lock`, the
others wait for it and then find the folder. The download goes to a `.partial-*` folder that is
renamed into place when complete, so a pod killed mid-download leaves no folder that looks
complete (the next fetcher deletes its partial under the lock).

No torch here; the hub download imports huggingface_hub only when it runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import pyarrow.fs as pafs

from grpo_api.spec import ModelSpec, StorageSpec, is_local_folder
from grpo_api.storage import Storage

CACHE_ENV = "GRPO_MODEL_CACHE"
"""The folder the fetched models are in (the pods' mount of the cache volume)."""
MOUNT_PATH = "/model-cache"
"""Where the pods mount the cache volume."""
_URI = re.compile(r"^(s3|file)://")


def is_uri(path: str) -> bool:
    """A model in object storage (s3://, file://): transformers can't load it, it is fetched."""
    return bool(_URI.match(path))


def needs_fetch(model: ModelSpec) -> bool:
    """Whether the pods fetch the model before they start: a cache asked for, or a model in
    object storage."""
    return model.cache is not None or is_uri(model.path) or is_uri(model.tokenizer_path or "")


def folder_name(source: str) -> str:
    """`<last part>-<12 hex of sha256(source)>`: readable, and one folder per source."""
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", source.rstrip("/").rsplit("/", 1)[-1]) or "model"
    return f"{tail[:60]}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"


def sources(model: ModelSpec) -> list[str]:
    """What a fetch copies: the model, and the tokenizer when it is elsewhere. A local folder is
    never copied (it is already on the pod)."""
    wanted = [model.path, *([model.tokenizer_path] if model.tokenizer_path else [])]
    return [s for s in dict.fromkeys(wanted) if not is_local_folder(s)]


def default_root(env: Mapping[str, str]) -> Path:
    """Outside a pod (`grpo run`, `grpo export`): the user's cache folder."""
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "grpo-operator" / "models"


def local_model(model: ModelSpec, storage: StorageSpec | None = None, env: Mapping[str, str] | None = None, *,
                log=print) -> ModelSpec:
    """The model spec the loaders use: fetched sources replaced by their cache folders. In a pod
    (GRPO_MODEL_CACHE set, a read-only mount) the init container fetched them and they must be
    there; elsewhere a model in object storage is fetched into the user's cache on first use."""
    env = os.environ if env is None else env
    root = env.get(CACHE_ENV)
    wanted = [s for s in sources(model) if root or is_uri(s)]
    if not wanted:
        return model
    if not root:
        root = str(default_root(env))
        files = Storage(storage, env=env)
        for source in wanted:       # only object storage: transformers downloads hub models itself
            fetch(source, root, files, log=log)
    update = {}
    for field, key in (("path", "path"), ("tokenizer_path", "tokenizerPath")):
        value = getattr(model, field)
        if value in wanted:
            folder = Path(root) / folder_name(value)
            if not folder.is_dir():
                raise FileNotFoundError(f"spec.model.{key}: {value} is not in the model cache {root} "
                                        f"(no {folder.name}/): `grpo model fetch` puts it there")
            update[field] = str(folder)
    return model.model_copy(update=update)


def fetch(source: str, root: str | Path, storage: Storage, *, log=print) -> Path:
    """Copy `source` into `<root>/<folder_name(source)>` unless it is there; returns the folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = folder_name(source)
    folder = root / name
    if folder.is_dir():
        log(f"{source}: cached in {folder}")
        return folder
    with open(root / f".{name}.lock", "w") as lock:
        started = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)       # another pod may be fetching the same model
        if folder.is_dir():
            log(f"{source}: cached in {folder} (another fetcher wrote it; waited {time.monotonic() - started:.0f} s)")
            return folder
        for stale in root.glob(f".partial-{name}-*"):     # left by a fetcher that was killed
            shutil.rmtree(stale, ignore_errors=True)
        partial = root / f".partial-{name}-{os.getpid()}"
        partial.mkdir()
        try:
            files, size = (_copy_hub if not is_uri(source) else _copy_storage)(source, partial, storage)
            os.rename(partial, folder)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    log(f"{source}: copied {files} files ({size / 2**20:.1f} MiB) into {folder} in "
        f"{time.monotonic() - started:.1f} s")
    return folder


def _copy_storage(source: str, dest: Path, storage: Storage) -> tuple[int, int]:
    fs, base = storage.resolve(source)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    files = [i for i in infos if i.type == pafs.FileType.File]
    if not files:
        raise FileNotFoundError(f"spec.model.path: {source} holds no files")
    size = 0
    scheme = source.split("://", 1)[0]
    for info in files:
        relative = info.path[len(base.rstrip("/")) + 1:]
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        size += storage.download(f"{scheme}://{info.path}", target)[0]
    return len(files), size


def _copy_hub(source: str, dest: Path, storage: Storage) -> tuple[int, int]:
    """A Hugging Face hub model id (HF_TOKEN / HF_ENDPOINT from the environment, as transformers
    reads them). Not exercised by the tests: the hub is not reachable where they run."""
    from huggingface_hub import snapshot_download
    snapshot_download(repo_id=source, local_dir=str(dest))
    shutil.rmtree(dest / ".cache", ignore_errors=True)     # huggingface_hub's download bookkeeping
    files = [p for p in dest.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def fetch_model(model: ModelSpec, storage: StorageSpec | None, root: str | Path, *,
                env: Mapping[str, str] | None = None, log=print) -> None:
    """Everything `local_model` looks for in `root`: the model and its tokenizer. Object storage
    is read with the job's storage settings and credentials."""
    files = Storage(storage, env=env)
    for source in sources(model):
        fetch(source, root, files, log=log)
