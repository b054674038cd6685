"""`grpo rollout`: start one rollout server for a job and run it until SIGTERM.

Start-up order: metrics endpoint (so /ready answers 503 while loading), reward workers (a bad
`spec.reward.function` fails here, before the model loads), engine, gRPC. When the server
listens it prints one line to stdout,

    GRPO_ROLLOUT_READY {"port": 50051, "metrics_port": 9400, "worker_id": "...", "pid": 123, "tls": true}

which is how a parent process (the local launcher, tests) learns the ports and that it's ready.
On SIGTERM/SIGINT it stops accepting calls, lets running ones finish for `--grace` seconds,
then stops the reward workers and the engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading

READY_PREFIX = "GRPO_ROLLOUT_READY "

log = logging.getLogger("grpo_rollout")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo rollout", description="Run a rollout server (generation + rewards) for a GRPOJob.")
    p.add_argument("--spec", required=True, help="the GRPOJob YAML (as `grpo validate` accepts)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (default 50051)")
    p.add_argument("--host", default="[::]", help="gRPC listen address (default all interfaces)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="HTTP port of /metrics and /ready; 0 (default) picks a free one (the ready line "
                        "names it), -1 disables; pods set a fixed one for Prometheus and the readiness probe")
    p.add_argument("--worker-id", default=None, help="name in logs, metrics and rollout rows (default: host name)")
    p.add_argument("--device", default="auto", help="hf engine device: auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds running calls get to finish on SIGTERM")
    p.add_argument("--reward-model", action="append", default=[], metavar="NAME=HOST:PORT[,HOST:PORT]",
                   help="servers of a reward model of spec.reward.rewardModels (repeatable; default: "
                        "$GRPO_REWARD_ADDRESSES, 'name=host:port,...;name2=...')")
    p.add_argument("--sandbox", action="append", default=[], metavar="HOST:PORT[,HOST:PORT]",
                   help="sandbox servers (`grpo sandbox`) the python tool runs its programs on (repeatable; "
                        "default: $GRPO_SANDBOX_ADDRESSES; none: in child processes of this server)")
    p.add_argument("--no-lora-adapters", dest="lora_adapters", action="store_false",
                   help="take a LoRA policy as merged weights, as vLLM does, not its adapters alone (the hf engine "
                        "then keeps no second copy of the adapted base weights; the trainer sends merged weights "
                        "to a server that says so in Info)")
    return p


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from grpo_api.jobfile import JobError, load_job
    from grpo_api.rpc import TLSError, TokenError, read_token, server_tls

    try:
        job = load_job(args.spec)
        token, tls = read_token(), server_tls()
    except (JobError, TokenError, TLSError) as exc:
        print(f"grpo rollout: {exc}", file=sys.stderr)
        return 2
    from grpo_api.storage import Storage
    from grpo_rollout.log_mirror import mirror_from_env
    mirror_from_env(Storage(job.spec.storage))     # the pod's log, kept in storage (closed at exit)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    from grpo_rollout.metrics import RolloutMetrics, serve_http

    spec = job.spec
    worker_id = args.worker_id or os.environ.get("HOSTNAME") or socket.gethostname()
    metrics = RolloutMetrics(job.metadata.name, job.metadata.namespace, worker_id)
    holder: dict = {}
    http = None
    if args.metrics_port >= 0:
        http = serve_http(metrics.registry, args.metrics_port, ready=lambda: "worker" in holder and holder["worker"].health().ready)

    from grpo_rollout.rewards import RewardPool
    try:
        rewards = RewardPool(spec.reward.function, workers=spec.reward.workers, timeout_seconds=spec.reward.timeout_seconds)
    except ValueError as exc:
        print(f"grpo rollout: {exc}", file=sys.stderr)
        return 2
    engine = server = None
    try:
        try:
            server, port = _start(args, job, spec, token, tls, worker_id, metrics, rewards, holder)
        except (OSError, ValueError) as exc:   # the model can't be loaded, the port is taken...
            print(f"grpo rollout: {exc}", file=sys.stderr)
            return 2
        engine = holder["worker"].engine
        info = {"port": port, "metrics_port": http.server_address[1] if http else None, "worker_id": worker_id,
                "pid": os.getpid(), "tls": tls is not None}
        print(READY_PREFIX + json.dumps(info), flush=True)
        log.info("rollout server %s listening on port %d (engine %s, policy version %d)", worker_id, port,
                 spec.rollout.engine, engine.policy_version)
        stop.wait()
        log.info("stopping: letting running calls finish for %.0fs", args.grace)
    finally:
        if server is not None:
            server.stop(grace=args.grace).wait()
        if "worker" in holder:
            holder["worker"].weights.close()
        rewards.close()
        if engine is not None:
            engine.close()
        if http is not None:
            http.shutdown()
    return 0


def _start(args, job, spec, token, tls, worker_id, metrics, rewards, holder):
    from grpo_api.model_cache import local_model
    from grpo_api.storage import Storage, check_local_model_path
    from grpo_rollout.server import RolloutServicer, start_server
    from grpo_rollout.worker import RolloutWorker

    model = local_model(spec.model, spec.storage)       # a fetched model's cache folder
    check_local_model_path(model.path)
    if model.tokenizer_path:
        check_local_model_path(model.tokenizer_path, "spec.model.tokenizerPath")
    reward_models = _reward_models(args, spec, token, metrics)
    sandbox = _sandbox(args, spec, token)
    engine = build_engine(spec, model, device=_device(args.device))
    try:
        worker = RolloutWorker(spec=spec, engine=engine, rewards=rewards, storage=Storage(spec.storage),
                               worker_id=worker_id, metrics=metrics, reward_models=reward_models,
                               lora_adapters=args.lora_adapters, sandbox=sandbox)
        holder["worker"] = worker
        return start_server(RolloutServicer(worker), token, host=args.host, port=args.port, tls=tls)
    except BaseException:
        engine.close()
        raise


def _reward_models(args, spec, token, metrics):
    """Clients of the job's reward servers (issue 31), None without reward models. They speak TLS
    with the job's CA when GRPO_TLS_CA is set, as the trainer does to us."""
    if not spec.reward.reward_models:
        return None
    from grpo_api.rpc import client_auth
    from grpo_rollout.reward_client import ADDRESSES_ENV, RewardModels, parse_addresses
    text = ";".join(args.reward_model) or os.environ.get(ADDRESSES_ENV, "")
    auth = client_auth() if os.environ.get("GRPO_TLS_CA") else token
    return RewardModels(spec.reward.reward_models, parse_addresses(text), auth, metrics)


def _sandbox(args, spec, token):
    """The client of the python tool's sandbox servers (issue 32), None when it runs here."""
    from grpo_rollout.tools.sandbox_client import SandboxClient, sandbox_addresses
    addresses = sandbox_addresses(args.sandbox)
    mt = spec.rollout.multi_turn
    if not addresses or not (mt.enable and "python" in mt.tools):
        return None
    from grpo_api.rpc import client_auth
    auth = client_auth() if os.environ.get("GRPO_TLS_CA") else token
    return SandboxClient(mt, addresses, auth)


def build_engine(spec, model, *, device: str):
    """The engine spec.rollout.engine names, for `model` (the spec's model, as fetched). Each
    engine module is imported only when chosen (vllm is large), and here, outside engine.py,
    which both import."""
    rollout = spec.rollout
    common = dict(dtype=model.dtype.value, seed=rollout.seed, tokenizer_path=model.tokenizer_path,
                  trust_remote_code=model.trust_remote_code)
    if rollout.engine == "hf":
        from grpo_rollout.hf_engine import HFEngine
        return HFEngine(model.path, device=device, **common)
    if rollout.engine == "vllm":
        from grpo_rollout.vllm_engine import VLLMEngine
        return VLLMEngine(model.path, tensor_parallel_size=rollout.tensor_parallel_size,
                          gpu_memory_utilization=rollout.gpu_memory_utilization, max_model_len=spec.total_length,
                          enforce_eager=rollout.enforce_eager, max_num_batched_tokens=rollout.max_num_batched_tokens,
                          **common)
    raise ValueError(f"spec.rollout.engine: unknown engine {rollout.engine!r}; known: hf, vllm")
