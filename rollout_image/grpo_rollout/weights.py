"""The receiving side of a weight update (docs/ARCHITECTURE.md §6); the trainer's
grpo_trainer.weight_sync is the sending side. Both cut the state dict with
grpo_api.weights.plan_buckets, so the bytes of a bucket mean the same on both ends.

A version is committed (the engine's `policy_version` bumped) only once every bucket of it is
loaded. From the first loaded bucket until then the weights are a mix of two versions: the
version reads -1 and the server refuses to generate. A sync that fails half-way leaves it at -1
until a complete one succeeds.

- grpc: buckets arrive as chunks of UpdateWeights streams, each checked against its sha256;
  a bad one is not loaded and is listed for the sender to send again.
- collective: the plan arrives by PrepareWeightSync; the bytes by broadcast from trainer rank 0
  in a process group formed over a TCPStore at the trainer (gloo on CPU, nccl on GPU). A plan
  with a new group_id (membership changed) makes us leave the old group and form the new one.
- cuda_ipc (trainer on the same GPU): the plan names the trainer's weight buffer; the engine
  copies every bucket out of it, GPU to GPU (grpo_rollout.cuda_ipc). No group, no bytes on a
  wire: the plan is the whole message.

An adapter-only sync (a LoRA policy, rollout.proto's LoraAdapters, over grpc or the collective)
carries each adapted module's lora_A and lora_B instead of weights: they are kept as the buckets
arrive and, once all are in, the engine merges them into the base weights it loaded
(`Engine.load_lora_adapters`) and the version commits. The version reads -1 from the first
bucket on, as for whole weights. An engine that quantizes what it loads (FP8 rollouts,
`Engine.loads_whole_versions`) gets whole weights the same way: kept, then loaded in one call.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from grpo_api.weights import (LORA_A, LORA_B, WATCHDOG_MARGIN_SECONDS, Bucket, PlacedTensor, abort_group,
                              lora_from_proto, placed_from_proto, split_lora_name, wait_for_work)
from grpo_rollout import cuda_ipc
from grpo_rollout.engine import LoraAdapter

if TYPE_CHECKING:
    from collections.abc import Iterator

    from grpo_api.proto import rollout_pb2 as pb
    from grpo_rollout.engine import Engine
    from grpo_rollout.metrics import RolloutMetrics

log = logging.getLogger(__name__)

UNKNOWN_VERSION = -1


class WeightSyncConflict(RuntimeError):
    """The request can't be served in the current state (maps to FAILED_PRECONDITION)."""


def tensors_from_buffer(buffer: torch.Tensor, placed: tuple[PlacedTensor, ...]) -> list[tuple[str, torch.Tensor]]:
    """Views of a flat uint8 bucket as its named tensors (no copy)."""
    out = []
    for t in placed:
        dtype = getattr(torch, t.spec.dtype)
        if t.nbytes == 0:
            out.append((t.spec.name, torch.empty(t.spec.shape, dtype=dtype, device=buffer.device)))
            continue
        view = buffer[t.offset:t.offset + t.nbytes].view(dtype).reshape(t.spec.shape)
        out.append((t.spec.name, view))
    return out


@dataclass
class StreamResult:
    version: int
    committed: bool
    accepted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class CollectivePlan:
    version: int
    group_id: str
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    backend: str
    buckets: tuple[Bucket, ...]
    timeout_seconds: float
    ipc: cuda_ipc.IpcBuffer | None = None
    ipc_bucket_offsets: tuple[int, ...] = ()
    lora: dict[str, float] | None = None
    """An adapter-only sync: the scaling of every adapted module (rollout.proto's LoraAdapters)."""

    def __post_init__(self):
        if self.backend not in ("gloo", "nccl", "cuda_ipc"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or 'cuda_ipc' (got {self.backend!r})")
        if self.backend == "cuda_ipc":
            if self.lora is not None:
                raise ValueError("backend cuda_ipc carries whole weights, not LoRA adapters")
            if self.ipc is None or len(self.ipc_bucket_offsets) != len(self.buckets):
                raise ValueError("backend cuda_ipc needs the buffer and one offset per bucket")
            for bucket, base in zip(self.buckets, self.ipc_bucket_offsets):
                if base < 0 or base + bucket.nbytes > self.ipc.size_bytes:
                    raise ValueError(f"bucket {bucket.index} lies outside the shared buffer")
            return
        if not 0 < self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size} (rank 0 is the trainer)")
        if not self.group_id or not self.master_addr or not 0 < self.master_port < 65536:
            raise ValueError("group_id, master_addr and master_port are required")


class _BucketAssembly:
    """One bucket being received: bytes appended chunk by chunk, hashed as they come."""

    def __init__(self, index: int, placed: tuple[PlacedTensor, ...]):
        self.index = index
        self.placed = placed
        self.expected = max((t.offset + t.nbytes for t in placed), default=0)
        # Allocated once at its final size (appending would copy it again each time it grows).
        self.data = bytearray(self.expected)
        self.size = 0
        self.sha = hashlib.sha256()
        self.overflow = False

    def add(self, data: bytes) -> None:
        if self.size + len(data) > self.expected:
            self.overflow = True  # keep hashing nothing more; the bucket will be rejected
            return
        self.data[self.size:self.size + len(data)] = data
        self.size += len(data)
        self.sha.update(data)

    def intact(self, sha256: str) -> bool:
        return not self.overflow and self.size == self.expected and self.sha.hexdigest() == sha256


class _Group:
    """A process group with the trainer, formed without touching torch.distributed's default
    group (the trainer side has one already; we keep both sides alike)."""

    def __init__(self, plan: CollectivePlan, device: torch.device):
        import torch.distributed as dist

        self.id = plan.group_id
        self.device = device
        timeout = datetime.timedelta(seconds=plan.timeout_seconds)
        self._store = dist.TCPStore(plan.master_addr, plan.master_port, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"grpo-weights/{plan.group_id}/", self._store)
        if plan.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, plan.rank, plan.world_size, timeout)
        else:
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout + datetime.timedelta(seconds=WATCHDOG_MARGIN_SECONDS)
            self._pg = dist.ProcessGroupNCCL(prefixed, plan.rank, plan.world_size, options)
        self._broadcast_options = dist.BroadcastOptions()
        self._broadcast_options.rootRank = 0

    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None:
        wait_for_work(self._pg.broadcast([tensor], self._broadcast_options), deadline, "the weight broadcast")

    def close(self) -> None:
        abort_group(self._pg)
        self._pg = None
        self._store = None


class WeightReceiver:
    def __init__(self, engine: "Engine", engine_lock: threading.Lock, metrics: "RolloutMetrics | None" = None,
                 *, lora_adapters: bool = True):
        """engine_lock: held while weights are copied in, so no generation sees half a bucket.
        lora_adapters: take adapter-only syncs when the engine can (False: merged weights only)."""
        self._engine = engine
        self.accepts_lora_adapters = lora_adapters and engine.accepts_lora_adapters
        """What Info reports: the trainer sends this server a LoRA policy's adapters alone."""
        self._engine_lock = engine_lock
        self._metrics = metrics
        self._update_lock = threading.Lock()  # one update (stream or collective) at a time
        self._pending: int | None = None
        self._pending_total = 0
        self._pending_loaded: set[int] = set()
        self._pending_started = 0.0
        self._pending_lora: dict[str, float] | None = None     # an adapter sync: scaling by module
        # Tensors kept until every bucket is in: an adapter sync's (merged at the commit), and every
        # sync's to an engine that loads whole versions (Engine.loads_whole_versions).
        self._pending_tensors: dict[str, torch.Tensor] = {}     # by name: a bucket sent twice counts once
        self._group: _Group | None = None
        self._dead_groups: set[str] = set()
        self._thread: threading.Thread | None = None
        self.sync_error = ""
        self.sync_version = UNKNOWN_VERSION

    @property
    def version(self) -> int:
        return self._engine.policy_version

    @property
    def syncing(self) -> bool:
        """Weights are being replaced. Waiting for a collective group to form is not syncing:
        until the first bucket is loaded the weights are whole and generation may go on."""
        return self._pending is not None

    # -- shared by both backends -----------------------------------------------------------

    def check_lora(self, lora: dict[str, float] | None) -> None:
        """An adapter sync (`lora` not None) to a server that takes merged weights only: said at once."""
        if lora is not None and not self.accepts_lora_adapters:
            why = ("grpo rollout --no-lora-adapters" if self._engine.accepts_lora_adapters
                   else f"its engine, {type(self._engine).__name__}, applies none")
            raise ValueError(f"this server takes merged weights only, not LoRA adapters ({why}; "
                             "Info.accepts_lora_adapters is false)")

    def _begin(self, version: int, num_buckets: int, lora: dict[str, float] | None = None) -> None:
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1 (got {num_buckets})")
        self.check_lora(lora)
        if self._pending == version:
            if num_buckets != self._pending_total:
                raise ValueError(f"version {version}: {num_buckets} buckets announced, earlier {self._pending_total}")
            if lora != self._pending_lora:
                raise ValueError(f"version {version}: a bucket's LoraAdapters differ from its first bucket's")
            return
        if self._pending is not None:
            log.warning("weight update to version %d abandoned for version %d", self._pending, version)
        self._pending, self._pending_total, self._pending_loaded = version, num_buckets, set()
        self._pending_lora, self._pending_tensors = lora, {}
        self._pending_started = time.monotonic()

    def _load(self, index: int, tensors: list[tuple[str, torch.Tensor]], nbytes: int, backend: str) -> None:
        if not 0 <= index < self._pending_total:
            raise ValueError(f"bucket index {index} out of range (version {self._pending} has {self._pending_total})")
        if self._pending_lora is not None:
            for name, _ in tensors:
                if split_lora_name(name)[0] not in self._pending_lora:
                    raise ValueError(f"adapter tensor {name!r}: its module has no scaling in the sync's LoraAdapters")
        with self._engine_lock:
            self._set_version(UNKNOWN_VERSION)  # from here on the weights are a mix
            if self._pending_lora is not None or self._engine.loads_whole_versions:
                self._pending_tensors.update(tensors)   # loaded at the commit
            else:
                self._engine.load_weights(tensors)
        self._pending_loaded.add(index)
        if self._metrics:
            self._metrics.weights_loaded(backend, nbytes)

    def _adapters(self) -> dict[str, LoraAdapter]:
        """The pending adapter sync's tensors as one LoraAdapter per module of its scaling."""
        parts: dict[str, dict[str, torch.Tensor]] = {module: {} for module in self._pending_lora}
        for name, tensor in self._pending_tensors.items():
            module, which = split_lora_name(name)
            parts[module][which] = tensor
        for module, found in parts.items():
            if len(found) != 2:
                missing = LORA_B if LORA_A in found else LORA_A
                raise ValueError(f"version {self._pending}: the adapter of {module!r} came without its {missing}")
        return {m: LoraAdapter(p[LORA_A], p[LORA_B], self._pending_lora[m]) for m, p in parts.items()}

    def _maybe_commit(self, backend: str) -> bool:
        if self._pending is None or len(self._pending_loaded) < self._pending_total:
            return False
        version, seconds = self._pending, time.monotonic() - self._pending_started
        if self._pending_lora is not None or self._pending_tensors:
            try:
                adapters = self._adapters() if self._pending_lora is not None else None
                with self._engine_lock:
                    if adapters is not None:
                        self._engine.load_lora_adapters(adapters)
                    else:
                        self._engine.load_weights(list(self._pending_tensors.items()))
            finally:   # loaded or refused, this sync is over (a refused one leaves the version at -1)
                self._pending, self._pending_lora, self._pending_tensors = None, None, {}
        self._pending = None
        self._set_version(version)
        if self._metrics:
            self._metrics.weight_sync_done(backend, seconds)
        log.info("weights at version %d (%s, %d buckets, %.2fs)", version, backend, self._pending_total, seconds)
        return True

    def forget(self) -> None:
        """The engine dropped its weights (sleep level 2): unknown until the next full sync."""
        self._set_version(UNKNOWN_VERSION)

    def _set_version(self, version: int) -> None:
        self._engine.policy_version = version
        if self._metrics:
            self._metrics.set_policy_version(version)

    # -- grpc ------------------------------------------------------------------------------

    def receive_stream(self, chunks: "Iterator[pb.WeightChunk]") -> StreamResult:
        """Consume one UpdateWeights stream (any number of buckets of one version)."""
        started = time.monotonic()
        if self._thread is not None and self._thread.is_alive():
            raise WeightSyncConflict("a collective weight sync is running")
        with self._update_lock:
            result = StreamResult(version=self.version, committed=False)
            current: _BucketAssembly | None = None
            for chunk in chunks:
                if current is None:
                    if not chunk.tensors:
                        raise ValueError(f"bucket {chunk.bucket_index}: its first chunk carries no tensor metadata")
                    self._begin(chunk.version, chunk.num_buckets, lora_from_proto(chunk))
                    current = _BucketAssembly(chunk.bucket_index, placed_from_proto(chunk.tensors))
                elif chunk.bucket_index != current.index:
                    raise ValueError(f"chunk of bucket {chunk.bucket_index} inside bucket {current.index}")
                current.add(chunk.data)
                if chunk.last_in_bucket:
                    self._finish_bucket(current, chunk.sha256, result)
                    current = None
            if current is not None:  # the stream ended inside a bucket
                result.rejected.append(current.index)
            result.committed = self._maybe_commit("grpc")
            result.version = self.version
            result.seconds = time.monotonic() - started
            return result

    def _finish_bucket(self, bucket: _BucketAssembly, sha256: str, result: StreamResult) -> None:
        if not bucket.intact(sha256):
            log.warning("weight bucket %d of version %s failed its checksum/size check: asking for it again",
                        bucket.index, self._pending)
            result.rejected.append(bucket.index)
            if self._metrics:
                self._metrics.bucket_rejected()
            return
        buffer = torch.frombuffer(bucket.data, dtype=torch.uint8) if bucket.data else torch.empty(0, dtype=torch.uint8)
        self._load(bucket.index, tensors_from_buffer(buffer, bucket.placed), len(bucket.data), "grpc")
        result.accepted.append(bucket.index)
        result.nbytes += len(bucket.data)

    # -- collective ------------------------------------------------------------------------

    def prepare_collective(self, plan: CollectivePlan) -> None:
        """Start receiving `plan` in the background; returns at once."""
        if plan.group_id in self._dead_groups:
            raise WeightSyncConflict(f"group {plan.group_id} failed earlier; re-form it with a new group_id")
        # Everything that can be checked here is: an error in the reply reaches the trainer
        # before it blocks in a collective that this server would never join.
        device = self._collective_device(plan)
        self.check_lora(plan.lora)
        if self._thread is not None and self._thread.is_alive():
            self._abandon_running(plan)
        self.sync_error, self.sync_version = "", plan.version
        self._thread = threading.Thread(target=self._run_collective, args=(plan, device), name="weight-sync",
                                        daemon=True)
        self._thread.start()

    def _abandon_running(self, plan: CollectivePlan) -> None:
        """A plan for a new group while a broadcast still waits in the old one: the trainer gave
        up on it (its deadline, a peer gone, or a new trainer). Abort the old group so its
        broadcast ends now rather than at its deadline, then take the new plan."""
        group = self._group
        if group is None or group.id == plan.group_id:
            raise WeightSyncConflict(f"a collective weight sync (version {self.sync_version}) is still running")
        log.warning("abandoning weight-sync group %s (version %d) for group %s (version %d)",
                    group.id, self.sync_version, plan.group_id, plan.version)
        group.close()
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            raise WeightSyncConflict(f"the weight sync of group {group.id} did not stop after its abort")

    def _collective_device(self, plan: CollectivePlan) -> torch.device:
        if plan.backend == "gloo":
            return torch.device("cpu")
        device = self._engine.device
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"backend {plan.backend} needs an engine on one GPU (engine device: {device}); "
                             "use gloo on CPU")
        if plan.backend == "cuda_ipc" and cuda_ipc.device_uuid(device) != plan.ipc.device_uuid:
            raise ValueError(f"backend cuda_ipc: the trainer's buffer is on GPU {plan.ipc.device_uuid}, "
                             f"this server is on {cuda_ipc.device_uuid(device)}")
        return device

    def _run_collective(self, plan: CollectivePlan, device: torch.device) -> None:
        with self._update_lock:
            try:
                if plan.backend == "cuda_ipc":
                    self._receive_ipc(plan)
                    return
                # A trainer that gave up (or died) never finishes its broadcast: give up at the
                # plan's deadline too, abort the group (below) and wait for a new plan.
                deadline = time.monotonic() + plan.timeout_seconds
                group = self._join(plan, device)
                self._begin(plan.version, len(plan.buckets), plan.lora)
                for bucket in plan.buckets:
                    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
                    group.broadcast(buffer, deadline)
                    self._load(bucket.index, tensors_from_buffer(buffer, bucket.tensors), bucket.nbytes, "collective")
                self._maybe_commit("collective")
            except Exception as exc:
                self.sync_error = f"{type(exc).__name__}: {exc}"
                log.error("collective weight sync to version %d failed: %s", plan.version, self.sync_error)
                self._pending, self._pending_lora, self._pending_tensors = None, None, {}
                if self._group is not None:
                    self._dead_groups.add(self._group.id)
                    self._group.close()
                    self._group = None

    def _receive_ipc(self, plan: CollectivePlan) -> None:
        """Every bucket in one engine call: the buffer holds the whole version already."""
        entries = [(t.spec.name, list(t.spec.shape), t.spec.dtype, base + t.offset)
                   for bucket, base in zip(plan.buckets, plan.ipc_bucket_offsets) for t in bucket.tensors]
        nbytes = sum(b.nbytes for b in plan.buckets)
        self._begin(plan.version, len(plan.buckets))
        with self._engine_lock:
            self._set_version(UNKNOWN_VERSION)
            self._engine.load_weights_ipc(plan.ipc, entries)
        self._pending_loaded = {b.index for b in plan.buckets}
        if self._metrics:
            self._metrics.weights_loaded("cuda_ipc", nbytes)
        self._maybe_commit("cuda_ipc")

    def _join(self, plan: CollectivePlan, device: torch.device) -> _Group:
        if self._group is not None and self._group.id == plan.group_id:
            return self._group
        if self._group is not None:
            log.info("leaving weight-sync group %s for %s", self._group.id, plan.group_id)
            self._dead_groups.add(self._group.id)
            self._group.close()
            self._group = None
        log.info("joining weight-sync group %s at %s:%d as rank %d of %d (%s)", plan.group_id, plan.master_addr,
                 plan.master_port, plan.rank, plan.world_size, plan.backend)
        self._group = _Group(plan, device)
        return self._group

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
