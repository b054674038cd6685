"""Helpers of the fault-injection tests (issue 12): real processes only.

- a reward function that can be told, from the test, to hold one rollout server in the middle of
  a Generate call (after its N-th reward call), so a kill lands at a known point of the run;
- a versitygw S3 server the test can stop and start again on the same port and data;
- a writer SIGKILLed in the middle of writing a large object;
- the accepted rollout shards of a step, killing a process tree, reading a run's step tables.

The process helpers (rollout servers, the trainer under torchrun, `grpo run`) are the
integration tests' (tests/integration/integration_helpers.py); conftest.py puts that folder on
sys.path.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from integration_helpers import child_env, descendants, wait_until

# --- a reward that holds a server mid-Generate on the test's cue ----------------------------------

# The share of "7" tokens (a signal on every step, as the integration tests' reward), plus a hold:
# while CONTROL/hold.json exists and names this reward worker's rollout server (its parent pid),
# the call after the first `after` calls of this worker writes CONTROL/holding-<server pid> and
# waits until hold.json is removed. The reward runs inside the server's Generate call, after
# generation and before the rollout shard is written: a server held there is mid-request.
HOLD_REWARD = '''
import json, os, time
from pathlib import Path

CONTROL = Path({control!r})
_calls = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global _calls
    _calls += 1
    hold = CONTROL / "hold.json"
    try:
        rule = json.loads(hold.read_text())
    except (OSError, ValueError):
        rule = None
    if rule and rule["pid"] == os.getppid() and _calls > rule["after"]:
        (CONTROL / f"holding-{{os.getppid()}}").write_text(str(_calls))
        while hold.exists():
            time.sleep(0.05)
    words = solution_str.split()
    return sum(w == "7" for w in words) / max(1, len(words))
'''


class Hold:
    """The test's side of HOLD_REWARD. Servers must run with reward.workers=1 and a reward
    timeout longer than any hold (the per-worker call count must not restart)."""

    def __init__(self, folder: Path):
        self.control = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.reward_file = folder / "hold_reward.py"
        self.reward_file.write_text(HOLD_REWARD.format(control=str(folder)))

    @property
    def function(self) -> str:
        """spec.reward.function"""
        return f"{self.reward_file}:compute_score"

    def arm(self, server_pid: int, after: int) -> None:
        """Hold the server at its reward call number `after + 1`."""
        (self.control / f"holding-{server_pid}").unlink(missing_ok=True)
        (self.control / "hold.json").write_text(json.dumps({"pid": server_pid, "after": after}))

    def wait_holding(self, server_pid: int, timeout: float, also=lambda: False) -> int:
        """Wait until the server is held; returns its reward call count. `also` ends the wait
        early (e.g. the trainer exited): then it fails."""
        marker = self.control / f"holding-{server_pid}"
        wait_until(lambda: marker.exists() or also(), timeout, interval=0.05, what=f"server {server_pid} held")
        assert marker.exists(), "the run ended before the server was held"
        return int(marker.read_text())

    def release(self) -> None:
        (self.control / "hold.json").unlink(missing_ok=True)


# --- processes ----------------------------------------------------------------------------------

def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and every descendant (torchrun starts its ranks in their own process
    groups, and a rollout server its reward workers): nothing is left to finish its work."""
    victims = [pid, *descendants(pid)]
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


@contextlib.contextmanager
def paused(pid: int):
    """SIGSTOP `pid` and its descendants for the duration (then SIGCONT)."""
    pids = [pid, *descendants(pid)]
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


def trainer_log_tail(path: Path, chars: int = 8000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no trainer log)"


# --- a writer SIGKILLed mid-write ---------------------------------------------------------------

WRITER = """
import os, sys
from grpo_api.spec import StorageSpec
from grpo_api.storage import Storage
uri, size = sys.argv[1], int(sys.argv[2])
storage = Storage(StorageSpec(endpoint=os.environ.get("S3_ENDPOINT") or None))
version = 0
while True:
    version += 1
    storage.write_bytes(uri, bytes([version % 251]) * size)
    print(version, flush=True)
"""


def kill_writer_mid_write(uri: str, size: int, env: dict[str, str]) -> int:
    """Start a process that rewrites `uri` again and again; SIGKILL it halfway through a write
    (timed from the previous ones). Returns the last version it reported complete."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, uri, str(size)], stdout=subprocess.PIPE,
                            env=child_env(**env), text=True)
    try:
        stamps = []
        for line in proc.stdout:
            stamps.append((int(line), time.monotonic()))
            if len(stamps) == 3:
                break
        assert len(stamps) == 3, f"the writer exited with {proc.wait()}"
        period = (stamps[-1][1] - stamps[0][1]) / 2
        time.sleep(period / 2)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    # on a loaded machine writes may finish during the sleep: the last version it reported counts
    reported = [int(line) for line in proc.stdout.read().split()]
    return max([stamps[-1][0], *reported])



def kill_writer_leaving(uri: str, size: int, env: dict[str, str], leftover, tries: int = 20) -> None:
    """Start the writer of kill_writer_mid_write; once it wrote `uri` whole at least once, SIGKILL
    it as soon as `leftover()` (what a write under way shows: a temporary file, an incomplete
    upload) is true. Again, if the kill came just after that write ended, until it is left."""
    for _ in range(tries):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, uri, str(size)], stdout=subprocess.PIPE,
                                env=child_env(**env), text=True)
        try:
            assert proc.stdout.readline(), f"the writer exited with {proc.wait()}"
            wait_until(leftover, 60, interval=0.002, what="a write under way")
        finally:
            kill_tree(proc.pid)
            proc.wait()
        if leftover():
            return
    raise AssertionError(f"no kill of the writer of {uri} left anything in {tries} tries")

# --- run artefacts ------------------------------------------------------------------------------

_ATTEMPT = re.compile(r"^(?P<shard>.+)-attempt-(?P<attempt>\d+)\.parquet$")


def accepted_shards(root: Path, step: int, tag: str = "train") -> dict[str, Path]:
    """{shard: file} of the rollout shards the trainer accepted at `step`: for each shard, its
    last attempt (the dispatcher tries a shard again only after the previous attempt failed;
    a failed attempt may still have written its file late)."""
    best: dict[str, tuple[int, Path]] = {}
    for f in (root / "rollouts" / f"step-{step}").glob(f"{tag}-*.parquet"):
        m = _ATTEMPT.match(f.name)
        assert m, f"unexpected rollout file {f}"
        attempt = int(m["attempt"])
        if m["shard"] not in best or attempt > best[m["shard"]][0]:
            best[m["shard"]] = (attempt, f)
    return {shard: f for shard, (_, f) in sorted(best.items())}


def attempts(root: Path, step: int, tag: str = "train") -> dict[str, list[int]]:
    """{shard: sorted attempt numbers with a file} of one step."""
    out: dict[str, list[int]] = {}
    for f in (root / "rollouts" / f"step-{step}").glob(f"{tag}-*.parquet"):
        m = _ATTEMPT.match(f.name)
        out.setdefault(m["shard"], []).append(int(m["attempt"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def accepted_rollouts(root: Path, step: int) -> pa.Table:
    files = accepted_shards(root, step)
    assert files, f"no rollout shards at step {step} under {root}"
    return pa.concat_tables([pq.read_table(f) for f in files.values()])


def prompts_of(root: Path, step: int) -> pa.Table:
    files = sorted((root / "prompts" / f"step-{step}").glob("train-*.parquet"))
    assert files, f"no prompt shards at step {step} under {root}"
    return pa.concat_tables([pq.read_table(f) for f in files])


def assert_each_sample_once(rollouts: pa.Table, prompts: pa.Table, n: int) -> None:
    """Every (prompt_index, sample_index) of the step exactly once, for the prompt it names."""
    keys = Counter(zip(rollouts.column("prompt_index").to_pylist(), rollouts.column("sample_index").to_pylist()))
    expected = {(p, s) for p in prompts.column("prompt_index").to_pylist() for s in range(n)}
    dupes = {k: c for k, c in keys.items() if c > 1}
    assert not dupes, f"duplicated samples: {dupes}"
    assert set(keys) == expected, f"missing {sorted(expected - set(keys))}, unexpected {sorted(set(keys) - expected)}"
    uid_of = dict(zip(prompts.column("prompt_index").to_pylist(), prompts.column("uid").to_pylist()))
    for p, uid in zip(rollouts.column("prompt_index").to_pylist(), rollouts.column("uid").to_pylist()):
        assert uid_of[p] == uid, (p, uid, uid_of[p])


# --- an S3 server that can be stopped and started again -------------------------------------------

def versitygw_binary() -> Path:
    """Built by scripts/build-s3.sh (as tests/conftest.py's s3_server fixture uses it)."""
    cache = Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo-operator"))
    return cache / "bin" / "versitygw"


class S3Process:
    """versitygw (posix backend) on a fixed loopback port; stop() and start() keep the port and
    the data, as a restarted S3 endpoint would."""

    ACCESS = "grpo-faults"
    SECRET = "grpo-faults-SECRET-5f1d0c9e7a"      # recognisable: tests grep for it
    BUCKET = "grpo-faults"

    def __init__(self, root: Path):
        self.root = root
        (root / "data").mkdir(parents=True, exist_ok=True)
        (root / "iam").mkdir(exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.ACCESS, "AWS_SECRET_ACCESS_KEY": self.SECRET}

    def start(self, timeout: float = 30) -> "S3Process":
        self.starts += 1
        log = open(self.root / f"versitygw-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [str(versitygw_binary()), "--access", self.ACCESS, "--secret", self.SECRET, "--port",
             f"127.0.0.1:{self.port}", "--iam-dir", str(self.root / "iam"), "--quiet", "posix",
             str(self.root / "data")], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"versitygw exited with {self.proc.returncode}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "versitygw did not listen"
                time.sleep(0.05)
        if self.starts == 1:
            import pyarrow.fs as pafs
            pafs.S3FileSystem(access_key=self.ACCESS, secret_key=self.SECRET, region="us-east-1",
                              endpoint_override=f"127.0.0.1:{self.port}", scheme="http",
                              allow_bucket_creation=True).create_dir(self.BUCKET)
        return self

    def stop(self) -> None:
        """Gone at once (SIGKILL): connections drop, the port refuses."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def storage(self, **kwargs):
        from grpo_api.spec import StorageSpec
        from grpo_api.storage import Storage
        return Storage(StorageSpec(endpoint=self.endpoint, region="us-east-1"), env=self.env(), **kwargs)
