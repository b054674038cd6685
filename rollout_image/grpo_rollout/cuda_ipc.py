"""Weights read straight out of the trainer's GPU memory, when the trainer and this server share
a GPU (backend "cuda_ipc", docs/ARCHITECTURE.md §6). The trainer keeps its rollout-dtype weights in one
buffer for its whole life and shares it once; this side maps it once and copies from it, GPU to
GPU, at every update. This is how verl's and OpenRLHF's colocated updates work (torch's CUDA IPC
through `torch.multiprocessing.reductions`), minus the pickling: the handle travels as plain
bytes and integers in the WeightSyncPlan, and the types are filled in here.

The vLLM engine uses the same functions inside its worker processes, which are the ones that
hold the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID ("" off GPU): two processes on one GPU see the same one, whatever their
    CUDA_VISIBLE_DEVICES numbering."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass(frozen=True)
class IpcBuffer:
    """A shared CUDA allocation: the fields of pb.CudaIpcBuffer (plain values, so vLLM's RPC
    passes them to its workers as they are)."""
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str

    @classmethod
    def from_proto(cls, msg) -> "IpcBuffer":
        return cls(bytes(msg.handle), int(msg.size_bytes), int(msg.offset_bytes), bytes(msg.ref_counter_handle),
                   int(msg.ref_counter_offset), bytes(msg.event_handle), bool(msg.event_sync_required),
                   msg.device_uuid)

    def as_tuple(self) -> tuple:
        return (self.handle, self.size_bytes, self.offset_bytes, self.ref_counter_handle, self.ref_counter_offset,
                self.event_handle, self.event_sync_required, self.device_uuid)


def share(buffer: torch.Tensor) -> IpcBuffer:
    """Export a contiguous CUDA uint8 tensor of this process (it must outlive every reader)."""
    from torch.multiprocessing.reductions import reduce_tensor
    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.storage_offset() != 0:
        raise ValueError("only a whole CUDA uint8 buffer can be shared")
    _, args = reduce_tensor(buffer)
    (_, _, _, _, _, _, _, handle, size, offset, _, ref_handle, ref_offset, event_handle, event_sync) = args
    return IpcBuffer(handle, size, offset, ref_handle, ref_offset, event_handle, event_sync,
                     device_uuid(buffer.device))


_mapped: dict[bytes, torch.Tensor] = {}


def open_buffer(ipc: IpcBuffer, device: torch.device, *, keep: bool = True) -> torch.Tensor:
    """The shared buffer as a uint8 tensor on `device` (which must be the exporter's GPU).
    `keep`: map it once and reuse the mapping for later updates (the trainer's long-lived
    buffer); a newer buffer from the same exporter replaces it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    if device_uuid(device) != ipc.device_uuid:
        raise ValueError(f"CUDA IPC buffer is on GPU {ipc.device_uuid}, this process is on {device_uuid(device) or device}")
    if ipc.handle in _mapped:
        return _mapped[ipc.handle]
    tensor = rebuild_cuda_tensor(
        torch.Tensor, (ipc.size_bytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8, device.index, ipc.handle,
        ipc.size_bytes, ipc.offset_bytes, False, ipc.ref_counter_handle, ipc.ref_counter_offset, ipc.event_handle,
        ipc.event_sync_required)
    if keep:
        _mapped.clear()   # one trainer buffer at a time: a restarted trainer shares a new one
        _mapped[ipc.handle] = tensor
    return tensor


# (name, shape, dtype, byte offset in the whole buffer): plain values, as vLLM's RPC needs.
IpcEntry = tuple[str, list[int], str, int]


def views(buffer: torch.Tensor, entries: list[IpcEntry]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, shape, dtype, offset in entries:
        dt = getattr(torch, dtype)
        nbytes = dt.itemsize
        for d in shape:
            nbytes *= d
        out.append((name, buffer[offset:offset + nbytes].view(dt).reshape(shape)))
    return out
