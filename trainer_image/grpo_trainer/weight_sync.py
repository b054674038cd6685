"""Trainer rank 0's side of a weight update: send a full state dict, as version v, to every
rollout server, and verify each one reports v (docs/ARCHITECTURE.md §6). The receiving side is
grpo_rollout.weights; both cut the state dict with grpo_api.weights.plan_buckets.

Tensors come as (Hugging Face name, full tensor) pairs; a sender packs them bucket by bucket, so
what it allocates is one bucket (plus one per worker in flight on the grpc path). The trainer's
publisher holds the full weights anyway (its gathered cache), so the pairs are views into it.
Every sender calls the servers through the trainer's one client per server (RolloutClients).

- `GrpcWeightSender`: each bucket is streamed to every worker concurrently (one thread per
  worker) as UpdateWeights chunks with its sha256; a bucket a worker rejects is sent again.
- `CollectiveWeightSender`: the plan goes out by PrepareWeightSync, then rank 0 joins a process
  group with the workers (TCPStore here, gloo on CPU, nccl on GPU) and broadcasts bucket by
  bucket. A change of workers, or any failure, re-forms (aborts) the group under a new id next time.
  `resync` of a single late worker uses the grpc path (no group re-formation for one worker).
- A LoRA policy's adapter-only sync (`lora`: the scaling of every adapted module) goes by either
  path as well: the tensors are then each module's lora_A and lora_B, and the LoraAdapters
  message rides on the first chunk of every bucket (grpc) or in the plan (the collective).
- `IpcWeightSender`: servers on the trainer's own GPU. One PrepareWeightSync (backend
  "cuda_ipc") names a CUDA buffer of the trainer's, shared through CUDA IPC once; the servers
  copy the weights out of it, GPU to GPU (grpo_rollout.cuda_ipc is the other side).

Only torch and grpo_api are imported here.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.rpc import CHUNK_BYTES, RolloutClients
from grpo_api.weights import (WATCHDOG_MARGIN_SECONDS, Bucket, TensorSpec, abort_group, bucket_to_proto,
                              lora_to_proto, plan_buckets, tensor_meta, wait_for_work)

log = logging.getLogger("grpo.trainer.weight_sync")

NamedTensors = Iterable[tuple[str, torch.Tensor]]
LoraScaling = Mapping[str, float]
"""An adapter-only sync: each adapted module's scaling (the tensors are its lora_A and lora_B)."""


class WeightSyncError(RuntimeError):
    """A weight update did not reach every worker; the message names the workers and why."""


@dataclass
class SyncReport:
    version: int
    seconds: float
    nbytes: int
    """Bytes of one copy of the weights (what each worker received)."""
    resent: dict[str, list[int]] = field(default_factory=dict)
    """Buckets a worker rejected (bad checksum) and got again, by worker."""
    transfer_seconds: float | None = None
    """Collective path: the broadcasts alone (pack + transfer), without the plan and the commit."""


def tensor_specs(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors]


def pack_bucket(bucket: Bucket, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The next tensors of the stream, copied into one flat uint8 buffer laid out as planned."""
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    for placed in bucket.tensors:
        try:
            name, tensor = next(tensors)
        except StopIteration:
            raise ValueError(f"the tensors ended before {placed.spec.name!r}") from None
        if name != placed.spec.name or tuple(tensor.shape) != placed.spec.shape:
            raise ValueError(f"expected {placed.spec.name} {placed.spec.shape}, got {name} {tuple(tensor.shape)}: "
                             "tensors must come in the order and shapes they were planned in")
        if placed.nbytes:
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            buffer[placed.offset:placed.offset + placed.nbytes].copy_(flat)
    return buffer


def _plan(named_tensors: NamedTensors, bucket_bytes: int):
    named_tensors = list(named_tensors)
    return plan_buckets(tensor_specs(named_tensors), bucket_bytes), iter(named_tensors)


class WeightSender(ABC):
    @abstractmethod
    def send(self, workers: Sequence[str], named_tensors: NamedTensors, version: int, *,
             lora: LoraScaling | None = None) -> SyncReport:
        """Bring every worker (host:port) to `version`; raises WeightSyncError unless all got there.
        `lora`: the tensors are LoRA adapters (an adapter-only sync), this their scaling by module."""

    def resync(self, worker: str, named_tensors: NamedTensors, version: int, *,
               lora: LoraScaling | None = None) -> SyncReport:
        """Bring one worker that missed updates (restarted, new replica) to `version`."""
        return self.send([worker], named_tensors, version, lora=lora)

    def close(self) -> None:
        pass


def worker_health(clients: RolloutClients, worker: str, when: str) -> pb.HealthReply:
    """One Health call; a worker that doesn't answer is a WeightSyncError (`when` says when)."""
    try:
        return clients.health(worker)
    except grpc.RpcError as exc:
        raise WeightSyncError(f"worker {worker} {when}: Health failed: {exc.code().name} {exc.details()}") from None


def prepare_on(clients: RolloutClients, plans: Mapping[str, pb.WeightSyncPlan]) -> None:
    """PrepareWeightSync on every worker at once (worker -> its plan); a worker that refuses is
    a WeightSyncError naming it."""
    def prepare(worker: str) -> None:
        try:
            clients(worker).PrepareWeightSync(plans[worker], timeout=60)
        except grpc.RpcError as exc:
            raise WeightSyncError(f"worker {worker}: PrepareWeightSync: {exc.code().name}: {exc.details()}") from None

    with ThreadPoolExecutor(max_workers=len(plans)) as pool:
        list(pool.map(prepare, plans))


def check_sync_not_failed(worker: str, health: pb.HealthReply, version: int) -> None:
    """The worker's side of the collective sync to `version` failed: it will never get there."""
    if health.weight_sync_error and health.weight_sync_version == version:
        raise WeightSyncError(f"worker {worker}: weight sync to version {version} failed: {health.weight_sync_error}")


def wait_for_version(clients: RolloutClients, workers: Sequence[str], version: int, timeout: float) -> None:
    """Poll Health until every worker reports `version`; a worker whose collective sync of this
    version failed, or the deadline, ends the wait with a WeightSyncError."""
    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        still = []
        for w in pending:
            h = worker_health(clients, w, f"while waiting for version {version}")
            if h.policy_version == version and h.ready:
                continue
            check_sync_not_failed(w, h, version)
            still.append(w)
        pending = still
        if pending and time.monotonic() > deadline:
            raise WeightSyncError(f"workers {pending} did not reach version {version} within {timeout:.0f}s")
        if pending:
            time.sleep(0.05)


class GrpcWeightSender(WeightSender):
    def __init__(self, clients: RolloutClients, *, bucket_bytes: int, chunk_bytes: int = CHUNK_BYTES,
                 timeout_seconds: float = 600.0, max_attempts: int = 3):
        """max_attempts: sends of one bucket to one worker before giving up on that worker."""
        self._clients = clients
        self.bucket_bytes, self.chunk_bytes = bucket_bytes, chunk_bytes
        self.timeout, self.max_attempts = timeout_seconds, max_attempts

    def send(self, workers, named_tensors, version, *, lora=None) -> SyncReport:
        if not workers:
            raise ValueError("no workers to send weights to")
        started = time.monotonic()
        buckets, tensors = _plan(named_tensors, self.bucket_bytes)
        report = SyncReport(version=version, seconds=0.0, nbytes=sum(b.nbytes for b in buckets))
        lora_msg = lora_to_proto(lora)
        with ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="weights") as pool:
            for bucket in buckets:
                # A view of the packed buffer (no copy); each stream hashes the chunks as it sends
                # them, so no pass over the bucket comes before its first byte goes out.
                data = memoryview(pack_bucket(bucket, tensors, torch.device("cpu")).numpy())
                futures = {w: pool.submit(self._push, w, version, bucket, len(buckets), data, report, lora_msg)
                           for w in workers}
                failures = []
                for w, fut in futures.items():
                    try:
                        fut.result()
                    except Exception as exc:
                        failures.append(f"{w}: {exc}")
                if failures:
                    raise WeightSyncError(f"weight update to version {version} failed on "
                                          f"{len(failures)} worker(s): " + "; ".join(failures))
        wait_for_version(self._clients, workers, version, timeout=min(self.timeout, 60.0))
        report.seconds = time.monotonic() - started
        return report

    def _push(self, worker: str, version: int, bucket: Bucket, num_buckets: int, data: memoryview,
              report: SyncReport, lora: pb.LoraAdapters | None = None) -> None:
        for attempt in range(1, self.max_attempts + 1):
            try:
                reply = self._clients(worker).UpdateWeights(
                    self._chunks(version, bucket, num_buckets, data, None, lora), timeout=self.timeout)
            except grpc.RpcError as exc:
                raise WeightSyncError(f"UpdateWeights: {exc.code().name}: {exc.details()}") from None
            if bucket.index in reply.accepted_buckets:
                return
            log.warning("worker %s rejected weight bucket %d of version %d (attempt %d/%d): sending it again",
                        worker, bucket.index, version, attempt, self.max_attempts)
            report.resent.setdefault(worker, []).append(bucket.index)
        raise WeightSyncError(f"bucket {bucket.index} rejected {self.max_attempts} times")

    def _chunks(self, version: int, bucket: Bucket, num_buckets: int, data: bytes | memoryview,
                sha: str | None = None, lora: pb.LoraAdapters | None = None) -> Iterator[pb.WeightChunk]:
        """The UpdateWeights messages of one bucket: metadata (and an adapter sync's LoraAdapters)
        on the first, the bucket's sha256 on the last (`sha`, or hashed chunk by chunk as they go)."""
        hasher = hashlib.sha256() if sha is None else None
        starts = range(0, max(len(data), 1), self.chunk_bytes)
        for k, start in enumerate(starts):
            last = k == len(starts) - 1
            piece = bytes(data[start:start + self.chunk_bytes])
            if hasher is not None:
                hasher.update(piece)
            yield pb.WeightChunk(
                version=version, bucket_index=bucket.index, num_buckets=num_buckets,
                tensors=[tensor_meta(t) for t in bucket.tensors] if k == 0 else [],
                data=piece, last_in_bucket=last,
                sha256=(sha if hasher is None else hasher.hexdigest()) if last else "",
                lora=lora if k == 0 else None)


class _Group:
    """Rank 0 of a process group with the rollout workers, outside torch.distributed's default
    group (which the trainer's own ranks use)."""

    def __init__(self, store, group_id: str, world_size: int, backend: str, timeout: float):
        import torch.distributed as dist

        self.id = group_id
        td = datetime.timedelta(seconds=timeout + WATCHDOG_MARGIN_SECONDS)
        prefixed = dist.PrefixStore(f"grpo-weights/{group_id}/", store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, 0, world_size, td)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = td
            self._pg = dist.ProcessGroupNCCL(prefixed, 0, world_size, options)
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def broadcast(self, tensor: torch.Tensor, deadline: float, check=None) -> None:
        wait_for_work(self._pg.broadcast([tensor], self._opts), deadline, "the weight broadcast", check)

    def close(self) -> None:
        abort_group(self._pg)
        self._pg = None


def _default_master_addr() -> str:
    # MASTER_ADDR is where torchrun's rank 0 runs (this process); rollout pods reach it there.
    return os.environ.get("GRPO_WEIGHT_SYNC_ADDR") or os.environ.get("MASTER_ADDR") or socket.gethostname()


class CollectiveWeightSender(WeightSender):
    def __init__(self, clients: RolloutClients, *, bucket_bytes: int, device: torch.device | str = "cpu",
                 timeout_seconds: float = 600.0, master_addr: str | None = None, master_port: int | None = None,
                 backend: str = "auto"):
        """master_addr/master_port: where the workers reach this process's TCPStore (defaults:
        GRPO_WEIGHT_SYNC_ADDR or MASTER_ADDR; GRPO_WEIGHT_SYNC_PORT or a free port).
        backend: gloo, nccl, or auto (nccl when this device and every worker are on GPUs)."""
        import torch.distributed as dist

        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl (got {backend!r})")
        self._clients = clients
        self._grpc = GrpcWeightSender(clients, bucket_bytes=bucket_bytes, timeout_seconds=timeout_seconds)
        self.bucket_bytes, self.timeout, self.backend = bucket_bytes, timeout_seconds, backend
        self.device = torch.device(device)
        self.master_addr = master_addr or _default_master_addr()
        port = master_port if master_port is not None else int(os.environ.get("GRPO_WEIGHT_SYNC_PORT", "0"))
        # One store for the sender's lifetime; each group formation uses its own key prefix.
        self._store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_seconds))
        self.master_port = self._store.port
        self._group: _Group | None = None
        self._members: tuple[str, ...] = ()

    def _backend_for(self, workers: Sequence[str]) -> str:
        if self.backend != "auto":
            return self.backend
        if self.device.type != "cuda":
            return "gloo"
        devices = [self._clients.info(w).device for w in workers]
        return "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"

    def send(self, workers, named_tensors, version, *, lora=None) -> SyncReport:
        if not workers:
            raise ValueError("no workers to send weights to")
        started = time.monotonic()
        workers = tuple(workers)
        buckets, tensors = _plan(named_tensors, self.bucket_bytes)
        try:
            backend = self._backend_for(workers)
            reform = self._group is None or self._members != workers
            group_id = uuid.uuid4().hex if reform else self._group.id
            if reform:
                self._drop_group()
            self._prepare(workers, version, group_id, backend, buckets, lora)
            if reform:
                self._group = _Group(self._store, group_id, 1 + len(workers), backend, self.timeout)
                self._members = workers
            device = self.device if backend == "nccl" else torch.device("cpu")
            deadline = started + self.timeout
            t = time.monotonic()
            for bucket in buckets:
                self._group.broadcast(pack_bucket(bucket, tensors, device), deadline,
                                      check=lambda: self._check_alive(workers, version))
            transfer = time.monotonic() - t
            wait_for_version(self._clients, workers, version, timeout=max(deadline - time.monotonic(), 1.0))
        except Exception as exc:
            self._drop_group()  # whatever broke, the next update starts from a fresh group
            if isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(f"collective weight update to version {version} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
        return SyncReport(version=version, seconds=time.monotonic() - started, nbytes=sum(b.nbytes for b in buckets),
                          transfer_seconds=transfer)

    def _check_alive(self, workers, version: int) -> None:
        """During a broadcast: a worker that is gone, or whose side failed, never completes it."""
        for w in workers:
            check_sync_not_failed(w, worker_health(self._clients, w, "went away during the weight broadcast"), version)

    def _prepare(self, workers, version, group_id, backend, buckets, lora=None) -> None:
        bucket_protos = [bucket_to_proto(b) for b in buckets]
        prepare_on(self._clients, {
            worker: pb.WeightSyncPlan(version=version, group_id=group_id, master_addr=self.master_addr,
                                      master_port=self.master_port, world_size=1 + len(workers), rank=rank,
                                      backend=backend, buckets=bucket_protos, timeout_seconds=self.timeout,
                                      lora=lora_to_proto(lora))
            for rank, worker in enumerate(workers, start=1)})

    def resync(self, worker, named_tensors, version, *, lora=None) -> SyncReport:
        return self._grpc.send([worker], named_tensors, version, lora=lora)

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._members = None, ()

    def close(self) -> None:
        self._drop_group()
        self._store = None


def cuda_device_uuid(device: torch.device) -> str:
    """The GPU's UUID ("" off GPU): how the trainer tells that a server shares its GPU."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def share_cuda_buffer(buffer: torch.Tensor) -> pb.CudaIpcBuffer:
    """Export a whole CUDA uint8 tensor through torch's CUDA IPC (the fields of its reduction,
    sent as plain values: the other side rebuilds it without unpickling anything)."""
    from torch.multiprocessing.reductions import reduce_tensor
    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.storage_offset() != 0:
        raise ValueError("only a whole CUDA uint8 buffer can be shared")
    _, args = reduce_tensor(buffer)
    (_, _, _, _, _, _, _, handle, size, offset, _, ref_handle, ref_offset, event_handle, event_sync) = args
    return pb.CudaIpcBuffer(handle=handle, size_bytes=size, offset_bytes=offset, ref_counter_handle=ref_handle,
                            ref_counter_offset=ref_offset, event_handle=event_handle,
                            event_sync_required=event_sync, device_uuid=cuda_device_uuid(buffer.device))


class IpcWeightSender:
    """Weights to servers on this GPU: they map the buffer (once) and copy out of it."""

    def __init__(self, clients: RolloutClients, *, timeout_seconds: float = 600.0):
        self._clients = clients
        self.timeout = timeout_seconds
        self._shared: tuple[int, pb.CudaIpcBuffer] | None = None

    def _share(self, buffer: torch.Tensor) -> pb.CudaIpcBuffer:
        # Shared once per buffer: the servers keep their mapping across updates.
        if self._shared is None or self._shared[0] != buffer.data_ptr():
            self._shared = (buffer.data_ptr(), share_cuda_buffer(buffer))
        return self._shared[1]

    def send(self, workers: Sequence[str], buffer: torch.Tensor, layout: Bucket, version: int) -> SyncReport:
        """`buffer` holds every tensor of `layout` (one bucket) and must be complete (synchronized)."""
        if not workers:
            raise ValueError("no workers to send weights to")
        started = time.monotonic()
        ipc = pb.CudaIpcBuffer()
        ipc.CopyFrom(self._share(buffer))
        ipc.bucket_offsets.append(0)
        plan = pb.WeightSyncPlan(version=version, backend="cuda_ipc", buckets=[bucket_to_proto(layout)],
                                 timeout_seconds=self.timeout, ipc=ipc)
        prepare_on(self._clients, dict.fromkeys(workers, plan))
        wait_for_version(self._clients, workers, version, timeout=self.timeout)
        return SyncReport(version=version, seconds=time.monotonic() - started, nbytes=layout.nbytes)
