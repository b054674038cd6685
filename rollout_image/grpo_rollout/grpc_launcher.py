"""The one launcher of the rollout image's gRPC servers, as vLLM has one `serve_grpc`: `grpo rollout`
(serve.py), `grpo reward` (reward_server.py) and `grpo sandbox` (sandbox_server.py).

A server gives its parser's extra flags and a start function; the launcher owns what they share:
the job, the token and TLS from the environment; bad input (a spec, a flag, a model that can't be
loaded, a port that is taken) printed as `<prog>: <reason>` with exit code 2; the metrics endpoint,
started before anything loads so /ready answers 503 meanwhile; one line on stdout once it listens,

    GRPO_<KIND>_READY {"port": 50051, "metrics_port": 9400, <the server's own keys>, "pid": 123, "tls": true}

which is how a parent process (the local launcher, tests) learns the ports and that it's ready;
and SIGTERM/SIGINT: stop accepting calls, let running ones finish for `--grace` seconds, then
close what the server built, last built first. SIGUSR1 writes every thread's stack to the log.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from grpo_api.cli import exit_without_teardown
from grpo_api.contracts import BAD_INPUT_EXIT_CODE


def server_parser(prog: str, description: str, *, port: int, running: str = "calls") -> argparse.ArgumentParser:
    """The flags every server takes; the caller adds its own."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--spec", required=True, help="the GRPOJob YAML (as `grpo validate` accepts)")
    p.add_argument("--port", type=int, default=port, help=f"gRPC port; 0 picks a free one (default {port})")
    p.add_argument("--host", default="[::]", help="listen address of gRPC and of /metrics and /ready (default all "
                   "interfaces, as a pod needs; `grpo run` passes 127.0.0.1: this machine only)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="HTTP port of /metrics and /ready; 0 (default) picks a free one (the ready line "
                        "names it), -1 disables; pods set a fixed one for Prometheus and the readiness probe")
    p.add_argument("--grace", type=float, default=5.0, help=f"seconds running {running} get to finish on SIGTERM")
    return p


def serve_grpc(add_servicer: Callable[[Any, Any], None], servicer: Any, token: str, *, host: str, port: int,
               tls: Any, max_workers: int, log: logging.Logger, in_clear: str = "") -> tuple[Any, int]:
    """Start a gRPC server for `servicer` (`add_servicer` is the stub's add_*Servicer_to_server);
    returns it and the port it bound (port 0 picks a free one). Every RPC requires the token; with
    `tls` the port speaks only TLS (a plaintext client can't connect). `in_clear` ends the warning
    logged without TLS: what else crosses the network unencrypted."""
    import grpc

    from grpo_api.rpc import TLS_CERT_ENV, TLS_KEY_ENV, TokenAuthInterceptor, listen, server_options
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         interceptors=[TokenAuthInterceptor(token)], options=server_options())
    add_servicer(servicer, server)
    if tls is None:
        log.warning("serving without TLS (%s and %s are not set)" + in_clear, TLS_CERT_ENV, TLS_KEY_ENV)
    return server, listen(server, host, port, tls)


def http_host(grpc_host: str) -> str:
    """The HTTP server's address for gRPC's --host: every interface for gRPC's every interface, else the same."""
    return "0.0.0.0" if grpc_host in ("[::]", "::", "0.0.0.0", "") else grpc_host.strip("[]")


class Launch:
    """What a server's start function gets: its flags, the job, the token and TLS, and two hooks."""

    def __init__(self, args: argparse.Namespace, job: Any, token: str, tls: Any):
        self.args, self.job, self.token, self.tls = args, job, token, tls
        self.http = None
        self.listening = threading.Event()
        self._closing = contextlib.ExitStack()

    def serve_metrics(self, registry: Any, ready: Callable[[], bool] | None = None) -> None:
        """/metrics and /ready on --metrics-port (-1: none); ready() defaults to 'the gRPC server listens'."""
        from grpo_rollout.metrics import serve_http
        if self.args.metrics_port >= 0:
            self.http = serve_http(registry, self.args.metrics_port, ready=ready or self.listening.is_set,
                                   host=http_host(self.args.host))

    def on_close(self, close: Callable[[], None]) -> None:
        """Call `close` at exit, after the gRPC server stopped (the last registered runs first)."""
        self._closing.callback(close)

    def close(self) -> None:
        self._closing.close()
        if self.http is not None:
            self.http.shutdown()


@dataclass
class Serving:
    """What a start function returns once its gRPC server listens."""
    server: Any
    port: int
    message: str
    """Logged once the ready line is out."""
    ready: dict[str, Any] = field(default_factory=dict)
    """The server's own keys of the ready line."""
    log_stop: bool = False
    """Log that running calls get --grace seconds, once asked to stop."""


def run_server(prog: str, args: argparse.Namespace, ready_prefix: str, start: Callable[[Launch], Serving],
               log: logging.Logger) -> int:
    """Run a server until SIGTERM/SIGINT: the exit code (0, or 2 for bad input)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from grpo_api.jobfile import JobError, load_job
    from grpo_api.rpc import TLSError, TokenError, read_token, server_tls
    try:
        job = load_job(args.spec)
        token, tls = read_token(), server_tls()
    except (JobError, TokenError, TLSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    # The handler takes no lock: Python runs it in the main thread between two bytecodes, and
    # one that set a threading.Event there could wait forever on the Event's own lock, held by the
    # main thread's wait at that moment. The main thread polls instead.
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop.append(signum))
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: every thread's stack, in the log
    launch = Launch(args, job, token, tls)
    serving = None
    try:
        try:
            serving = start(launch)
        except (OSError, ValueError) as exc:   # a bad flag, the model can't be loaded, the port is taken...
            print(f"{prog}: {exc}", file=sys.stderr)
            return BAD_INPUT_EXIT_CODE
        launch.listening.set()
        info = {"port": serving.port, "metrics_port": launch.http.server_address[1] if launch.http else None,
                **serving.ready, "pid": os.getpid(), "tls": tls is not None}
        print(ready_prefix + json.dumps(info), flush=True)
        log.info("%s", serving.message)
        # Polled: Python runs a signal's handler in the main thread, and when the kernel hands the
        # signal to another thread (gRPC's, the reward pool's) an untimed wait never wakes to run it
        # (a SIGTERM from the launcher's death, in tests/faults, left a server up for good).
        while not stop:
            time.sleep(0.2)
        if serving.log_stop:
            log.info("stopping: letting running calls finish for %.0fs", args.grace)
    finally:
        if serving is not None:
            serving.server.stop(grace=args.grace).wait()
        launch.close()
    _abandon_running_threads(log)
    return 0


def _abandon_running_threads(log: logging.Logger, wait: float = 2.0) -> None:
    """A stopped server exits even when a call's thread is still blocked (its caller gone, e.g. a
    trainer killed with its launcher): Python would wait for it at exit, forever, and the pod for
    the kubelet's SIGKILL. Such threads are named, with where they wait, then the process ends."""
    import traceback
    deadline = time.monotonic() + wait
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not stuck:
        return
    frames = sys._current_frames()
    for thread in stuck:
        where = "".join(traceback.format_stack(frames[thread.ident])[-3:]) if thread.ident in frames else "?"
        log.warning("stopped with thread %s still running; abandoned at:\n%s", thread.name, where)
    exit_without_teardown(0)     # the log mirror's last copy still made, not the thread joins
