"""Sleep mode of colocated rollout servers (rollout.placement colocated, issue 46; verl's hybrid
engine): trainer rank 0 asks every server to free the GPU memory it shares with the trainer once
the step's rollouts are in, and to take it back before the new weights go out (a server that
dropped its weights, vLLM's level 2, is at an unknown version until that sync: the publisher's
re-sync treats it as one that missed updates). Each transition is timed, as timing_s/sleep and
timing_s/wake.

Only with rollout.maxStaleness 0: with 1, the next step's rollouts are generated while this step
trains, so the engines never idle through an update.

While the engines sleep, the trainer allocates with expandable segments (verl's trainer mode):
the update's activations come and go in every size, and a long-lived tensor left in a large
cached segment would keep the whole segment from the GPU at the wake (measured on an H100 with
model.sharePrompts: 20 GB more held after the update than without, and vLLM's wake-up ran out
of memory). Expandable segments hand back every free page instead. They are off again from the
wake on, so that the weight sync's buckets, which go to the servers by CUDA IPC, are plain
allocations.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
import torch.distributed as dist

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.spec import GRPOJobSpec

log = logging.getLogger("grpo.trainer")

SLEEP_LEVEL = 2
"""vLLM's level 2: the weights go too, since the trainer sends new ones after every update anyway."""
TIMEOUT_SECONDS = 300.0


class EngineSleep:
    def __init__(self, spec: GRPOJobSpec, servers, *, rank: int):
        """`servers`: rank 0's RolloutServers (None on the other ranks, which only time nothing)."""
        self.enabled = spec.colocated and spec.rollout.max_staleness == 0
        self.servers = servers if rank == 0 else None

    def sleep(self) -> dict[str, float]:
        timings = self._all("sleep", lambda stub: stub.Sleep(pb.SleepRequest(level=SLEEP_LEVEL), timeout=TIMEOUT_SECONDS))
        if self.enabled:
            expandable_segments(True)
        return timings

    def wake(self, parts: tuple[str, ...] = ()) -> dict[str, float]:
        """Collective: every rank first hands what the update left in torch's caching allocator
        back to its GPU, where a server takes it back (else vLLM's wake-up could run out of
        memory that the trainer holds but doesn't use). `parts`: vLLM's memory tags to take back
        ("weights" before a weight sync; the KV cache then wakes with the next Generate, once
        trainer.paramOffload moved the policy off the GPU); none: all. timing_s/wake includes
        handing the cache back (empty_cache waits for the update's last kernels, then frees its
        segments)."""
        started = time.perf_counter()
        if self.enabled:
            expandable_segments(False)
            if _cuda_in_use():
                torch.cuda.empty_cache()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
        return self._all("wake", lambda stub: stub.WakeUp(pb.WakeUpRequest(parts=parts), timeout=TIMEOUT_SECONDS),
                         started=started)

    def _all(self, what: str, call, *, started: float | None = None) -> dict[str, float]:
        """`call` on every server at once; the step's wall time of the transition (from `started`,
        else from now). A server that fails to answer is logged, not fatal: a Generate or a weight
        sync wakes it anyway, and one that is gone is the pod's failure (grpo_trainer.colocate)."""
        if not self.enabled:
            return {}
        if started is None:
            started = time.perf_counter()
        if self.servers is not None:
            addresses = self.servers.addresses()
            with ThreadPoolExecutor(max_workers=max(len(addresses), 1)) as pool:
                futures = {a: pool.submit(call, self.servers.clients(a)) for a in addresses}
            for address, future in futures.items():
                try:
                    future.result()
                except grpc.RpcError as exc:
                    log.warning("rollout server %s did not %s: %s%s", address, what, exc.details() or exc.code(),
                                _gpu_memory_line())
        return {f"timing_s/{what}": time.perf_counter() - started}


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def expandable_segments(enable: bool) -> None:
    """For the allocations that follow (segments already made keep their kind). Also
    bench/h200_bench.py train --allocator sleep's."""
    if _cuda_in_use():
        torch._C._accelerator_setAllocatorSettings(f"expandable_segments:{enable}")


def _gpu_memory_line() -> str:
    """Where a wake-up that ran out of memory should look: what this trainer process holds."""
    if not _cuda_in_use():
        return ""
    free, total = torch.cuda.mem_get_info()
    return (f" (this GPU: {free / 1e9:.1f} of {total / 1e9:.1f} GB free; the trainer holds "
            f"{torch.cuda.memory_reserved() / 1e9:.1f} GB, {torch.cuda.memory_allocated() / 1e9:.1f} GB of it in tensors)")
