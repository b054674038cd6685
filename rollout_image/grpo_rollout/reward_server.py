"""`grpo reward`: serve one of a job's reward models (spec.reward.rewardModels[]) over gRPC.

The rollout servers call Score after generation (grpo_rollout.reward_client). Token auth and TLS
are the rollout servers' (grpo_api.rpc): the same token, the same job certificate. The servicer
only translates protobuf to and from grpo_rollout.reward_models. Start-up and shutdown are the
launcher's (grpo_rollout.grpc_launcher): metrics and /ready first (503 while loading), then the
model, then gRPC, and one line on stdout when it listens,

    GRPO_REWARD_READY {"port": 50061, "metrics_port": 9401, "model": "skywork", "pid": 123, "tls": true}

SIGTERM/SIGINT: stop accepting calls, let running ones finish for `--grace` seconds.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

from grpo_api.contracts import REWARD_READY_PREFIX

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
    from grpo_api.proto import reward_pb2_grpc as pb_grpc
    from grpo_rollout.grpc_launcher import serve_grpc
    return serve_grpc(pb_grpc.add_RewardServicer_to_server, servicer, token, host=host, port=port, tls=tls,
                      max_workers=max_workers, log=log)


def _parser() -> argparse.ArgumentParser:
    from grpo_rollout.grpc_launcher import server_parser
    p = server_parser("grpo reward", "Serve one reward model of a GRPOJob (spec.reward.rewardModels[]) to its "
                      "rollout servers.", port=50061)
    p.add_argument("--model", required=True, help="the reward model's name (spec.reward.rewardModels[].name)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    return p


def main(argv: list[str]) -> int:
    from grpo_rollout.grpc_launcher import run_server
    return run_server("grpo reward", _parser().parse_args(argv), REWARD_READY_PREFIX, _start, log)


def _start(launch):
    from grpo_api.storage import check_local_model_path
    from grpo_rollout.grpc_launcher import Serving
    from grpo_rollout.reward_models import build_scorer
    from grpo_rollout.serve import _device
    job, args = launch.job, launch.args
    models = job.spec.reward.reward_models
    index = {m.name: i for i, m in enumerate(models)}
    if args.model not in index:
        raise ValueError(f"--model {args.model}: not in spec.reward.rewardModels (known: "
                         f"{', '.join(index) or 'none'})")
    spec = models[index[args.model]]
    metrics = RewardServerMetrics(job.metadata.name, job.metadata.namespace, spec.name)
    launch.serve_metrics(metrics.registry)
    check_local_model_path(spec.path, f"spec.reward.rewardModels[{index[spec.name]}].path")
    scorer = build_scorer(spec, device=_device(args.device))
    launch.on_close(scorer.close)
    server, port = start_server(RewardServicer(spec.name, scorer, metrics), launch.token, host=args.host,
                                port=args.port, tls=launch.tls)
    return Serving(server, port, f"reward server {spec.name} ({spec.kind}) listening on port {port}",
                   ready={"model": spec.name})
