"""spec.storage.compileCache (grpo_trainer.compile_cache): what one trainer process compiled, a later
one of the same job on another machine (its own empty local folder) finds in the job's run, and
torch.compile hits it instead of compiling; an archive not signed with the job's key is never
unpacked. The compile is inductor's on CPU here; the trainer uses the same folders on GPU
(bench/RESULTS.md measures its first steps)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest

from grpo_api import signing
from grpo_trainer.compile_cache import COMPILER_ENVS, CompileCache
from grpo_api.spec import StorageSpec
from grpo_api.storage import Storage

COMPILE = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    from grpo_trainer.compile_cache import CompileCache
    from grpo_api.spec import StorageSpec
    from grpo_api.storage import Storage
    spec = StorageSpec(uri=sys.argv[1])
    cache = CompileCache.for_run(spec, Storage(spec), sys.argv[1] + "/job", bytes.fromhex(sys.argv[2]), "trainer",
                                 model="tiny")
    restored = cache.restore()

    @torch.compile
    def layer(x, w):
        return torch.nn.functional.silu(x @ w).square().mean()

    layer(torch.randn(8, 16), torch.randn(16, 16))      # one graph: the mechanism, not autograd, is under test
    print(json.dumps({"restored": restored, "saved": cache.save_if_grown(),
                      "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}))
""")


def _machine_env(tmp_path, name: str) -> dict:
    """A process on a machine of its own: its own local cache folder, no compiler cache set.
    One compile thread: inductor's pool of compile workers would take longer to start on 2 cores
    than the one kernel it compiles."""
    env = {k: v for k, v in os.environ.items() if k not in COMPILER_ENVS.values()}
    return {**env, "GRPO_COMPILE_CACHE_DIR": str(tmp_path / name), "TORCHINDUCTOR_COMPILE_THREADS": "1"}


KEY = signing.new_key()


def _compile(tmp_path, machine: str, storage_uri: str) -> dict:
    out = subprocess.run([sys.executable, "-c", COMPILE, storage_uri, KEY], env=_machine_env(tmp_path, machine),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_elsewhere_hits_what_the_first_compiled(tmp_path):
    uri = f"file://{tmp_path / 'bucket'}"
    first = _compile(tmp_path, "machine-a", uri)
    assert first["restored"] == 0 and first["saved"] and first["misses"] >= 1, first
    names = sorted(p.name for p in (tmp_path / "bucket" / "job" / "compile-cache").iterdir())
    assert len(names) == 2 and names[0].startswith("trainer-") and names == [names[0], names[0] + ".manifest.json"]

    second = _compile(tmp_path, "machine-b", uri)
    assert second["restored"] > 0, second
    assert second["hits"] >= 1 and second["misses"] == 0, f"compiled again instead of reading the cache: {second}"
    assert not second["saved"], "nothing new was compiled: nothing to upload"


def _cache(tmp_path, machine: str, monkeypatch, key: str = KEY) -> CompileCache:
    for env in COMPILER_ENVS.values():
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("GRPO_COMPILE_CACHE_DIR", str(tmp_path / machine))
    spec = StorageSpec(uri=f"file://{tmp_path / 'bucket'}")
    return CompileCache.for_run(spec, Storage(spec), f"{spec.uri}/job", bytes.fromhex(key), "trainer", model="tiny")


def _kernel(tmp_path, machine: str, name: str = "kernel.cubin", data: bytes = b"cubin"):
    kernel = tmp_path / machine / "trainer" / "triton" / "ab" / name
    kernel.parent.mkdir(parents=True, exist_ok=True)
    kernel.write_bytes(data)
    return kernel


def test_processes_of_one_machine_unpack_once_and_never_rewrite_a_file(tmp_path, monkeypatch):
    writer = _cache(tmp_path, "writer", monkeypatch)
    kernel = _kernel(tmp_path, "writer")
    (kernel.parent / "kernel.cubin.tmp").write_bytes(b"half written")
    assert writer.save_if_grown() and not writer.save_if_grown()

    first = _cache(tmp_path, "reader", monkeypatch)
    assert first.restore() == 1                   # the .tmp file being written was not archived
    unpacked = tmp_path / "reader" / "trainer" / "triton" / "ab" / "kernel.cubin"
    assert unpacked.read_bytes() == b"cubin"
    unpacked.write_bytes(b"inuse")               # e.g. a kernel another process has open (same size)
    os.remove(writer.storage.resolve(writer.uri)[1])
    second = _cache(tmp_path, "reader", monkeypatch)
    assert second.restore() == 1, "the machine's second process reads the first's marker, not the bucket"
    assert unpacked.read_bytes() == b"inuse"
    assert not second.save_if_grown()


def _tar(**members: bytes) -> bytes:
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sink.getvalue()


def test_an_archive_not_signed_with_the_jobs_key_is_never_unpacked(tmp_path, monkeypatch, caplog):
    """A cache is code the compilers load: whoever can write the job's storage must not plant any."""
    writer = _cache(tmp_path, "writer", monkeypatch)
    _kernel(tmp_path, "writer")
    assert writer.save_if_grown()
    storage, planted = writer.storage, _tar(**{"inductor/ab/payload.py": b"import os; os.system('boom')"})

    def restored(machine: str, key: str = KEY) -> int:
        n = _cache(tmp_path, machine, monkeypatch, key).restore()
        assert not list((tmp_path / machine).rglob("payload.py"))
        return n

    good = storage.read_bytes(writer.uri)
    storage.write_bytes(writer.uri, planted)              # the archive swapped, its manifest kept
    assert restored("m1") == 0
    assert "its bytes do not match the signed manifest" in caplog.text
    storage.write_bytes(writer.uri, good)
    assert restored("m2", key=signing.new_key()) == 0      # another job's key (or a forged manifest)
    assert "does not match this job's checkpoint key" in caplog.text
    storage.write_bytes(writer.manifest_uri, json.dumps({"files": {}}).encode())
    assert restored("m3") == 0
    assert "not signed; refusing to load the compile cache" in caplog.text
    # a signed archive whose member climbs out of the folder: tar's "data" filter stops it too
    escaping = _tar(**{"triton/../../../escaped.txt": b"bad"})
    storage.write_bytes(writer.uri, escaping)
    storage.write_bytes(writer.manifest_uri, signing.sign({"files": {writer.uri.rsplit("/", 1)[1]: {
        "size": len(escaping), "sha256": hashlib.sha256(escaping).hexdigest()}}}, bytes.fromhex(KEY)))
    assert restored("m4") == 0
    assert not list(tmp_path.rglob("escaped.txt"))

    rewriter = _cache(tmp_path, "m5", monkeypatch)
    _kernel(tmp_path, "m5", "other.cubin")
    assert rewriter.save_if_grown(), "a good archive replaces the bad one"
    assert restored("m6") == 1


@pytest.mark.parametrize("on", [True, False])
def test_turned_off_the_compilers_keep_their_defaults(on, tmp_path, monkeypatch):
    for env in COMPILER_ENVS.values():
        monkeypatch.delenv(env, raising=False)
    spec = StorageSpec(uri=f"file://{tmp_path}", compile_cache=on)
    cache = CompileCache.for_run(spec, Storage(spec), spec.uri, bytes(32), "trainer")
    assert (cache is not None) == on
    assert all(bool(os.environ.get(env)) == on for env in COMPILER_ENVS.values())
