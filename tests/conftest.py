"""Shared fixtures. Tests that need a real server (Kubernetes control plane, S3) get it from a
session fixture; see tests/controlplane and tests/rollout."""

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ports import free_port


# --- the suite on two workers (scripts/test.sh: pytest -n 2 --dist loadscope) ------------------

RUN_FIRST = ("tests/e2e/", "tests/integration/", "tests/faults/", "tests/operator/", "tests/controlplane/",
             "tests/chart/", "tests/rollout/", "tests/api/", "tests/unit/")
"""Folders in the order their work is handed out: tests/e2e first, one unit on one worker (one
node; its pod starts and restarts beside the other worker's CPU runs); the many short modules of
tests/unit last, so both workers stay busy to the end."""


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the order in which units of work are handed out (--no-loadscope-reorder)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    def rank(item) -> int:
        return next((i for i, folder in enumerate(RUN_FIRST) if item.nodeid.startswith(folder)), len(RUN_FIRST))
    items.sort(key=rank)     # stable: each folder keeps its own order


def work_unit(nodeid: str) -> str:
    """Each module is one unit of work (its module fixtures, e.g. the local-run learning runs, are
    built once, by one worker); tests/e2e is one unit in all."""
    return "tests/e2e/" if nodeid.startswith("tests/e2e/") else nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope with work_unit as the scope. Not `--dist loadgroup` with xdist_group marks:
    xdist 3.8 tags the node ids by assigning `item._nodeid`, which pytest 9 no longer reads, so every
    test was a unit of its own and a module fixture was built on both workers (the tracker runs,
    twice 90 s)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)
    return ModuleScheduling(config, log)


# --- S3 (marker `s3`) -------------------------------------------------------------------------

def s3_binary() -> Path:
    cache = Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo-operator"))
    return cache / "bin" / "versitygw"


@dataclass(frozen=True)
class S3Server:
    endpoint: str          # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """What a pod gets from spec.storage.secretRef."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def filesystem(self, **options):
        """A pyarrow S3FileSystem on this server, as the test's own client."""
        import pyarrow.fs as pafs
        return pafs.S3FileSystem(access_key=self.access_key, secret_key=self.secret_key, region=self.region,
                                 endpoint_override=self.endpoint.removeprefix("http://"), scheme="http", **options)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (versitygw, posix backend) on loopback with one empty bucket.
    Built by scripts/build-s3.sh; without it the tests skip, unless GRPO_REQUIRE_S3 is set (CI):
    then it's an error."""
    binary = s3_binary()
    if not os.access(binary, os.X_OK):
        msg = f"{binary} not built; run scripts/build-s3.sh"
        if os.environ.get("GRPO_REQUIRE_S3"):
            pytest.fail(f"{msg} (GRPO_REQUIRE_S3 is set)", pytrace=False)
        pytest.skip(msg)
    root = tmp_path_factory.mktemp("s3")
    (root / "data").mkdir()
    (root / "iam").mkdir()
    port = free_port()
    server = S3Server(endpoint=f"http://127.0.0.1:{port}", access_key="grpo-test",
                      secret_key="grpo-test-secret-0123456789", bucket="grpo-runs")
    log = open(root / "versitygw.log", "wb")
    proc = subprocess.Popen(
        [str(binary), "--access", server.access_key, "--secret", server.secret_key, "--port", f"127.0.0.1:{port}",
         "--iam-dir", str(root / "iam"), "--quiet", "posix", str(root / "data")],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"versitygw exited with {proc.returncode}: {(root / 'versitygw.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("versitygw did not listen within 30s")
                time.sleep(0.1)
        server.filesystem(allow_bucket_creation=True).create_dir(server.bucket)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
