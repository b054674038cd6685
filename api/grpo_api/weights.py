"""Weight buckets: how a full state dict is cut into byte buffers for a weight update, shared by
the sender (trainer rank 0) and the receivers (rollout servers) so both agree on every offset.

A bucket is one flat byte buffer holding several tensors back to back; at most `bucket_size`
bytes, except that a tensor larger than that gets a bucket of its own (it can't be loaded in
parts). Offsets are aligned so each tensor's bytes can be viewed in place as its dtype.
Pure Python: no torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from grpo_api.proto import rollout_pb2 as pb

ALIGN_BYTES = 64
"""Offset alignment inside a bucket: enough for any dtype view and for vectorized copies."""

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


WATCHDOG_MARGIN_SECONDS = 300
"""How much later than our own deadline a weight-sync group's NCCL watchdog may fire. Its
timeout tears the whole process down (TORCH_NCCL_ASYNC_ERROR_HANDLING); our deadline only
aborts the group, so it must come first."""


def wait_for_work(work, deadline: float, what: str, check=None, check_every: float = 2.0) -> None:
    """Wait for a torch.distributed Work until the monotonic `deadline`, calling `check()` every
    `check_every` seconds (it raises to give up early). On the deadline: TimeoutError naming
    `what`. A NCCL collective whose peer died never completes and is never cancelled by itself:
    the caller aborts its group on any error from here."""
    next_check = time.monotonic() + check_every
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{what} did not complete before the deadline")
        if check is not None and now > next_check:
            check()
            next_check = now + check_every
        time.sleep(0.0005)
    work.wait()


def abort_group(group) -> None:
    """Stop a weight-sync process group at once, on either side. abort, not shutdown: a graceful
    NCCL shutdown waits for the peers to leave too, and they keep the group until they are told
    to form a new one. A broken group may refuse; it is dropped either way."""
    for name in ("abort", "shutdown"):
        stop = getattr(group, name, None)
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - see above
                pass
            return


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a state dict: name as in the Hugging Face checkpoint, shape, dtype name
    (torch's without the `torch.` prefix)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.name}: unsupported dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}")
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PlacedTensor:
    spec: TensorSpec
    offset: int

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


@dataclass(frozen=True)
class Bucket:
    index: int
    tensors: tuple[PlacedTensor, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [t.spec.name for t in self.tensors]


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def plan_buckets(tensors: Iterable[TensorSpec], bucket_size: int) -> list[Bucket]:
    """Cut the tensors, in order, into buckets of at most `bucket_size` bytes."""
    if bucket_size < ALIGN_BYTES:
        raise ValueError(f"bucket_size must be >= {ALIGN_BYTES} bytes (got {bucket_size})")
    buckets: list[Bucket] = []
    current: list[PlacedTensor] = []
    used = 0
    seen: set[str] = set()

    def close() -> None:
        nonlocal current, used
        if current:
            end = current[-1].offset + current[-1].nbytes
            buckets.append(Bucket(len(buckets), tuple(current), end))
        current, used = [], 0

    for spec in tensors:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} appears twice")
        seen.add(spec.name)
        offset = _align(used)
        if current and offset + spec.nbytes > bucket_size:
            close()
            offset = 0
        current.append(PlacedTensor(spec, offset))
        used = offset + spec.nbytes
    close()
    return buckets


# -- LoRA adapters (an adapter-only sync, rollout.proto's LoraAdapters) -----------------------

LORA_A, LORA_B = "lora_A", "lora_B"


def lora_tensor_name(module: str, which: str) -> str:
    """How an adapter travels: `<module>.lora_A.weight` / `<module>.lora_B.weight` (PEFT's file
    names without its `base_model.model.` prefix; `module` is the engine's, e.g.
    model.layers.0.self_attn.q_proj)."""
    return f"{module}.{which}.weight"


def split_lora_name(name: str) -> tuple[str, str]:
    """(module, "lora_A" | "lora_B") of an adapter tensor's name; ValueError for anything else."""
    stem = name.removesuffix(".weight")
    module, _, which = stem.rpartition(".")
    if stem == name or which not in (LORA_A, LORA_B) or not module:
        raise ValueError(f"{name!r} is not an adapter tensor (<module>.lora_A.weight or <module>.lora_B.weight)")
    return module, which


def total_bytes(buckets: Sequence[Bucket]) -> int:
    return sum(b.nbytes for b in buckets)


# -- proto conversion -----------------------------------------------------------------------

def tensor_meta(t: PlacedTensor) -> pb.TensorMeta:
    return pb.TensorMeta(name=t.spec.name, shape=list(t.spec.shape), dtype=t.spec.dtype,
                         offset=t.offset, nbytes=t.nbytes)


def lora_to_proto(scaling: Mapping[str, float] | None) -> pb.LoraAdapters | None:
    return None if scaling is None else pb.LoraAdapters(scaling=dict(scaling))


def lora_from_proto(msg, field: str = "lora") -> dict[str, float] | None:
    """The LoraAdapters of a WeightChunk or WeightSyncPlan (None: the sync carries whole
    weights), checked: every scaling a finite number."""
    if not msg.HasField(field):
        return None
    scaling = dict(getattr(msg, field).scaling)
    if not scaling:
        raise ValueError("an adapter sync names no module (LoraAdapters.scaling is empty)")
    bad = [m for m, s in scaling.items() if not math.isfinite(s)]
    if bad:
        raise ValueError(f"LoraAdapters.scaling of {bad[0]!r} is {scaling[bad[0]]}, not a finite number")
    return scaling


def bucket_to_proto(bucket: Bucket) -> pb.WeightBucket:
    return pb.WeightBucket(tensors=[tensor_meta(t) for t in bucket.tensors], nbytes=bucket.nbytes)


def placed_from_proto(metas: Iterable[pb.TensorMeta]) -> tuple[PlacedTensor, ...]:
    """Tensor placements received from the network, checked for consistency (a malformed plan
    is a ValueError, never an out-of-bounds read)."""
    placed = []
    for m in metas:
        spec = TensorSpec(m.name, tuple(int(d) for d in m.shape), m.dtype)
        if any(d < 0 for d in spec.shape) or m.offset < 0 or m.offset % ALIGN_BYTES:
            raise ValueError(f"{m.name}: bad shape {list(m.shape)} or offset {m.offset}")
        if spec.nbytes != m.nbytes:
            raise ValueError(f"{m.name}: {m.nbytes} bytes announced, shape {list(m.shape)} x {m.dtype} is {spec.nbytes}")
        placed.append(PlacedTensor(spec, int(m.offset)))
    return tuple(placed)


def bucket_from_proto(index: int, msg: pb.WeightBucket) -> Bucket:
    placed = placed_from_proto(msg.tensors)
    end = max((t.offset + t.nbytes for t in placed), default=0)
    if end > msg.nbytes:
        raise ValueError(f"bucket {index}: tensors end at byte {end}, past its size {msg.nbytes}")
    return Bucket(index, placed, int(msg.nbytes))
