"""The colocated rollout servers of one trainer pod (`rollout.placement: colocated`, issue 46: verl's
hybrid engine): `grpo trainer --colocate ... --torchrun ...`, the pod's entry on Kubernetes and the
trainer process of `grpo run`, starts its node's `grpo rollout` servers before torchrun's ranks, one
per `tensorParallelSize` of the node's GPUs, on those GPUs (server i: local ranks i*tp..(i+1)*tp-1),
waits for each one's ready line, then runs torchrun. Trainer rank 0 reaches them, and the other
pods' servers, as it reaches a rollout Deployment's (the addresses come with `--rollout`).

A server that dies fails the pod: the supervisor stops torchrun's workers and exits 1, and the job's
restart policy resumes the run from its checkpoint (a server can't be restarted alone here: its GPU
memory is the trainer's too). A SIGTERM (the pod is stopped) while the servers load, or once
torchrun runs the ranks, exits STOPPED_EXIT_CODE, which uses no restart. The servers never get
the checkpoint key. They run `grpo rollout`
from this image: the image needs the rollout package's dependencies (and vLLM for engine vllm).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from grpo_api import signing
from grpo_api.contracts import ROLLOUT_READY_PREFIX, STOPPED_EXIT_CODE

SERVER_FAILED_EXIT = 1


def server_gpus(index: int, tensor_parallel_size: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of server `index`: the node's local ranks index*tp..(index+1)*tp-1,
    as the pod sees them (the entries of its own CUDA_VISIBLE_DEVICES when it has one)."""
    ranks = range(index * tensor_parallel_size, (index + 1) * tensor_parallel_size)
    devices = visible.split(",") if visible else [str(r) for r in ranks]
    return ",".join(devices[r] for r in ranks)


def server_argv(spec_path: str, port: int, worker_id: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "grpo_api.cli", "rollout", "--spec", spec_path, "--port", str(port),
            "--worker-id", worker_id, *extra]


class ColocatedServers:
    """This node's rollout servers: started, awaited and watched."""

    def __init__(self, spec_path: str, ports: list[int], *, tensor_parallel_size: int, gpus: bool,
                 node_rank: int, extra_args: list[str], metrics_ports: list[int] | None = None):
        self.spec_path, self.ports, self.tp, self.gpus = spec_path, ports, tensor_parallel_size, gpus
        self.node_rank, self.extra = node_rank, extra_args
        self.metrics_ports = metrics_ports    # each server's /metrics port; None: as extra_args say
        self.procs: list[subprocess.Popen] = []
        self.ready = [threading.Event() for _ in ports]
        self.failed: str | None = None

    def env(self, index: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != signing.KEY_ENV}   # servers never sign checkpoints
        env["PYTHONUNBUFFERED"] = "1"
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = server_gpus(index, self.tp, os.environ.get("CUDA_VISIBLE_DEVICES"))
        return env

    def start(self, timeout: float) -> None:
        for i, port in enumerate(self.ports):
            worker_id = f"trainer-{self.node_rank}-rollout-{i}"
            metrics = [f"--metrics-port={self.metrics_ports[i]}"] if self.metrics_ports else []
            proc = subprocess.Popen(server_argv(self.spec_path, port, worker_id, [*self.extra, *metrics]),
                                    env=self.env(i),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
            self.procs.append(proc)
            threading.Thread(target=self._forward, args=(i, worker_id, proc), daemon=True).start()
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            while not self.ready[i].wait(0.5):
                if proc.poll() is not None:
                    raise RuntimeError(f"colocated rollout server {i} (port {self.ports[i]}) exited with "
                                       f"{proc.returncode} before it was ready (its log is above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"colocated rollout server {i} not ready after {timeout:.0f}s")

    def _forward(self, index: int, worker_id: str, proc: subprocess.Popen) -> None:
        """The server's output into this pod's log, each line prefixed; its ready line sets ready."""
        for line in proc.stdout:
            if line.startswith(ROLLOUT_READY_PREFIX):
                self.ready[index].set()
            sys.stderr.write(f"[{worker_id}] {line}")

    def watch(self, on_failure) -> None:
        """Call `on_failure` once, from a thread, when a server exits while the trainer runs."""
        def loop():
            while self.failed is None:
                for i, proc in enumerate(self.procs):
                    if proc.poll() is not None and self.failed is None:
                        self.failed = (f"colocated rollout server {i} (port {self.ports[i]}) exited with "
                                       f"{proc.returncode}")
                        on_failure()
                time.sleep(0.5)
        threading.Thread(target=loop, daemon=True).start()

    def stop(self, grace: float = 10.0) -> None:
        self.failed = self.failed or "stopping"      # the watcher's deaths from here on are ours
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo trainer --colocate", description=(
        "Start this node's colocated rollout servers, then torchrun with the arguments after --torchrun "
        "(rollout.placement colocated)."))
    p.add_argument("--spec", required=True, help="the resolved GRPOJob YAML")
    p.add_argument("--ports", required=True, help="this node's servers' gRPC ports, comma-separated (one per server)")
    p.add_argument("--metrics-ports", default="",
                   help="this node's servers' /metrics ports, comma-separated (one per server; Prometheus scrapes "
                        "them on Kubernetes); default none")
    p.add_argument("--node-rank", type=int, default=int(os.environ.get("JOB_COMPLETION_INDEX", "0")),
                   help="this node's rank, for the servers' worker ids (default $JOB_COMPLETION_INDEX, else 0)")
    p.add_argument("--rollout-arg", action="append", default=[], metavar="ARG",
                   help="an argument passed on to every `grpo rollout` (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to load")
    return p


class _Stopped(Exception):
    """SIGTERM while the servers load (minutes, for vLLM): the pod is being stopped."""


def _raise_stopped(_signum, _frame) -> None:
    raise _Stopped


def run(argv: list[str], torchrun) -> int:
    """`argv`: our flags, `--torchrun`, torchrun's. `torchrun(args) -> exit code` runs the ranks."""
    from grpo_api.jobfile import load_job
    if "--torchrun" not in argv:
        raise SystemExit("grpo trainer --colocate: the torchrun arguments must follow --torchrun")
    cut = argv.index("--torchrun")
    args = parser().parse_args(argv[:cut])
    spec = load_job(args.spec).spec
    ports = [int(p) for p in args.ports.split(",")]
    if len(ports) != spec.servers_per_node:
        raise SystemExit(f"grpo trainer --colocate: {len(ports)} ports for {spec.servers_per_node} servers per node "
                         f"(nprocPerNode / tensorParallelSize)")
    metrics_ports = [int(p) for p in args.metrics_ports.split(",")] if args.metrics_ports else None
    if metrics_ports is not None and len(metrics_ports) != len(ports):
        raise SystemExit(f"grpo trainer --colocate: --metrics-ports names {len(metrics_ports)} ports for "
                         f"{len(ports)} servers (one each)")
    servers = ColocatedServers(args.spec, ports, tensor_parallel_size=spec.rollout.tensor_parallel_size,
                               gpus=spec.trainer.device != "cpu", node_rank=args.node_rank,
                               extra_args=args.rollout_arg, metrics_ports=metrics_ports)
    try:
        signal.signal(signal.SIGTERM, _raise_stopped)     # while the servers load: a stop
        servers.start(args.ready_timeout)
        # torchrun's own handler from its workers' start; in its rendezvous a Python handler would
        # wait for the rendezvous to time out (a blocking call), so SIGTERM kills us there, as before.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # torchrun runs in this process: a SIGTERM stops its workers (they checkpoint), and a
        # server's death is turned into one.
        servers.watch(lambda: os.kill(os.getpid(), signal.SIGTERM))
        code = torchrun(argv[cut + 1:])
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return SERVER_FAILED_EXIT
    except _Stopped:
        print("trainer stopped by SIGTERM", file=sys.stderr)
        code = STOPPED_EXIT_CODE
    finally:
        failed = servers.failed
        servers.stop()
    if failed and failed != "stopping":
        print(f"error: {failed}: the trainer pod fails with it (the job's restart policy resumes the run)",
              file=sys.stderr)
        return SERVER_FAILED_EXIT
    return code
