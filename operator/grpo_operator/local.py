"""The local launcher: `grpo run JOB.yaml` turns a GRPOJob into local processes instead of pods.

`rollout.replicas` rollout servers on loopback and a torchrun trainer with
`trainer.nprocPerNode` ranks, sharing `file://` storage (default ./outputs/<project>/<experiment>),
a fresh RPC token and TLS certificate (the rollout servers serve TLS on loopback; the trainer
trusts only this launch's CA), and the run's checkpoint key (`<run>/checkpoint.key`, 0600: the
trainer signs its checkpoints with it). The launcher supervises them: a rollout server that
dies is restarted on its port (the trainer re-dispatches its shard and re-syncs its weights);
Ctrl-C, SIGTERM or a trainer failure stops every child, so no process or port outlives the run.
The exit code is the trainer's (130 after Ctrl-C).

`grpo run --metrics` gives the trainer (rank 0) and each rollout server a fixed free Prometheus
port (a restarted server keeps its port), logs them and writes `<run>/metrics-targets.json`, a
Prometheus file_sd file. The series carry the job's `job` (metadata.name) and `namespace`
("default" here) labels, as the dashboards expect: scrape with `honor_labels: true`.

Only subprocesses here: the launcher never imports torch, the trainer or the rollout package.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pty
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_api import __version__
from grpo_api.contracts import (DIE_WITH_PARENT_ENV, REWARD_READY_PREFIX, ROLLOUT_READY_PREFIX,
                                SANDBOX_READY_PREFIX)
from grpo_api.jobfile import dump_job, load_job
from grpo_api.spec import GRPOJob

log = logging.getLogger("grpo.run")
BUILTIN = "builtin://"
CACHE = Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo-operator"))
MAX_ROLLOUT_RESTARTS = 5
LOOPBACK = "127.0.0.1"
"""Where every server of a local run listens, gRPC and /metrics alike: this machine only (the
sandbox runs the model's code; the servers' token is in the run folder)."""


def reserve_port(held: list[socket.socket]) -> int:
    """A loopback port for one of the run's servers, held in `held` (bound, not listening) until
    the run ends: no other process's bind(0) or outgoing connection is given it before the server
    binds it, or while the server restarts on it (a port picked and let go was taken in between
    once on a busy CI machine: "Failed to bind to address"). The servers bind with SO_REUSEADDR
    (gRPC and http.server do), which Linux allows beside a bound socket that does not listen."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    held.append(sock)
    return sock.getsockname()[1]


def _with_launcher(env: dict[str, str]) -> dict[str, str]:
    """A child's environment: its own session (so torchrun and its workers stop together) is
    Popen's start_new_session; SIGTERM when this launcher dies, even by SIGKILL, the child's `grpo`
    asks for itself (contracts.DIE_WITH_PARENT_ENV). Neither runs Python between fork and exec, so
    Popen can vfork: a fork of this process, whose gRPC channels are open, aborts in grpcio's
    fork handlers (grpc/grpc#43055: 'epoll_wait error: Bad file descriptor', signal 6)."""
    return {**env, DIE_WITH_PARENT_ENV: str(os.getpid())}


def grpo_command() -> list[str]:
    exe = shutil.which("grpo", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "grpo_api.cli"]


# --- builtin:// assets: the quickstart's tiny model and dataset, built on first use ----------

def resolve_builtin(job: GRPOJob) -> GRPOJob:
    """Replace builtin:// model and data paths by local folders, building them once (cached)."""
    spec = job.spec
    model_path = _builtin_model(spec.model.path) if spec.model.path.startswith(BUILTIN) else spec.model.path
    train = [_builtin_data(f) for f in spec.data.train_files]
    val = [_builtin_data(f) for f in spec.data.val_files]
    reward_models = [m.model_copy(update={"path": _builtin_model(m.path)}) if m.path.startswith(BUILTIN) else m
                     for m in spec.reward.reward_models]     # builtin://tiny-qwen3-rm: a tiny classifier
    return job.model_copy(update={"spec": spec.model_copy(update={
        "model": spec.model.model_copy(update={"path": model_path}),
        "data": spec.data.model_copy(update={"train_files": train, "val_files": val}),
        "reward": spec.reward.model_copy(update={"reward_models": reward_models})})})


def _builtin_model(uri: str) -> str:
    name = uri.removeprefix(BUILTIN)             # e.g. tiny-qwen3
    if not name.startswith("tiny-"):
        raise ValueError(f"spec.model.path: unknown builtin model {uri!r} (known: builtin://tiny-qwen3, "
                         f"builtin://tiny-qwen3-rm, builtin://tiny-qwen3-tools)")
    out = CACHE / "builtin" / __version__ / name   # versioned: a new release rebuilds its assets
    if not (out / "config.json").exists():
        log.info("Building the tiny model %s (first use)...", out)
        with _building(out) as tmp:
            subprocess.run([*grpo_command(), "model", "tiny", "--arch", name.removeprefix("tiny-"), "--out", str(tmp)],
                           check=True)
    return str(out)


@contextlib.contextmanager
def _building(out: Path):
    """A temp folder next to `out` that becomes `out` once the build succeeds: two runs building
    the same asset at once (or one killed mid-build) never leave a half-written folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)          # mkdtemp's 0700 would hide the cache from other users of GRPO_CACHE
    try:
        yield tmp
        try:
            tmp.rename(out)
        except OSError:       # another run finished first: a non-empty `out` is there, keep it
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _builtin_data(uri: str) -> str:
    if not uri.startswith(BUILTIN):
        return uri
    dataset, _, file = uri.removeprefix(BUILTIN).partition("/")
    out = CACHE / "builtin" / __version__ / "data" / dataset
    if not (out / file).exists():
        log.info("Generating the %s dataset in %s (first use)...", dataset, out)
        with _building(out) as tmp:
            subprocess.run([*grpo_command(), "data", dataset, "--out", str(tmp)], check=True)
    if not (out / file).exists():
        raise ValueError(f"spec.data: builtin dataset {dataset!r} has no file {file!r}")
    return str(out / file)


# --- processes -------------------------------------------------------------------------------

class LaunchError(RuntimeError):
    """A process of the run could not start; the message says which and why."""


def _printed(path: Path | None, prefix: str) -> bool:
    """A line of the child's log starts with `prefix`."""
    try:
        return any(line.startswith(prefix) for line in path.read_text(errors="replace").splitlines())
    except (OSError, AttributeError):
        return False


def _last_line(path: Path | None) -> str:
    """The last non-empty line of a child's log: its error, when it failed at start-up."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except (OSError, AttributeError):
        return "(no log)"
    return lines[-1].strip() if lines else "(empty log)"


def preflight(job: GRPOJob) -> None:
    """What can be checked on this machine before anything starts or is written: a local model
    folder and local dataset files exist, and every row of those is one the trainer takes (a bad
    row fails now, named, not after the servers have loaded the model); a model in object storage
    is fetched into the user's cache (once: the trainer and rollout processes then find it there)."""
    from grpo_api.dataset_rows import check_local_dataset
    from grpo_api.images import check_local_images
    from grpo_api.model_cache import local_model
    from grpo_api.storage import check_local_model_path
    spec = job.spec
    for field, files in (("trainFiles", spec.data.train_files), ("valFiles", spec.data.val_files)):
        for i, uri in enumerate(files):
            if "://" in uri and not uri.startswith("file://"):
                continue        # object storage: the trainer reads (and checks) it
            if not Path(uri.removeprefix("file://")).is_file():
                raise FileNotFoundError(f"spec.data.{field}[{i}]: {uri} not found")
            check_local_dataset(uri.removeprefix("file://"), spec.data, spec.reward)   # its warning: the trainer's
            check_local_images(uri.removeprefix("file://"), spec.data.image_key)   # an unreadable one: named
    model = local_model(spec.model, spec.storage, log=log.info)    # after the data: a fetch can take minutes
    check_local_model_path(model.path)
    if model.tokenizer_path:
        check_local_model_path(model.tokenizer_path, "spec.model.tokenizerPath")


def _run_secrets(root: Path):
    """A fresh RPC token and TLS certificate for this launch (loopback), and the run's checkpoint
    key (`<run>/checkpoint.key`, made once, so a re-run resumes). Returns the rollout servers'
    environment and the trainer's: the servers never get the checkpoint key, and
    nothing of the same names inherited from this shell is passed on."""
    from grpo_api import rpc, signing
    from grpo_operator.pki import make_job_tls
    token, tls = secrets.token_hex(16), make_job_tls("grpo-run", ["localhost"], ["127.0.0.1"])
    key = signing.key_file(root / signing.KEY_FILE, create=True)
    ours = {rpc.TOKEN_ENV, rpc.TOKEN_FILE_ENV, rpc.TLS_CA_ENV, rpc.TLS_SERVER_NAME_ENV, rpc.TLS_CERT_ENV,
            rpc.TLS_KEY_ENV, signing.KEY_ENV}
    base = {k: v for k, v in os.environ.items() if k not in ours}
    base.update({rpc.TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"})
    rollout_env = {**base, rpc.TLS_CERT_ENV: tls.cert, rpc.TLS_KEY_ENV: tls.key}
    trainer_env = {**base, rpc.TLS_CA_ENV: tls.ca_cert, rpc.TLS_SERVER_NAME_ENV: "localhost", signing.KEY_ENV: key}
    return rollout_env, trainer_env


class Relay:
    """Passes a child's output on to ours as it comes until `mute()`: after Ctrl-C the run's last
    line is the launcher's, not what the trainer says while it stops. On a terminal the child
    writes to a pseudo-terminal (its progress bar stays on: tqdm draws only on a tty)."""

    def __init__(self, sources: list[tuple[object, object]]):
        """`sources`: (a readable binary file of the child's output, the stream it goes to)."""
        self.muted = False
        self.threads = [threading.Thread(target=self._relay, args=source, daemon=True) for source in sources]
        for thread in self.threads:
            thread.start()

    def _relay(self, pipe, out) -> None:
        # a pipe line by line; a pseudo-terminal as it comes (a progress bar redraws with \r)
        read = pipe.read if isinstance(pipe, io.FileIO) else lambda _: pipe.readline()
        with pipe:
            while True:
                try:
                    chunk = read(65536)
                except OSError:        # EIO: every writer of the pseudo-terminal is gone
                    break
                if not chunk:
                    break
                if not self.muted:
                    out.buffer.write(chunk)
                    out.buffer.flush()

    def mute(self) -> None:
        self.muted = True

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0

    relay: Relay | None = None
    """Without a log file: the child's output, passed on to ours until the run is stopped."""

    def start(self, env: dict[str, str]) -> None:
        if self.log_path is None:
            self._start_relayed(env)
            return
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=_with_launcher(env), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def _start_relayed(self, env: dict[str, str]) -> None:
        if sys.stderr.isatty():
            terminal, child_side = pty.openpty()
            self.proc = subprocess.Popen(self.argv, env=_with_launcher(env), stdout=child_side, stderr=child_side,
                                         start_new_session=True)
            os.close(child_side)
            self.relay = Relay([(open(terminal, "rb", buffering=0), sys.stderr)])
        else:
            self.proc = subprocess.Popen(self.argv, env=_with_launcher(env), stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True)
            self.relay = Relay([(self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr)])

    def stop(self, grace: float = 10.0, wait: bool = True) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; wait=False: only the SIGTERM."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if not wait:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            return
        for sig, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(seconds)
                return
            except subprocess.TimeoutExpired:
                continue


class LocalRun:
    def __init__(self, job: GRPOJob, metrics: bool = False):
        from grpo_api.storage import job_root
        self.job = job
        root, trainer = job_root(job, local=True), job.spec.trainer
        # The run's own folder: on file:// storage the job's root; with s3:// storage the spec
        # and the process logs still live on this machine, in the local default folder.
        self.root = (Path(root.removeprefix("file://")) if root.startswith("file://") else
                     Path.cwd() / "outputs" / trainer.project_name / trainer.experiment_name)
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.spec_path = self.root / "job.yaml"
        self.spec_path.write_text(dump_job(job))
        self.rollout_env, self.trainer_env = _run_secrets(self.root)
        # colocated (issue 46): the trainer process runs its node's servers itself, beside the ranks
        self.colocated = job.spec.colocated
        self.held_ports: list[socket.socket] = []     # closed by stop_all
        self.rollout_ports = [self._reserve_port() for _ in range(job.spec.servers_per_node if self.colocated else
                                                           job.spec.rollout.replicas)]
        # Before the rollout servers, which call them: reward models (issue 31), the python sandbox (issue 32).
        self.dependencies = [*self._reward_servers(), *self._sandbox_servers()]
        # Prometheus ports (--metrics): the trainer's, one per rollout server. Without it the trainer
        # serves none and each rollout server picks any free port (0), as before.
        self.trainer_metrics_port = self._reserve_port() if metrics else None
        self.rollout_metrics_ports = [self._reserve_port() if metrics else 0 for _ in self.rollout_ports]
        grpo = grpo_command()
        client_args = [arg for name, ports in self.reward_ports.items()
                       for arg in ("--reward-model", f"{name}=" + ",".join(f"127.0.0.1:{p}" for p in ports))]
        if self.sandbox_ports:
            client_args += ["--sandbox", ",".join(f"127.0.0.1:{p}" for p in self.sandbox_ports)]
        self.rollouts = [
            Child(f"rollout-{i}", [*grpo, "rollout", "--spec", str(self.spec_path), "--host", LOOPBACK,
                                   "--port", str(port),
                                   "--metrics-port", str(mport), "--worker-id", f"rollout-{i}", *client_args],
                  self.logs / f"rollout-{i}.log")
            for i, (port, mport) in enumerate(zip(self.rollout_ports, self.rollout_metrics_ports))]
        addresses = ",".join(f"127.0.0.1:{p}" for p in self.rollout_ports)
        nproc = job.spec.trainer.nproc_per_node
        # torchrun in `grpo trainer --torchrun`: it exits with the failed rank's own code (2: bad input)
        # after that rank's `error:` line, without torchrun's report page
        torchrun = [*grpo, "trainer", "--torchrun"]
        if self.colocated:
            # `grpo trainer --colocate` starts the servers (each on its ranks' GPUs), then torchrun
            # in its own process; a server that dies fails the trainer, which is not restarted.
            torchrun = [*grpo, "trainer", "--colocate", "--spec", str(self.spec_path), "--ports",
                        ",".join(map(str, self.rollout_ports)), "--rollout-arg=--metrics-port=-1",
                        *(f"--rollout-arg={a}" for a in client_args), "--torchrun"]
            self.rollouts = []
            # the servers run in the trainer's process with the trainer's environment (less the
            # checkpoint key, which the supervisor drops): they need their certificate too
            self.trainer_env = {**self.trainer_env, **{k: self.rollout_env[k] for k in self.rollout_env
                                                      if k not in self.trainer_env}}
        self.trainer = Child("trainer", [
            *torchrun, "--standalone", f"--nproc-per-node={nproc}",
            "--no-python", *grpo, "trainer", "--spec", str(self.spec_path), "--rollout", addresses, "--run-locally",
            *(["--metrics-port", str(self.trainer_metrics_port)] if metrics else [])])
        if metrics:
            self._write_metrics_targets()

    def _reserve_port(self) -> int:
        return reserve_port(self.held_ports)

    def _reward_servers(self) -> list[tuple[Child, str]]:
        """`replicas` reward servers per spec.reward.rewardModels entry, on loopback with the run's
        token and certificate; the rollout servers reach them with the run's CA."""
        self.reward_ports: dict[str, list[int]] = {}
        servers = []
        for m in self.job.spec.reward.reward_models:
            self.reward_ports[m.name] = [self._reserve_port() for _ in range(m.replicas)]
            servers += [(Child(f"reward-{m.name}-{r}", [*grpo_command(), "reward", "--spec", str(self.spec_path),
                                                        "--model", m.name, "--host", LOOPBACK, "--port", str(port),
                                                        "--metrics-port", "-1"],
                               self.logs / f"reward-{m.name}-{r}.log"), REWARD_READY_PREFIX)
                        for r, port in enumerate(self.reward_ports[m.name])]
        self._trust_run_ca(servers)
        return servers

    def _sandbox_servers(self) -> list[tuple[Child, str]]:
        """spec.rollout.multiTurn.python.replicas sandbox servers (`grpo sandbox`, the python tool's
        programs), on loopback with the run's token and certificate."""
        self.sandbox_ports = [self._reserve_port() for _ in range(self.job.spec.rollout.multi_turn.sandbox_replicas(
            kubernetes=False))]
        servers = [(Child(f"sandbox-{r}", [*grpo_command(), "sandbox", "--spec", str(self.spec_path), "--host",
                                           LOOPBACK, "--port", str(port), "--metrics-port", "-1"],
                          self.logs / f"sandbox-{r}.log"),
                    SANDBOX_READY_PREFIX) for r, port in enumerate(self.sandbox_ports)]
        self._trust_run_ca(servers)
        return servers

    def _trust_run_ca(self, servers: list) -> None:
        """The rollout servers call these servers with the run's CA, as the trainer calls them."""
        from grpo_api import rpc
        if servers:
            self.rollout_env = {**self.rollout_env, rpc.TLS_CA_ENV: self.trainer_env[rpc.TLS_CA_ENV],
                                rpc.TLS_SERVER_NAME_ENV: "localhost"}

    @property
    def dependency_children(self) -> list[Child]:
        return [child for child, _ in self.dependencies]

    def _write_metrics_targets(self) -> None:
        """`<run>/metrics-targets.json`: Prometheus file_sd targets of the run's /metrics endpoints."""
        targets = [{"targets": [f"127.0.0.1:{self.trainer_metrics_port}"], "labels": {"component": "trainer"}}]
        targets += [{"targets": [f"127.0.0.1:{p}"], "labels": {"component": "rollout", "worker": c.name}}
                    for c, p in zip(self.rollouts, self.rollout_metrics_ports)]
        path = self.root / "metrics-targets.json"
        path.write_text(json.dumps(targets, indent=1) + "\n")
        log.info("Prometheus metrics: trainer on 127.0.0.1:%d, rollout servers on %s (file_sd targets: %s)",
                 self.trainer_metrics_port, ", ".join(f"127.0.0.1:{p}" for p in self.rollout_metrics_ports), path)

    @staticmethod
    def _wait_started(servers: list[tuple[Child, str]], timeout: float = 600.0, *,
                      unless_exited: Child | None = None) -> None:
        """Each server (a child and its ready line's prefix) has printed its ready line: it listens.
        One that exits before that could not start (a bad model, say): the run stops with the
        server's last line. One that exits after it is _supervise's to restart: the trainer may have
        stepped with it already (a Health poll here could still be backing off its first refused
        connection then). An `unless_exited` child that exits (the trainer) ends the wait too."""
        deadline = time.monotonic() + timeout
        for child, prefix in servers:
            while unless_exited is None or unless_exited.proc.poll() is None:
                exited = child.proc.poll() is not None
                if _printed(child.log_path, prefix):
                    break
                if exited:
                    raise LaunchError(f"{child.name} exited with {child.proc.returncode}: "
                                      f"{_last_line(child.log_path)} (full log: {child.log_path})")
                if time.monotonic() > deadline:
                    raise LaunchError(f"{child.name} not ready after {timeout:.0f}s; see {child.log_path}")
                time.sleep(0.5)

    def run(self) -> int:
        interrupted = []

        def on_signal(signum, _frame):
            interrupted.append(signum)
            raise KeyboardInterrupt

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            log.info("Run directory: %s", self.root)
            log.info("Launching %d rollout server(s)%s (%s engine, n=%d per prompt)...", len(self.rollout_ports),
                     " in the trainer process (colocated)" if self.colocated else "", self.job.spec.rollout.engine,
                     self.job.spec.rollout.n)
            for child in self.dependency_children:
                child.start(self.rollout_env)
            self._wait_started(self.dependencies)
            for child in self.rollouts:
                child.start(self.rollout_env)
            # The trainer starts beside its servers, as a job's pods do: its imports and model load
            # overlap theirs (~10 s of a CPU run's start), and it waits for them before step 1.
            self.trainer.start(self.trainer_env)
            # a trainer that exited is _supervise's
            self._wait_started([(c, ROLLOUT_READY_PREFIX) for c in self.rollouts], unless_exited=self.trainer)
            return self._supervise()
        except KeyboardInterrupt:
            if self.trainer.relay is not None:
                self.trainer.relay.mute()
            log.warning("Interrupted: stopping every process (re-run to resume from the last checkpoint)")
            return 130
        except LaunchError:
            if self.trainer.relay is not None:
                self.trainer.relay.mute()     # the last line says which server could not start
            raise
        finally:
            self.stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _supervise(self) -> int:
        while True:
            code = self.trainer.proc.poll()
            if code is not None:
                # The trainer said why it failed (its own `error:` line, or `grpo trainer
                # --torchrun`'s about a crashed rank): that stays the last line, its code ours.
                if self.trainer.relay is not None:
                    self.trainer.relay.join(timeout=30)   # to the end of its output: its ranks die with it
                if code < 0:       # torchrun itself killed
                    log.error("The trainer (torchrun, pid %d) was killed by signal %d", self.trainer.proc.pid, -code)
                    return 128 - code
                return code
            for child in [*self.dependency_children, *self.rollouts]:
                if child.proc.poll() is not None:
                    if child.restarts >= MAX_ROLLOUT_RESTARTS:
                        log.error("%s died %d times; stopping the run (see %s)", child.name, child.restarts,
                                  child.log_path)
                        return 1
                    child.restarts += 1
                    log.warning("%s exited with %s; restarting it (%d/%d)", child.name, child.proc.returncode,
                                child.restarts, MAX_ROLLOUT_RESTARTS)
                    child.start(self.rollout_env)
            time.sleep(0.5)

    def stop_all(self) -> None:
        self.trainer.stop()     # first: on Ctrl-C it finishes its step on the servers and checkpoints
        servers = [*self.rollouts, *self.dependency_children]
        for child in servers:   # then the servers, side by side (each takes ~1 s to exit)
            child.stop(wait=False)
        for child in servers:
            child.stop()
        for sock in self.held_ports:
            sock.close()


def run_job(path: str, overrides: list[str], metrics: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    job = resolve_builtin(load_job(path, overrides))
    preflight(job)
    return LocalRun(job, metrics=metrics).run()
