"""Signed manifests: nothing that a writer of the job's storage puts there is loaded (checkpoints, and the
trainer's compile cache: grpo_trainer.compile_cache).

torch.distributed.checkpoint (DCP) keeps a checkpoint's `.metadata` as a pickle and loads
non-tensor state with `torch.load(weights_only=False)`, so loading a checkpoint runs whatever
its writer chose. A checkpoint's `manifest.json` therefore lists every file of it with its size
and sha256, and carries an HMAC-SHA256 of that list under the job's checkpoint key, which only
the job's trainer holds (the operator keeps it in the job's Secret, `grpo run` in
`<run>/checkpoint.key`, mode 0600). A loader checks the signature, then each file as it copies
it into a folder of its own, and lets DCP read only that copy (grpo_trainer.checkpoint).

Only the standard library here: the launcher makes keys and never imports torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

KEY_ENV = "GRPO_CHECKPOINT_KEY"
"""The job's checkpoint key, as hex (the trainer's environment; a Secret key on Kubernetes)."""
KEY_FILE = "checkpoint.key"
"""`grpo run` keeps the key of a run in `<run>/checkpoint.key`, so a re-run can resume."""
KEY_BYTES = 32
SIGNATURE = "hmac_sha256"


class CheckpointKeyError(RuntimeError):
    """No usable checkpoint key: the message says where one was looked for and why it won't do."""


class ManifestError(ValueError):
    """A checkpoint that must not be loaded: the message names the file and what is wrong."""


def new_key() -> str:
    return secrets.token_hex(KEY_BYTES)


def parse_key(value: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(value.strip())
    except ValueError:
        raise CheckpointKeyError(f"{where}: the checkpoint key must be hex digits") from None
    if len(key) < KEY_BYTES:
        raise CheckpointKeyError(f"{where}: the checkpoint key must be at least {KEY_BYTES} bytes "
                                 f"({2 * KEY_BYTES} hex digits), got {len(key)}")
    return key


def read_key(env: Mapping[str, str] | None = None) -> bytes:
    """The job's checkpoint key from `GRPO_CHECKPOINT_KEY`."""
    env = os.environ if env is None else env
    value = env.get(KEY_ENV, "")
    if not value.strip():
        raise CheckpointKeyError(
            f"no checkpoint key: set {KEY_ENV} to the job's key ({2 * KEY_BYTES} hex digits; `grpo run` and the "
            f"operator set it). Checkpoints are signed with it, and only checkpoints signed with it are loaded")
    return parse_key(value, KEY_ENV)


def key_file(path: Path, *, create: bool) -> str:
    """The key kept in `path` (hex), made (mode 0600) when absent and `create`. The file must be
    a regular file of this user that no one else can read or write: in a folder others can
    write, someone could otherwise put their own key there and sign their own checkpoints."""
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(new_key() + "\n")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointKeyError(f"{path}: no checkpoint key there") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CheckpointKeyError(
            f"{path}: a checkpoint key must be a regular file of yours that only you can read and write "
            f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); fix it with chmod 600, "
            f"or remove it to start the run over with a new key")
    value = path.read_text().strip()
    parse_key(value, str(path))
    return value


def sha256_file(path: str | Path) -> tuple[int, str]:
    """(size, sha256 hex) of a local file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _mac(body: dict, key: bytes) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def sign(body: dict, key: bytes) -> bytes:
    """The manifest file's bytes: `body` (with `files`: name -> {size, sha256}) and its HMAC."""
    return json.dumps({**body, SIGNATURE: _mac(body, key)}, indent=1, sort_keys=True).encode()


def verify(data: bytes, key: bytes, where: str, what: str = "the checkpoint") -> dict:
    """The manifest's body, if it is signed with `key`; else ManifestError naming `where` and
    refusing to load `what`. (JSON parsing runs no code; nothing else is read before the
    signature holds.)"""
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{where}: not a manifest ({exc}); refusing to load {what}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get(SIGNATURE), str):
        raise ManifestError(f"{where}: the manifest is not signed; refusing to load {what} (only what this "
                            f"job's trainer wrote, signed with the job's checkpoint key, is loaded)")
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    if not hmac.compare_digest(manifest[SIGNATURE], _mac(body, key)):
        raise ManifestError(f"{where}: the manifest's signature does not match this job's checkpoint key: it was "
                            f"changed, or written by someone else (another job, or this job under another key); "
                            f"refusing to load {what}")
    files = body.get("files")
    if not isinstance(files, dict) or not all(_plain_name(n) and _entry_ok(e) for n, e in files.items()):
        raise ManifestError(f"{where}: malformed file list in the manifest")
    return body


def _plain_name(name: str) -> bool:
    """A file name in the checkpoint's folder, never a path out of it."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def _entry_ok(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64)
