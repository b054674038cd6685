"""trainer.paramOffload and trainer.optimizerOffload (verl: actor.fsdp_config.param_offload and
optimizer_offload), for rollout.placement colocated: the policy's FSDP2 shards and its optimizer
state leave the GPU for CPU memory while the rollout engines generate on it, and come back for the
update. The engines' KV cache wakes only after the offload (the weight sync wakes their weights
alone: grpo_rollout.worker), so a high rollout.gpuMemoryUtilization fits beside what the trainer
keeps (the reference model, unless trainer.refCpuOffload).

FSDP2's module `_apply` re-registers the moved shards, so `model.to(...)` is the whole move; the
copies are non-blocking and ordered on the current stream, then synchronized once (the timing is
the real cost, and the memory is free before the engines take it)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class PhaseOffload:
    """Each rank's own policy shards and optimizer state: `offload()` before generating, `onload()`
    before the update; both idempotent, timed (timing_s/offload, timing_s/onload). A no-op off GPU."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, params: bool,
                 optimizer_state: bool, device: torch.device):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.params, self.optimizer_state = params, optimizer_state
        self.enabled = (params or optimizer_state) and device.type == "cuda"
        self.offloaded = False
        self._moved_state: list[tuple[dict, str]] = []   # the optimizer state tensors that were on the GPU

    def offload(self) -> dict[str, float]:
        if not self.enabled or self.offloaded:
            return {}
        return self._move(torch.device("cpu"), "timing_s/offload", offloaded=True)

    def onload(self) -> dict[str, float]:
        if not self.enabled or not self.offloaded:
            return {}
        return self._move(self.device, "timing_s/onload", offloaded=False)

    @contextlib.contextmanager
    def off_gpu(self) -> Iterator[None]:
        """Offloaded for the block (validation's generation), on the GPU again after it."""
        self.offload()
        try:
            yield
        finally:
            self.onload()

    @torch.no_grad()
    def _move(self, to: torch.device, timing: str, *, offloaded: bool) -> dict[str, float]:
        started = time.perf_counter()
        if self.params:
            self.model.to(to, non_blocking=True)
        if self.optimizer_state:
            self._move_optimizer_state(to)
        torch.cuda.synchronize(self.device)
        if offloaded:
            torch.cuda.empty_cache()       # the freed blocks back to the GPU, for the engines
        self.offloaded = offloaded
        return {timing: time.perf_counter() - started}

    def _move_optimizer_state(self, to: torch.device) -> None:
        """The per-parameter state's GPU tensors (Adam's moments; its step where fused) to `to`, and
        back to the GPU only those: a CPU step stays on the CPU, as the optimizer made it."""
        if to.type == "cpu":
            self._moved_state = [(state, key) for state in self.optimizer.state.values()
                                 for key, value in state.items()
                                 if isinstance(value, torch.Tensor) and value.device.type == "cuda"]
        for state, key in self._moved_state:
            state[key] = state[key].to(to, non_blocking=True)
