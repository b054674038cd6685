"""The gRPC face of a rollout server. The servicer only translates protobuf to and from the
domain (grpo_rollout.worker) and exceptions to status codes, as vLLM's grpc_server does:
ValueError -> INVALID_ARGUMENT, a missing file -> NOT_FOUND, a state conflict (wrong policy
version, weights being updated) -> FAILED_PRECONDITION, anything else -> INTERNAL, logged.
"""

from __future__ import annotations

import functools
import json
import logging

import grpc

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.proto import rollout_pb2_grpc as pb_grpc
from grpo_api.rpc import ServerTLS
from grpo_api.weights import bucket_from_proto, lora_from_proto
from grpo_rollout import cuda_ipc
from grpo_rollout.grpc_launcher import serve_grpc
from grpo_rollout.weights import CollectivePlan, WeightSyncConflict
from grpo_rollout.worker import GenerateJob, RolloutWorker, SamplingOverrides

log = logging.getLogger(__name__)


def _status_for(exc: Exception) -> grpc.StatusCode | None:
    from grpo_rollout.reward_client import RewardModelUnavailable
    if isinstance(exc, RewardModelUnavailable):   # the trainer waits and re-dispatches the shard
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, WeightSyncConflict):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, FileNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


def _translating_errors(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:
            code = _status_for(exc)
            if code is None:
                log.exception("%s failed", method.__name__)
                code = grpc.StatusCode.INTERNAL
            if method.__name__ == "Generate":
                self.worker.metrics.request_done(code.name)
            context.abort(code, f"{type(exc).__name__}: {exc}" if code == grpc.StatusCode.INTERNAL else str(exc))
    return wrapper


def job_from_proto(req: pb.GenerateRequest) -> GenerateJob:
    s = req.sampling
    sampling = SamplingOverrides(
        n=s.n or None,
        max_tokens=s.max_tokens or None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
    )
    if not req.prompt_uri or not req.output_uri:
        raise ValueError("prompt_uri and output_uri are required")
    return GenerateJob(request_id=req.request_id, prompt_uri=req.prompt_uri, output_uri=req.output_uri,
                       sampling=sampling, expected_policy_version=req.expected_policy_version, step=req.step,
                       shard=req.shard)


def plan_from_proto(plan: pb.WeightSyncPlan) -> CollectivePlan:
    ipc = None
    if plan.backend == "cuda_ipc":
        ipc = cuda_ipc.IpcBuffer.from_proto(plan.ipc)
        offsets = tuple(int(o) for o in plan.ipc.bucket_offsets)
        if len(offsets) != len(plan.buckets):
            raise ValueError(f"cuda_ipc plan: {len(offsets)} bucket offsets for {len(plan.buckets)} buckets")
    return CollectivePlan(
        version=plan.version, group_id=plan.group_id, master_addr=plan.master_addr, master_port=plan.master_port,
        world_size=plan.world_size, rank=plan.rank, backend=plan.backend,
        buckets=tuple(bucket_from_proto(i, b) for i, b in enumerate(plan.buckets)),
        timeout_seconds=plan.timeout_seconds or 600.0, ipc=ipc,
        ipc_bucket_offsets=tuple(plan.ipc.bucket_offsets) if ipc else (), lora=lora_from_proto(plan))


class RolloutServicer(pb_grpc.RolloutServicer):
    def __init__(self, worker: RolloutWorker):
        self.worker = worker

    @_translating_errors
    def Generate(self, request, context):
        r = self.worker.generate(job_from_proto(request))
        self.worker.metrics.request_done("ok")
        return pb.GenerateReply(rollout_uri=r.rollout_uri, num_prompts=r.num_prompts, num_samples=r.num_samples,
                                policy_version=r.policy_version, generated_tokens=r.generated_tokens,
                                generate_seconds=r.generate_seconds, reward_seconds=r.reward_seconds,
                                reward_errors=r.reward_errors)

    @_translating_errors
    def UpdateWeights(self, request_iterator, context):
        self.worker.wake_up(["weights"])    # a sleeping engine takes weights once they are awake
        r = self.worker.weights.receive_stream(request_iterator)
        return pb.UpdateWeightsReply(version=r.version, committed=r.committed, rejected_buckets=r.rejected,
                                     accepted_buckets=r.accepted, bytes=r.nbytes, seconds=r.seconds)

    @_translating_errors
    def PrepareWeightSync(self, request, context):
        self.worker.wake_up(["weights"])
        self.worker.weights.prepare_collective(plan_from_proto(request))
        return pb.PrepareWeightSyncReply(ready=True)

    @_translating_errors
    def Health(self, request, context):
        h = self.worker.health()
        return pb.HealthReply(ready=h.ready, policy_version=h.policy_version, status=h.status,
                              weight_sync_error=h.weight_sync_error, weight_sync_version=h.weight_sync_version)

    @_translating_errors
    def Info(self, request, context):
        i = self.worker.info()
        return pb.InfoReply(worker_id=self.worker.worker_id, model=i.model, engine=i.engine,
                            policy_version=self.worker.weights.version, capacity=i.capacity,
                            num_parameters=i.num_parameters, device=i.device,
                            device_uuid=cuda_ipc.device_uuid(self.worker.engine.device),
                            accepts_lora_adapters=self.worker.weights.accepts_lora_adapters,
                            tool_schemas_json=json.dumps(schemas) if (schemas := self.worker.tool_schemas()) else "")


    @_translating_errors
    def Sleep(self, request, context):
        seconds, dropped = self.worker.sleep(request.level)
        return pb.SleepReply(seconds=seconds, weights_dropped=dropped, policy_version=self.worker.weights.version)

    @_translating_errors
    def WakeUp(self, request, context):
        return pb.WakeUpReply(seconds=self.worker.wake_up(list(request.parts) or None), policy_version=self.worker.weights.version)


def start_server(servicer: RolloutServicer, token: str, *, host: str = "[::]", port: int = 0,
                 max_workers: int = 16, tls: ServerTLS | None = None) -> tuple[grpc.Server, int]:
    """Start serving; returns the server and the port it bound (port 0 picks a free one).
    Every RPC requires the token; with `tls` the port speaks only TLS (a plaintext client
    can't connect)."""
    return serve_grpc(pb_grpc.add_RolloutServicer_to_server, servicer, token, host=host, port=port, tls=tls,
                      max_workers=max_workers, log=log, in_clear=": the token and the weights cross the network in clear")
