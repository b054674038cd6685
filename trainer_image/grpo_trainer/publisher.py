"""Step 4 of docs/ARCHITECTURE.md §1: the new policy to every rollout server.

`WeightPublisher` owns the gather, the cache and the choice of path:
- gather: FSDP2 shards -> full tensors in the rollout dtype (collective on every rank), written
  by rank 0 into one flat buffer laid out as a single weight bucket (grpo_api.weights). The
  buffer is allocated once and is the cache: re-syncing a restarted server and the final export
  read it, and no second full copy of the weights exists at any time. On GPU it lives on the GPU.
- send: `cuda_ipc` when every server is on the trainer's own GPU (the servers copy straight
  out of the buffer; no bytes move through the host), else the backend `spec.weightSync`
  names (the collective, or gRPC).
- LoRA (spec.model.lora, unless its `merge`): a server whose Info says it accepts adapters gets
  the adapters alone (each module's lora_A, lora_B and scaling; its engine merges them into the
  base it loaded), the others the merged weights. Rank 0 asks the servers first and tells every
  rank whether this update needs the merged weights at all: with only adapter servers the
  merged buffer is neither gathered nor even allocated until the final export needs it. The
  adapters (a few % of the model) are cached on rank 0 like the merged weights.

It also keeps every server at the current version: `ensure_version` (before a server
generates: the dispatcher calls it) re-syncs one that missed updates from the cache, and
`catch_up` (at the start) publishes when a server holds other weights than the policy.
"""

from __future__ import annotations

import logging
import time
import grpc
import torch
import torch.distributed as dist

from grpo_api.rpc import RolloutClients
from grpo_api.spec import WeightSyncSpec
from grpo_api.weights import Bucket, TensorSpec, plan_buckets
from grpo_trainer import lora
from grpo_trainer.collectives import broadcast_json
from grpo_trainer.rollout_servers import RolloutServers
from grpo_trainer.weight_sync import (CollectiveWeightSender, GrpcWeightSender, IpcWeightSender, WeightSender,
                                      WeightSyncError, cuda_device_uuid)

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


def plan_routes(workers: list[str], known: dict[str, tuple[bool, bool]], *,
                adapters_wanted: bool) -> tuple[str, list[str], list[str]]:
    """How an update goes out: ("ipc", all, []) when every server answered Info and shares the
    trainer's GPU, else ("send", those that get the adapters, those that get whole weights).
    `known`: (on the trainer's GPU, takes LoRA adapters) of the servers that answered; one that
    didn't gets what the others get (the send to it fails; it is re-synced before its next rollout)."""
    if known and len(known) == len(workers) and all(colocated for colocated, _ in known.values()):
        return "ipc", workers, []
    if not adapters_wanted:
        return "send", [], workers
    merged = [w for w, (_, accepts) in known.items() if not accepts]
    return "send", [w for w in workers if w not in merged], merged


class WeightPublisher:
    def __init__(self, model, sync: WeightSyncSpec, *, dtype: torch.dtype, device: torch.device,
                 servers: RolloutServers | None, lora_merge: bool = False):
        """servers: rank 0's view of the rollout servers (None on the other ranks, and where
        nothing is sent: the weights are only gathered). lora_merge: spec.model.lora.merge (a
        LoRA policy goes out merged to every server)."""
        self.model, self.device, self.servers, self.dtype = model, device, servers, dtype
        self.rank = dist.get_rank()
        dtype_name = str(dtype).removeprefix("torch.")
        specs = [TensorSpec(name, tuple(t.shape), dtype_name) for name, t in rollout_tensors(model)]
        self.layout: Bucket = plan_buckets(specs, bucket_size=1 << 62)[0]   # one bucket: the whole buffer
        self.buffer: torch.Tensor | None = None     # rank 0; with adapters wanted, by the first merged gather
        self.weights: dict[str, torch.Tensor] = {}
        self.adapters_wanted = lora.is_lora(model) and not lora_merge
        self.adapters: dict[str, torch.Tensor] = {}   # rank 0: the adapter-only sync's tensors
        self.scaling = lora.adapter_scaling(model) if self.adapters_wanted else None
        self._info: dict[str, tuple[bool, bool]] = {}   # worker -> (on this GPU, accepts adapters)
        if servers is not None:
            self._senders = {False: make_weight_sender(sync, clients=servers.clients, device=device)}
            if self.adapters_wanted:   # its own collective group: a mixed fleet re-forms none
                self._senders[True] = make_weight_sender(sync, clients=servers.clients, device=device)
            self.ipc = (IpcWeightSender(servers.clients, timeout_seconds=sync.timeout_seconds)
                        if device.type == "cuda" else None)
        self.gathered = False        # the current policy, merged or as adapters (ensure_version's cache)
        self.merged_current = False  # the merged weights are the current policy's
        if not self.adapters_wanted:
            self._allocate()         # needed at every update: allocated before training takes the memory

    @property
    def sender(self):
        """The sender of merged (whole) weights."""
        return self._senders[False]

    def _allocate(self) -> None:
        if self.rank == 0 and self.buffer is None:
            self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=self.device)
            for placed in self.layout.tensors:
                view = self.buffer[placed.offset:placed.offset + placed.nbytes]
                self.weights[placed.spec.name] = view.view(self.dtype).reshape(placed.spec.shape)

    def gather(self, *, merged: bool = True) -> None:
        """Collective: every rank gathers; rank 0 writes the buffer (`merged`) and the adapter
        cache (a LoRA policy whose adapters some server takes)."""
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            if self.adapters_wanted:
                for name, full in lora.full_adapter_tensors(self.model):
                    if self.rank == 0:
                        if name in self.adapters:
                            self.adapters[name].copy_(full.detach())
                        else:
                            self.adapters[name] = full.detach().to(self.device, copy=True)
            if merged:
                self._allocate()
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
        self.gathered, self.merged_current = True, merged

    def _server(self, worker: str) -> tuple[bool, bool]:
        """(on the trainer's GPU, takes LoRA adapters) of one server, asked once (Info)."""
        if self.ipc is None and not self.adapters_wanted:
            return False, False   # nothing to choose: whole weights, by the sender
        if worker not in self._info:
            info = self.servers.clients.info(worker)
            colocated = self.ipc is not None and info.device_uuid == cuda_device_uuid(self.device)
            self._info[worker] = (colocated, info.accepts_lora_adapters)
        return self._info[worker]

    def _routes(self, workers: list[str]) -> tuple[str, list[str], list[str]]:
        """Rank 0: how the update goes out to `workers` (plan_routes), each asked once (Info)."""
        known = {}
        for w in workers:
            try:
                known[w] = self._server(w)
            except grpc.RpcError:
                pass
        return plan_routes(workers, known, adapters_wanted=self.adapters_wanted)

    def publish(self, version: int) -> dict[str, float]:
        """Collective. Gather, then (rank 0) send `version` to every server. A server that fails
        is logged, not fatal: it is re-synced before its next rollout (`ensure_version`)."""
        t0 = time.perf_counter()
        route = None
        if self.rank == 0:
            route = self._routes(self.servers.addresses())
        merged = True
        if self.adapters_wanted:   # every rank: gather the merged weights only where a server needs them
            merged = broadcast_json(None if route is None else route[0] == "ipc" or bool(route[2]), self.device)
        self.gather(merged=merged)
        times = {"timing_s/weight_gather": time.perf_counter() - t0}
        if self.rank == 0:
            t1 = time.perf_counter()
            kind, adapter_workers, merged_workers = route
            try:
                if kind == "ipc":
                    self.ipc.send(adapter_workers, self.buffer, self.layout, version)
                else:
                    self._send_both(adapter_workers, merged_workers, version)
            except (WeightSyncError, grpc.RpcError) as exc:
                self._info.clear()   # a replaced server may sit elsewhere, or run another engine: ask again
                log.warning("weight update to version %d did not reach every rollout worker (%s); "
                            "they are re-synced before their next rollout", version, exc)
            times["timing_s/weight_send"] = time.perf_counter() - t1
        times["timing_s/weight_sync"] = time.perf_counter() - t0
        return times

    def _send_both(self, adapter_workers: list[str], merged_workers: list[str], version: int) -> None:
        """The adapters to some servers, the merged weights to the others; a failure of one part
        doesn't keep the other from its servers."""
        failures = []
        for adapters, workers in ((True, adapter_workers), (False, merged_workers)):
            if not workers:
                continue
            try:
                if adapters:
                    self._senders[True].send(workers, self.adapters.items(), version, lora=self.scaling)
                else:
                    self.sender.send(workers, self.weights.items(), version)
            except (WeightSyncError, grpc.RpcError) as exc:
                failures.append(str(exc))
        if failures:
            raise WeightSyncError("; ".join(failures))

    def catch_up(self, version: int, *, force: bool) -> None:
        """Collective, at the start: publish `version` when `force` (a resumed run: the servers
        hold the initial weights) or when a reachable server holds other weights (a trainer
        restarted before its first checkpoint, after servers took a later policy). One that is
        down is brought up to date before its first rollout (`ensure_version`)."""
        elsewhere = False
        if self.rank == 0 and self.servers is not None:
            self.servers.wait_until_serving()
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
        self._info.pop(worker, None)
        colocated, accepts = self._server(worker)
        if colocated and self.merged_current:
            self.ipc.send([worker], self.buffer, self.layout, version)
        elif self.adapters_wanted and accepts:
            self._senders[True].resync(worker, self.adapters.items(), version, lora=self.scaling)
        elif self.merged_current:
            self.sender.resync(worker, self.weights.items(), version)
        else:
            raise WeightSyncError(f"worker {worker} takes merged weights only, and version {version} went out as "
                                  "LoRA adapters alone: the next update gathers the merged weights for it")

    def final_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective: the policy as separate host tensors on rank 0 (for the Hugging Face
        export), None elsewhere. Gathers first when the merged weights are not the current policy's
        (no step ran here, or the updates went out as LoRA adapters)."""
        if not self.merged_current:
            self.gather()
        return {name: t.to("cpu", copy=True) for name, t in self.weights.items()} if self.rank == 0 else None

    def final_adapter(self) -> dict[str, torch.Tensor] | None:
        """Collective: a LoRA policy's adapters on rank 0 (PEFT's file names), else None."""
        return lora.adapter_tensors(self.model, rank=self.rank) if lora.is_lora(self.model) else None
