"""Helpers of the integration tests (issues 6 and 7): real processes only (fixtures in conftest.py).

- GRPOJob files for the tiny model and the quickstart data (file:// storage under the test's tmp_path);
- `grpo rollout` servers as child processes (ready line on stdout, gRPC with the run's token);
- the trainer under torchrun (2 ranks on gloo), as the launcher and the operator start it;
- `grpo run` as a subprocess (GRPO_CACHE set by the caller, so builtin:// assets are built in
  a temp folder, not in the user's cache);
- /proc helpers: the process tree of a pid, and whether a pid is still alive.

Every child runs with OMP_NUM_THREADS=1: the tests share two CPU cores with other test runs.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

from polling import wait_until  # noqa: F401 - the integration and fault tests import it from here
from ports import free_port

READY_PREFIX = "GRPO_ROLLOUT_READY "  # grpo_rollout.serve's ready line (the wire contract)
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"


def grpo_cli() -> list[str]:
    exe = Path(sys.executable).parent / "grpo"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "grpo_api.cli"]


CHECKPOINT_KEY = secrets.token_hex(32)
"""The trainers' checkpoint key (GRPO_CHECKPOINT_KEY) in these tests: one per session, so a
resumed trainer has the key of the run it resumes, as a job's pods do."""


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "GRPO_CHECKPOINT_KEY": CHECKPOINT_KEY}
    env.update(extra)
    return env


# A reward with a signal on every step, even for the random-init policy: the share of "7"
# tokens in the response. Group rewards almost never tie, so advantages are non-zero from
# step 1 and the weights must move (the quickstart's GSM8K rule is mostly 0 at first).
REWARD_SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    words = solution_str.split()
    return sum(w == "7" for w in words) / max(1, len(words))
'''


def write_job(path: Path, *, name: str, model: Path, train: Path, storage: Path, val: Path | None = None,
              lora: dict | None = None, model_options: dict | None = None, **sections) -> Path:
    """A GRPOJob for CPU: tiny model, hf engine, file:// storage; `sections` are merged into spec;
    `lora`: spec.model.lora; `model_options`: merged into spec.model."""
    spec = {
        "model": {"path": str(model), "dtype": "float32", "gradientCheckpointing": False},
        "data": {"trainFiles": [str(train)], "valFiles": [str(val)] if val else [], "trainBatchSize": 4,
                 "maxPromptLength": 32, "maxResponseLength": 6},
        "algorithm": {"advEstimator": "grpo", "useKLLoss": True, "klLossCoef": 0.001},
        "reward": {"workers": 1, "timeoutSeconds": 10},
        "rollout": {"engine": "hf", "n": 4, "replicas": 2, "temperature": 1.0},
        "trainer": {"projectName": "it", "experimentName": name, "device": "cpu", "nprocPerNode": 2,
                    "miniBatchSize": 4, "microBatchSizePerGPU": 8, "lr": 1e-3, "totalSteps": 3,
                    "testFreq": -1, "saveFreq": -1, "valBeforeTrain": False, "loggers": ["console", "jsonl"]},
        "storage": {"uri": f"file://{storage}"},
        "weightSync": {"backend": "grpc"},
    }
    if lora is not None:
        spec["model"]["lora"] = lora
    spec["model"].update(model_options or {})
    for key, value in sections.items():
        spec.setdefault(key, {}).update(value)
    doc = {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": name}, "spec": spec}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_root(storage: Path, name: str) -> Path:
    """Where a job's files live under file:// storage (grpo_api.storage.job_root)."""
    return storage / "default" / name


# --- rollout servers ----------------------------------------------------------------------------

class RolloutServer:
    """`grpo rollout` as a child process on a loopback port (`port` 0: one it picks)."""

    def __init__(self, job_file: Path, log_path: Path, token: str, worker_id: str, timeout: float = 300.0,
                 port: int = 0, args: tuple[str, ...] = (), wait: bool = True):
        """args: more `grpo rollout` arguments (later ones win, e.g. --metrics-port 0).
        wait=False: returns once started (`address` is known when `port` is given); the trainer
        waits for its servers itself, `wait_ready()` is for the test."""
        self.token, self.log_path, self.worker_id = token, log_path, worker_id
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [*grpo_cli(), "rollout", "--spec", str(job_file), "--port", str(port), "--host", "127.0.0.1",
             "--metrics-port", "-1", "--worker-id", worker_id, "--device", "cpu", "--grace", "1", *args],
            stdout=subprocess.PIPE, stderr=self._log, env=child_env(GRPO_RPC_TOKEN=token), cwd=job_file.parent)
        self.info: dict = {}
        self._said_ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.address = f"127.0.0.1:{port}" if port else ""
        if wait:
            self.wait_ready(timeout)

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:      # to the end: the server never blocks on a full pipe
            text = line.decode(errors="replace")
            if not self.info and text.startswith(READY_PREFIX):
                self.info.update(json.loads(text[len(READY_PREFIX):]))
                self._said_ready.set()
        self._said_ready.set()             # exited without the ready line

    def wait_ready(self, timeout: float = 300.0) -> None:
        self._said_ready.wait(timeout)
        if not self.info:
            self.stop()
            raise RuntimeError(f"rollout server {self.worker_id} not ready: {self.log()}")
        self.address = f"127.0.0.1:{self.info['port']}"

    def stub(self):
        from grpo_api.rpc import rollout_stub
        return rollout_stub(self.address, self.token)

    def health(self):
        from grpo_api.proto import rollout_pb2 as pb
        return self.stub().Health(pb.HealthRequest(), timeout=10)

    def rpc_info(self):
        from grpo_api.proto import rollout_pb2 as pb
        return self.stub().Info(pb.InfoRequest(), timeout=10)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_rollout_servers(job_file: Path, token: str, count: int, log_dir: Path,
                          ready: bool = True) -> list[RolloutServer]:
    """`count` servers, started side by side (each takes seconds to load), all ready on return.
    ready=False: on ports picked here, returned at once, for a trainer started next to load its
    model while they load theirs (it waits for them, as in a job's pods)."""
    servers: list[RolloutServer] = []
    try:
        for i in range(count):
            servers.append(RolloutServer(job_file, log_dir / f"rollout-{i}.log", token, f"rollout-{i}",
                                         port=0 if ready else free_port(), wait=False))
        for server in servers if ready else ():
            server.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


# --- the trainer under torchrun -----------------------------------------------------------------

@dataclass
class TrainerResult:
    returncode: int
    output: str


def trainer_argv(job_file: Path, rollout: str, nproc: int, overrides: tuple[str, ...] = ()) -> list[str]:
    sets = [a for kv in overrides for a in ("--set", kv)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--no-python", *grpo_cli(), "trainer", "--spec", str(job_file), "--rollout", rollout, *sets]


def run_trainer(job_file: Path, *, rollout: str, token: str, nproc: int = 2, timeout: float = 600,
                log_path: Path | None = None, overrides: tuple[str, ...] = ()) -> TrainerResult:
    """`torchrun --standalone --nproc-per-node=N grpo trainer --spec JOB --rollout ADDRS`, to the end."""
    argv = trainer_argv(job_file, rollout, nproc, overrides)
    log_path = log_path or job_file.with_suffix(".trainer.log")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=child_env(GRPO_RPC_TOKEN=token),
                                cwd=job_file.parent, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"trainer timed out after {timeout}s:\n{log_path.read_text()[-6000:]}") from None
    return TrainerResult(code, log_path.read_text(errors="replace"))


# --- run artefacts ------------------------------------------------------------------------------

def read_metrics(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_step_tables(root: Path, kind: str, step: int, prefix: str = "train"):
    """The parquet shards of one step (`prompts` or `rollouts`), concatenated."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    files = sorted((root / kind / f"step-{step}").glob(f"{prefix}-*.parquet"))
    assert files, f"no {kind} shards for step {step} under {root}"
    return pa.concat_tables([pq.read_table(f) for f in files])


def load_safetensors(folder: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no safetensors in {folder}"
    return out


# --- processes ----------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of a live pid from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0]


def parent(pid: int) -> int | None:
    st = _stat(pid)
    return st[0] if st else None


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of `root` (not zombies)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[2] != "Z":
            children.setdefault(st[0], []).append(int(entry))
            starts[int(entry)] = st[1]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def alive(pid: int, start_time: int) -> bool:
    """The process `pid` started at `start_time` still runs (a reused pid does not count)."""
    st = _stat(pid)
    return st is not None and st[1] == start_time and st[2] != "Z"


def port_in_use(port: int) -> bool:
    """Whether something still listens on the port. SO_REUSEADDR, as servers (gRPC) set it: a
    killed server's connections linger in TIME_WAIT, which doesn't keep a new server out."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return True
    return False


# --- `grpo run` -----------------------------------------------------------------------------------

class LauncherRun:
    """`grpo run JOB --set ...` as a subprocess in its own cwd (outputs/ lands there)."""

    def __init__(self, job: Path, cwd: Path, cache: Path, overrides: list[str], log_name: str = "run.log"):
        self.cwd = cwd
        self.log_path = cwd / log_name
        self._out = open(self.log_path, "ab")
        sets = [a for kv in overrides for a in ("--set", kv)]
        self.proc = subprocess.Popen([*grpo_cli(), "run", str(job), *sets], cwd=cwd, stdout=self._out,
                                     stderr=subprocess.STDOUT, env=child_env(GRPO_CACHE=str(cache)),
                                     start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            raise AssertionError(f"grpo run timed out after {timeout}s:\n{self.log()[-6000:]}") from None
        finally:
            self._out.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill_tree(self) -> None:
        """Test clean-up only: SIGKILL everything under the launcher, then the launcher."""
        for pid in descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()


def run_grpo(job: Path, cwd: Path, cache: Path, overrides: list[str], timeout: float) -> tuple[int, str]:
    cwd.mkdir(parents=True, exist_ok=True)
    run = LauncherRun(job, cwd, cache, overrides)
    code = run.wait(timeout)
    return code, run.log()
