"""The generation engine interface: what the rollout server needs from vLLM or transformers.

Behaviour logprobs: every engine reports, for each sampled token, its log-probability under the
distribution it was sampled from *after temperature*, i.e. `log_softmax(logits / T)[token]`.
That is what the trainer recomputes (verl divides the logits by the rollout temperature before
its log_softmax), so the ratio old/behaviour is 1 for an unchanged policy. Top-k/top-p only
select the candidates; greedy decoding (T = 0) reports `log_softmax(logits)` (T = 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from grpo_rollout.cuda_ipc import IpcBuffer, IpcEntry

FinishReason = Literal["stop", "length"]


SLEEP_PARTS = ("weights", "kv_cache")
"""What a sleeping engine frees and a wake-up takes back, by vLLM's memory tags."""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt."""
    max_tokens: int = 16
    """Most tokens generated per sample."""
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    seed: int | None = None
    """Same seed, same prompts, same weights: same samples."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends (finish_reason "stop") once the decoded response contains one."""
    logprobs: bool = True
    """Report each sampled token's behaviour logprob; False: `Sample.logprobs` is None (nothing will
    read them, and vLLM's per-token logprobs cost ~14 % of a generation)."""

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"sampling.n must be >= 1 (got {self.n})")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1 (got {self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 0 (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sample:
    token_ids: list[int]
    """Response tokens, including the EOS token when generation stopped on it."""
    logprobs: list[float] | None
    """One behaviour logprob per response token (see the module docstring); None when
    `SamplingParams.logprobs` is False."""
    finish_reason: FinishReason
    """"stop": EOS or a stop string; "length": max_tokens reached."""
    response_mask: list[int] | None = None
    """Multi-turn (grpo_rollout.agent_loop): 1 for each sampled token, 0 for tool tokens; None: all sampled."""
    agent: dict | None = None
    """Multi-turn: the trajectory's turns and tool calls (names, arguments, errors, latencies)."""
    prompt_ids: list[int] | None = None
    """Multi-turn: the prompt the engine was given, rendered with the tools' schemas; None: the
    prompt shard's prompt_ids."""


@dataclass(frozen=True)
class EngineInfo:
    engine: str
    model: str
    device: str
    num_parameters: int
    capacity: int = field(default=64)
    """Sequences generated at once: a load hint for the trainer's dispatcher."""


@dataclass(frozen=True)
class LoraAdapter:
    """One module's LoRA adapter as an adapter-only sync brings it: the module's weight becomes
    W_base + scaling x B @ A."""
    a: "torch.Tensor"
    """[r, in_features]"""
    b: "torch.Tensor"
    """[out_features, r]"""
    scaling: float


class Engine(ABC):
    """A model that generates, and whose weights can be replaced in place."""

    policy_version: int = 0
    """Version of the weights it holds; -1 while an update is half-applied. The weight receiver
    sets it; the engine only stores it."""

    accepts_images: bool = False
    """`generate` takes `images=` (a vision-language model's, per prompt, as encoded bytes): the hf
    and vLLM engines with a VL model (issue 45)."""

    accepts_lora_adapters: bool = False
    """It applies LoRA adapters itself (`load_lora_adapters`), so a LoRA policy's trainer sends
    it the adapters alone; otherwise the merged weights (rollout.proto's Info)."""

    loads_whole_versions: bool = False
    """`load_weights` must get a version's every tensor in one call (vLLM with FP8 rollouts
    quantizes each layer again once all its shards are in, and a bucket may hold part of a
    layer): the weight receiver keeps the buckets until the last one is in."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        """`params.n` samples for each prompt, in prompt order."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Copy tensors (Hugging Face names, full shapes) into the model. May be called with a
        subset of the parameters (one bucket at a time). An unknown name or a wrong shape is a
        ValueError, raised before anything of that batch is copied."""

    def load_weights_ipc(self, ipc: "IpcBuffer", entries: "list[IpcEntry]") -> None:
        """Copy tensors out of a CUDA buffer that a process on the same GPU shares (the trainer's,
        grpo_rollout.cuda_ipc); returns once the copies are done, so the buffer may be refilled."""
        import torch

        from grpo_rollout import cuda_ipc
        buffer = cuda_ipc.open_buffer(ipc, self.device)
        self.load_weights(cuda_ipc.views(buffer, entries))
        torch.cuda.synchronize(self.device)

    def load_lora_adapters(self, adapters: "Mapping[str, LoraAdapter]") -> None:
        """Make the weights the base model's (as loaded) with `adapters` (by module name) merged
        in: W = W_base + scaling x B @ A in float32, in the engine's dtype; every other weight
        the base's. Bad modules or shapes are a ValueError before anything is copied."""
        raise NotImplementedError(f"{type(self).__name__} takes merged weights only")

    @abstractmethod
    def info(self) -> EngineInfo:
        ...

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Response text as reward functions see it (special tokens skipped, as verl does)."""

    @property
    @abstractmethod
    def device(self) -> "torch.device":
        """Where received weight buffers should live (gloo needs cpu, nccl the engine's GPU)."""

    def sleep(self, level: int) -> bool:
        """Free the GPU memory generation holds, for the trainer that shares the GPU
        (rollout.placement colocated): level 1 the KV cache, level 2 the weights too. Returns
        whether the weights are gone (a full weight sync must then precede generating)."""
        return False

    def wake_up(self, parts: list[str]) -> None:
        """Take back the `parts` of what `sleep` freed (SLEEP_PARTS: "weights", "kv_cache"; dropped
        weights come back as garbage, until a sync)."""

    def close(self) -> None:
        """Release the model (GPU memory, engine processes)."""

