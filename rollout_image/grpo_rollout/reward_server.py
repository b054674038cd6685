"""`grpo reward`: serve one of a job's reward models (spec.reward.rewardModels[]) over gRPC.

The rollout servers call Score after generation (grpo_rollout.reward_client). Token auth and TLS
are the rollout servers' (grpo_api.rpc): the same token, the same job certificate. The servicer
only translates protobuf to and from grpo_rollout.reward_models. Start-up and shutdown follow
`grpo rollout`: metrics and /ready first (503 while loading), then the model, then gRPC, and one
line on stdout when it listens,

    GRPO_REWARD_READY {"port": 50061, "metrics_port": 9401, "model": "skywork", "pid": 123, "tls": true}

SIGTERM/SIGINT: stop accepting calls, let running ones finish for `--grace` seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

READY_PREFIX = "GRPO_REWARD_READY "

log = logging.getLogger("grpo_rollout.reward_server")


def items_from_proto(request) -> list:
    from grpo_rollout.reward_models import ScoreInput
    out = []
    for item in request.items:
        messages = [{"role": m.role, "content": m.content} for m in item.prompt_messages]
        if not messages:
            messages = [{"role": "user", "content": item.prompt_text}]
        out.append(ScoreInput(messages, item.response, item.ground_truth))
    return out


class RewardServicer:
    """Scores one batch at a time (the model is one): concurrent calls queue on a lock."""

    def __init__(self, name: str, scorer, metrics):
        self.name, self.scorer, self.metrics = name, scorer, metrics
        self._lock = threading.Lock()

    def Score(self, request, context):
        import grpc

        from grpo_api.proto import reward_pb2 as pb
        try:
            items = items_from_proto(request)
            started = time.monotonic()
            with self._lock:
                batch = self.scorer.score(items)
            seconds = time.monotonic() - started
        except ValueError as exc:
            self.metrics.done("INVALID_ARGUMENT", 0, 0.0, 0)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - logged, and INTERNAL to the caller
            log.exception("Score failed")
            self.metrics.done("INTERNAL", 0, 0.0, 0)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        self.metrics.done("ok", len(items), seconds, batch.unparsed)
        log.info("request %s: %d items, %d tokens in %.2fs", request.request_id, len(items), batch.tokens, seconds)
        return pb.ScoreReply(model=self.name, seconds=seconds, tokens=batch.tokens, scores=[
            pb.ItemScore(score=s.score, parsed=s.parsed, judge_output=s.judge_output) for s in batch.scores])

    def Health(self, request, context):
        from grpo_api.proto import reward_pb2 as pb
        return pb.RewardHealthReply(ready=True, status="ready", model=self.name, kind=self.scorer.kind)


class RewardServerMetrics:
    """`grpo_reward_server_*`: calls by outcome, items, unparsed judge answers, seconds per call."""

    def __init__(self, job: str, namespace: str, model: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        self.registry = CollectorRegistry()
        labels = dict(job=job, namespace=namespace, model=model)
        names = tuple(labels)
        self._calls = Counter("grpo_reward_server_calls", "Score calls by outcome.", names + ("outcome",),
                              registry=self.registry)
        self._items = Counter("grpo_reward_server_items", "Items scored.", names, registry=self.registry).labels(**labels)
        self._unparsed = Counter("grpo_reward_server_unparsed", "Judge answers without a score (scored 0).", names,
                                 registry=self.registry).labels(**labels)
        self._seconds = Histogram("grpo_reward_server_score_seconds", "Time to score one call's batch.", names,
                                  registry=self.registry).labels(**labels)
        self._labels = labels

    def done(self, outcome: str, items: int, seconds: float, unparsed: int) -> None:
        self._calls.labels(**self._labels, outcome=outcome).inc()
        if outcome == "ok":
            self._items.inc(items)
            self._unparsed.inc(unparsed)
            self._seconds.observe(seconds)


def start_server(servicer: RewardServicer, token: str, *, host: str = "[::]", port: int = 0, tls=None,
                 max_workers: int = 8):
    import grpc

    from grpo_api.proto import reward_pb2_grpc as pb_grpc
    from grpo_api.rpc import TLS_CERT_ENV, TLS_KEY_ENV, TokenAuthInterceptor, listen, server_options
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         interceptors=[TokenAuthInterceptor(token)], options=server_options())
    pb_grpc.add_RewardServicer_to_server(servicer, server)
    if tls is None:
        log.warning("serving without TLS (%s and %s are not set)", TLS_CERT_ENV, TLS_KEY_ENV)
    return server, listen(server, host, port, tls)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo reward", description="Serve one reward model of a GRPOJob "
                                "(spec.reward.rewardModels[]) to its rollout servers.")
    p.add_argument("--spec", required=True, help="the GRPOJob YAML")
    p.add_argument("--model", required=True, help="the reward model's name (spec.reward.rewardModels[].name)")
    p.add_argument("--port", type=int, default=50061, help="gRPC port; 0 picks a free one (default 50061)")
    p.add_argument("--host", default="[::]", help="gRPC listen address (default all interfaces)")
    p.add_argument("--metrics-port", type=int, default=0, help="HTTP /metrics and /ready; 0 picks one, -1 disables")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds running calls get to finish on SIGTERM")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from grpo_api.jobfile import JobError, load_job
    from grpo_api.rpc import TLSError, TokenError, read_token, server_tls
    try:
        job = load_job(args.spec)
        token, tls = read_token(), server_tls()
    except (JobError, TokenError, TLSError) as exc:
        print(f"grpo reward: {exc}", file=sys.stderr)
        return 2
    models = {m.name: m for m in job.spec.reward.reward_models}
    index = {m.name: i for i, m in enumerate(job.spec.reward.reward_models)}
    if args.model not in models:
        print(f"grpo reward: --model {args.model}: not in spec.reward.rewardModels (known: "
              f"{', '.join(models) or 'none'})", file=sys.stderr)
        return 2
    spec = models[args.model]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    from grpo_rollout.metrics import serve_http
    metrics = RewardServerMetrics(job.metadata.name, job.metadata.namespace, spec.name)
    loaded = threading.Event()
    http = serve_http(metrics.registry, args.metrics_port, ready=loaded.is_set) if args.metrics_port >= 0 else None
    scorer = server = None
    try:
        try:
            from grpo_api.storage import check_local_model_path
            from grpo_rollout.reward_models import build_scorer
            from grpo_rollout.serve import _device
            check_local_model_path(spec.path, f"spec.reward.rewardModels[{index[spec.name]}].path")
            scorer = build_scorer(spec, device=_device(args.device))
            server, port = start_server(RewardServicer(spec.name, scorer, metrics), token, host=args.host,
                                        port=args.port, tls=tls)
        except (OSError, ValueError) as exc:
            print(f"grpo reward: {exc}", file=sys.stderr)
            return 2
        loaded.set()
        info = {"port": port, "metrics_port": http.server_address[1] if http else None, "model": spec.name,
                "pid": os.getpid(), "tls": tls is not None}
        print(READY_PREFIX + json.dumps(info), flush=True)
        log.info("reward server %s (%s) listening on port %d", spec.name, spec.kind, port)
        stop.wait()
    finally:
        if server is not None:
            server.stop(grace=args.grace).wait()
        if scorer is not None:
            scorer.close()
        if http is not None:
            http.shutdown()
    return 0
