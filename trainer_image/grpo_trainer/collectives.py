"""What rank 0 decides, and what each rank knows, shared as JSON over tensor collectives: never
pickled (no `broadcast_object_list` and kin: docs/RELIABILITY.md, Security)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def broadcast_json(obj, device: torch.device):
    """Rank 0's `obj` on every rank, as JSON bytes (never pickle)."""
    if dist.get_world_size() == 1:
        return obj
    data = json.dumps(obj).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def all_gather_json(obj, device: torch.device) -> list:
    """Every rank's `obj`, in rank order, on every rank (JSON bytes, padded to the longest)."""
    world = dist.get_world_size()
    if world == 1:
        return [obj]
    data = json.dumps(obj).encode()
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    buf = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [json.loads(b[:int(n)].cpu().numpy().tobytes().decode()) for b, n in zip(bufs, sizes)]


class SetupError(RuntimeError):
    """The run can't start (bad data, unwritable storage, a tracker that refuses its run); the
    message says what to fix."""


def from_rank0(decide: Callable[[], Any], device: torch.device, *,
               setup_errors: tuple[type[Exception], ...] = ()) -> Any:
    """What `decide()` returns on rank 0 (JSON), on every rank; the other ranks don't call it.
    If it raises one of `setup_errors`, every rank raises SetupError with its message. Any other
    exception is raised on rank 0 and, on the others, a RuntimeError naming it: no rank is left
    waiting for rank 0 in the next collective."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = {"value": decide()}
        except setup_errors as exc:
            outcome = {"setup_error": str(exc)}
        except Exception as exc:
            broadcast_json({"error": repr(exc)}, device)
            raise
    outcome = broadcast_json(outcome, device)
    if "setup_error" in outcome:
        raise SetupError(outcome["setup_error"])
    if "error" in outcome:
        raise RuntimeError(f"rank 0 failed: {outcome['error']}")
    return outcome["value"]
