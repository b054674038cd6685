"""`grpo rollout`: start one rollout server for a job and run it until SIGTERM.

Start-up order: metrics endpoint (so /ready answers 503 while loading), reward workers (a bad
`spec.reward.function` fails here, before the model loads), engine, gRPC. When the server
listens it prints one line to stdout,

    GRPO_ROLLOUT_READY {"port": 50051, "metrics_port": 9400, "worker_id": "...", "pid": 123, "tls": true}

which is how a parent process (the local launcher, tests) learns the ports and that it's ready.
On SIGTERM/SIGINT it stops accepting calls, lets running ones finish for `--grace` seconds,
then stops the weight receiver, the engine and the reward workers. The launcher
(grpo_rollout.grpc_launcher) does all but building the worker, as for the reward and sandbox servers.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from grpo_api.contracts import ROLLOUT_READY_PREFIX

log = logging.getLogger("grpo_rollout")


def _parser() -> argparse.ArgumentParser:
    from grpo_rollout.grpc_launcher import server_parser
    p = server_parser("grpo rollout", "Run a rollout server (generation + rewards) for a GRPOJob.", port=50051)
    p.add_argument("--worker-id", default=None, help="name in logs, metrics and rollout rows (default: host name)")
    p.add_argument("--device", default="auto", help="hf engine device: auto, cpu, cuda, cuda:N (default auto)")
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
    from grpo_rollout.grpc_launcher import run_server
    return run_server("grpo rollout", _parser().parse_args(argv), ROLLOUT_READY_PREFIX, _start, log)


def _start(launch):
    from grpo_api.model_cache import local_model
    from grpo_api.storage import Storage, check_local_model_path
    from grpo_rollout.grpc_launcher import Serving
    from grpo_rollout.log_mirror import mirror_from_env
    from grpo_rollout.metrics import RolloutMetrics
    from grpo_rollout.rewards import RewardPool
    from grpo_rollout.server import RolloutServicer, start_server
    from grpo_rollout.worker import RolloutWorker

    args, job, spec = launch.args, launch.job, launch.job.spec
    mirror_from_env(Storage(spec.storage))     # the pod's log, kept in storage (closed at exit)
    worker_id = args.worker_id or os.environ.get("HOSTNAME") or socket.gethostname()
    metrics = RolloutMetrics(job.metadata.name, job.metadata.namespace, worker_id)
    built: dict = {}
    launch.serve_metrics(metrics.registry, ready=lambda: "worker" in built and built["worker"].health().ready)
    rewards = RewardPool(spec.reward.function, workers=spec.reward.workers, timeout_seconds=spec.reward.timeout_seconds,
                         kwargs=spec.reward.kwargs, concurrency=spec.reward.concurrency)
    launch.on_close(rewards.close)
    model = local_model(spec.model, spec.storage)       # a fetched model's cache folder
    check_local_model_path(model.path)
    if model.tokenizer_path:
        check_local_model_path(model.tokenizer_path, "spec.model.tokenizerPath")
    reward_models = _reward_models(args, spec, launch.token, metrics)
    sandbox = _sandbox(args, spec, launch.token)
    engine = build_engine(spec, model, device=_device(args.device))
    launch.on_close(engine.close)
    worker = RolloutWorker(spec=spec, engine=engine, rewards=rewards, storage=Storage(spec.storage),
                           worker_id=worker_id, metrics=metrics, reward_models=reward_models,
                           lora_adapters=args.lora_adapters, sandbox=sandbox)
    built["worker"] = worker
    launch.on_close(worker.weights.close)
    server, port = start_server(RolloutServicer(worker), launch.token, host=args.host, port=args.port, tls=launch.tls)
    return Serving(server, port, f"rollout server {worker_id} listening on port {port} (engine {spec.rollout.engine}, "
                   f"policy version {engine.policy_version})", ready={"worker_id": worker_id}, log_stop=True)


def _reward_models(args, spec, token, metrics):
    """Clients of the job's reward servers (issue 31), None without reward models. They speak TLS
    with the job's CA when GRPO_TLS_CA is set, as the trainer does to us."""
    if not spec.reward.reward_models:
        return None
    from grpo_api.rpc import client_auth
    from grpo_api.contracts import REWARD_ADDRESSES_ENV, parse_reward_addresses
    from grpo_rollout.reward_client import RewardModels
    text = ";".join(args.reward_model) or os.environ.get(REWARD_ADDRESSES_ENV, "")
    auth = client_auth() if os.environ.get("GRPO_TLS_CA") else token
    return RewardModels(spec.reward.reward_models, parse_reward_addresses(text), auth, metrics)


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
                          enable_sleep_mode=spec.colocated, quantization=rollout.quantization,
                          kv_cache_dtype=rollout.kv_cache_dtype, **common)
    raise ValueError(f"spec.rollout.engine: unknown engine {rollout.engine!r}; known: hf, vllm")
