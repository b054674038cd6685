"""Step 4 of docs/ARCHITECTURE.md §1: the new policy to every rollout server.

`WeightPublisher` owns the gather, the cache and the choice of path:
- gather: FSDP2 shards -> full tensors in the rollout dtype (collective on every rank), written
  by rank 0 into one flat buffer laid out as a single weight bucket (grpo_api.weights). The
  buffer is allocated once and is the cache: re-syncing a restarted server and the final export
  read it, and no second full copy of the weights exists at any time. On GPU it lives on the GPU.
- send: `cuda_ipc` when every server is on the trainer's own GPU (the servers copy straight
  out of the buffer; no bytes move through the host), else the backend `spec.weightSync`
  names (the collective, or gRPC).

It also keeps every server at the current version: `ensure_version` (before a server
generates: the dispatcher calls it) re-syncs one that missed updates from the cache, and
`catch_up` (at the start) publishes when a server holds other weights than the policy.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc
import torch
import torch.distributed as dist

from grpo_api.rpc import RolloutClients
from grpo_api.spec import WeightSyncSpec
from grpo_api.weights import Bucket, TensorSpec, plan_buckets
from grpo_trainer import lora
from grpo_trainer.collectives import broadcast_json
from grpo_trainer.weight_sync import (CollectiveWeightSender, GrpcWeightSender, IpcWeightSender, WeightSender,
                                      WeightSyncError, cuda_device_uuid)

if TYPE_CHECKING:
    from grpo_trainer.rollout_client import RolloutServers

log = logging.getLogger("grpo.trainer.publisher")


def make_weight_sender(sync: WeightSyncSpec, *, clients: RolloutClients, device: torch.device) -> WeightSender:
    bucket = sync.bucket_size_mb << 20
    if sync.backend == "grpc":
        return GrpcWeightSender(clients, bucket_bytes=bucket, timeout_seconds=sync.timeout_seconds)
    # "nccl" means the collective path: NCCL between GPUs, gloo when either side is on CPU.
    return CollectiveWeightSender(clients, bucket_bytes=bucket, device=device, timeout_seconds=sync.timeout_seconds)


def rollout_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or DTensor) as the rollout engines load them: a tied tensor once, under
    its first name (the tied LM head is the embedding: engines load one and have both). A LoRA
    policy's are its base tensors under the base model's names; `gather` merges the adapters in."""
    if lora.is_lora(model):
        return [(name, tensor) for name, tensor, _ in lora.rollout_entries(model)]
    out, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


class WeightPublisher:
    def __init__(self, model, sync: WeightSyncSpec, *, dtype: torch.dtype, device: torch.device,
                 servers: RolloutServers | None):
        """servers: rank 0's view of the rollout servers (None on the other ranks, and where
        nothing is sent: the weights are only gathered)."""
        self.model, self.device, self.servers = model, device, servers
        self.rank = dist.get_rank()
        dtype_name = str(dtype).removeprefix("torch.")
        specs = [TensorSpec(name, tuple(t.shape), dtype_name) for name, t in rollout_tensors(model)]
        self.layout: Bucket = plan_buckets(specs, bucket_size=1 << 62)[0]   # one bucket: the whole buffer
        self.buffer: torch.Tensor | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self._colocated: dict[str, bool] = {}
        if self.rank == 0:
            self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=device)
            for placed in self.layout.tensors:
                view = self.buffer[placed.offset:placed.offset + placed.nbytes]
                self.weights[placed.spec.name] = view.view(dtype).reshape(placed.spec.shape)
        if servers is not None:
            self.sender = make_weight_sender(sync, clients=servers.clients, device=device)
            self.ipc = (IpcWeightSender(servers.clients, timeout_seconds=sync.timeout_seconds)
                        if device.type == "cuda" else None)
        self.gathered = False

    def gather(self) -> None:
        """Collective: every rank gathers; rank 0 writes the buffer."""
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            if lora.is_lora(self.model):   # merged: W + scaling x B @ A, as the engines load a model
                named = lora.full_rollout_tensors(self.model)
            else:
                named = ((name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
                         for name, tensor in rollout_tensors(self.model))
            for name, full in named:
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
                self._colocated[w] = self.servers.clients.info(w).device_uuid == mine
        return all(self._colocated[w] for w in workers)

    def publish(self, version: int) -> dict[str, float]:
        """Collective. Gather, then (rank 0) send `version` to every server. A server that fails
        is logged, not fatal: it is re-synced before its next rollout (`ensure_version`)."""
        t0 = time.perf_counter()
        self.gather()
        times = {"timing_s/weight_gather": time.perf_counter() - t0}
        if self.rank == 0:
            t1 = time.perf_counter()
            workers = self.servers.addresses()
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
        times["timing_s/weight_sync"] = time.perf_counter() - t0
        return times

    def catch_up(self, version: int, *, force: bool) -> None:
        """Collective, at the start: publish `version` when `force` (a resumed run: the servers
        hold the initial weights) or when a reachable server holds other weights (a trainer
        restarted before its first checkpoint, after servers took a later policy). One that is
        down is brought up to date before its first rollout (`ensure_version`)."""
        elsewhere = False
        if self.rank == 0 and not force:
            for worker in self.servers.addresses():
                try:
                    reply = self.servers.clients.health(worker)
                except grpc.RpcError:
                    continue
                elsewhere |= not reply.ready or reply.policy_version != version
        if broadcast_json(force or elsewhere, self.device):
            self.publish(version)

    def ensure_version(self, worker: str, version: int) -> None:
        """Rank 0: bring one server that missed updates (restarted, or a new replica) to
        `version` from the cache."""
        reply = self.servers.clients.health(worker)
        if reply.ready and reply.policy_version == version:
            return
        log.info("Re-syncing rollout worker %s from version %d to %d", worker, reply.policy_version, version)
        if not self.gathered:
            raise RuntimeError(f"worker {worker} needs weights, none gathered yet")
        self._colocated.pop(worker, None)
        if self._all_colocated([worker]):
            self.ipc.send([worker], self.buffer, self.layout, version)
        else:
            self.sender.resync(worker, self.weights.items(), version)

    def final_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective: the policy as separate host tensors on rank 0 (for the Hugging Face
        export), None elsewhere. Gathers first when no step ran here (resumed at the last step)."""
        if not self.gathered:
            self.gather()
        return {name: t.to("cpu", copy=True) for name, t in self.weights.items()} if self.rank == 0 else None

    def final_adapter(self) -> dict[str, torch.Tensor] | None:
        """Collective: a LoRA policy's adapters on rank 0 (PEFT's file names), else None."""
        return lora.adapter_tensors(self.model, rank=self.rank) if lora.is_lora(self.model) else None
