"""Step 4 of docs/ARCHITECTURE.md §1: the new policy to every rollout server.

`WeightPublisher` owns the gather, the cache and the choice of path:
- gather: FSDP2 shards -> full tensors in the rollout dtype (collective on every rank), written
  by rank 0 into one flat buffer laid out as a single weight bucket (grpo_api.weights). The
  buffer is allocated once and is the cache: re-syncing a restarted server and the final export
  read it, and no second full copy of the weights exists at any time. On GPU it lives on the GPU.
- send: `cuda_ipc` when every server is on the trainer's own GPU (the servers copy straight
  out of the buffer; no bytes move through the host), else the backend `spec.weightSync`
  names (the collective, or gRPC).

Only torch, grpc and grpo_api (through weight_sync) are imported here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import torch
import torch.distributed as dist

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.rpc import ClientAuth
from grpo_api.spec import WeightSyncSpec
from grpo_api.weights import Bucket, TensorSpec, plan_buckets
from grpo_trainer.weight_sync import (CollectiveWeightSender, GrpcWeightSender, IpcWeightSender, WeightSender,
                                      WeightSyncError, cuda_device_uuid)

log = logging.getLogger("grpo.trainer.publisher")


def make_weight_sender(sync: WeightSyncSpec, *, auth: ClientAuth, device: torch.device) -> WeightSender:
    bucket = sync.bucket_size_mb << 20
    if sync.backend == "grpc":
        return GrpcWeightSender(auth, bucket_bytes=bucket, timeout_seconds=sync.timeout_seconds)
    # "nccl" means the collective path: NCCL between GPUs, gloo when either side is on CPU.
    return CollectiveWeightSender(auth, bucket_bytes=bucket, device=device, timeout_seconds=sync.timeout_seconds)


def rollout_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or DTensor) as the rollout engines load them: a tied tensor once, under
    its first name (the tied LM head is the embedding: engines load one and have both)."""
    out, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


class WeightPublisher:
    def __init__(self, model, sync: WeightSyncSpec, *, dtype: torch.dtype, device: torch.device, auth: ClientAuth,
                 workers: Callable[[], list[str]] | None, info: Callable[[str], pb.InfoReply] | None):
        """workers/info: rank 0's view of the rollout servers (None on the other ranks)."""
        self.model, self.device = model, device
        self.rank = dist.get_rank()
        dtype_name = str(dtype).removeprefix("torch.")
        specs = [TensorSpec(name, tuple(t.shape), dtype_name) for name, t in rollout_tensors(model)]
        self.layout: Bucket = plan_buckets(specs, bucket_size=1 << 62)[0]   # one bucket: the whole buffer
        self.buffer: torch.Tensor | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self._workers, self._info = workers, info
        self._colocated: dict[str, bool] = {}
        if self.rank == 0:
            self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=device)
            for placed in self.layout.tensors:
                view = self.buffer[placed.offset:placed.offset + placed.nbytes]
                self.weights[placed.spec.name] = view.view(dtype).reshape(placed.spec.shape)
            self.sender = make_weight_sender(sync, auth=auth, device=device)
            self.ipc = IpcWeightSender(auth, timeout_seconds=sync.timeout_seconds) if device.type == "cuda" else None
        self.gathered = False

    def gather(self) -> None:
        """Collective: every rank gathers; rank 0 writes the buffer."""
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            for name, tensor in rollout_tensors(self.model):
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if self.rank == 0:
                    self.weights[name].copy_(full.detach())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # readers in other processes see finished bytes
        self.gathered = True

    def _all_colocated(self, workers: list[str]) -> bool:
        if self.ipc is None:
            return False
        mine = cuda_device_uuid(self.device)
        for w in workers:
            if w not in self._colocated:
                self._colocated[w] = self._info(w).device_uuid == mine
        return all(self._colocated[w] for w in workers)

    def publish(self, version: int) -> dict[str, float]:
        """Collective. Gather, then (rank 0) send `version` to every server. A server that fails
        is logged, not fatal: it is re-synced before its next rollout (`resync`)."""
        t0 = time.perf_counter()
        self.gather()
        times = {"timing_s/weight_gather": time.perf_counter() - t0}
        if self.rank == 0:
            t1 = time.perf_counter()
            workers = self._workers()
            try:
                if self._all_colocated(workers):
                    self.ipc.send(workers, self.buffer, self.layout, version)
                else:
                    self.sender.send(workers, self.weights.items(), version)
            except (WeightSyncError, grpc.RpcError) as exc:
                self._colocated.clear()   # a replaced server may sit elsewhere: ask again
                log.warning("weight update to version %d did not reach every rollout worker (%s); "
                            "they are re-synced before their next rollout", version, exc)
            times["timing_s/weight_send"] = time.perf_counter() - t1
        return times

    def resync(self, worker: str, version: int) -> None:
        """Rank 0: bring one server that missed updates to `version` from the cache."""
        if not self.gathered:
            raise RuntimeError(f"worker {worker} needs weights, none gathered yet")
        self._colocated.pop(worker, None)
        if self._all_colocated([worker]):
            self.ipc.send([worker], self.buffer, self.layout, version)
        else:
            self.sender.resync(worker, self.weights.items(), version)

    def cpu_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: the cached weights as separate host tensors (for the Hugging Face export)."""
        return {name: t.to("cpu", copy=True) for name, t in self.weights.items()}

    def close(self) -> None:
        if self.rank == 0:
            self.sender.close()
            if self.ipc is not None:
                self.ipc.close()
