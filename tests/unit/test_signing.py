"""The checkpoint key and the signed manifest (grpo_api.signing): what a user sees when a key
can't be trusted or a manifest doesn't verify. The checkpoints themselves, tampered with in
storage, are in tests/faults/test_checkpoint_integrity.py."""

import os

import pytest

from grpo_api import signing
from grpo_api.signing import CheckpointKeyError, ManifestError


def test_grpo_runs_key_file_is_made_private_once_and_refused_when_others_could_change_it(tmp_path):
    path = tmp_path / "checkpoint.key"
    key = signing.key_file(path, create=True)
    assert path.stat().st_mode & 0o777 == 0o600 and len(bytes.fromhex(key)) == signing.KEY_BYTES
    assert signing.key_file(path, create=True) == key                # a re-run keeps the run's key
    path.chmod(0o644)
    with pytest.raises(CheckpointKeyError, match=r"checkpoint.key: a checkpoint key must be a regular file of yours "
                                                 r"that only you can read and write .*mode -rw-r--r--.*chmod 600"):
        signing.key_file(path, create=True)
    path.unlink()
    other = tmp_path / "elsewhere.key"
    other.write_text(signing.new_key())
    other.chmod(0o600)
    os.symlink(other, path)                                          # a link planted where the key goes
    with pytest.raises(CheckpointKeyError, match="must be a regular file"):
        signing.key_file(path, create=True)
    with pytest.raises(CheckpointKeyError, match=r"no checkpoint key: set GRPO_CHECKPOINT_KEY"):
        signing.read_key({})
    with pytest.raises(CheckpointKeyError, match=r"GRPO_CHECKPOINT_KEY: the checkpoint key must be at least 32 bytes"):
        signing.read_key({"GRPO_CHECKPOINT_KEY": "abcd"})


def test_a_manifest_verifies_only_unchanged_and_under_its_key():
    key = bytes.fromhex(signing.new_key())
    body = {"step": 2, "format": "torch.distributed.checkpoint",
            "files": {".metadata": {"size": 10, "sha256": "a" * 64}}}
    data = signing.sign(body, key)
    assert signing.verify(data, key, "m.json") == body
    with pytest.raises(ManifestError, match="m.json: the manifest's signature does not match this job's checkpoint key"):
        signing.verify(data, bytes.fromhex(signing.new_key()), "m.json")
    changed = data.replace(b'"size": 10', b'"size": 11')
    with pytest.raises(ManifestError, match="signature does not match"):
        signing.verify(changed, key, "m.json")
    with pytest.raises(ManifestError, match="m.json: the manifest is not signed"):
        signing.verify(b'{"step": 2, "files": {}}', key, "m.json")
    escaping = signing.sign({**body, "files": {"../../x": {"size": 1, "sha256": "a" * 64}}}, key)
    with pytest.raises(ManifestError, match="malformed file list"):           # never a path out of the folder
        signing.verify(escaping, key, "m.json")
