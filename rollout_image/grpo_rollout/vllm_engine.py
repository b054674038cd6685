"""The vLLM engine: a thin adapter over `vllm.LLM` (the version pinned in pyproject's `vllm`
extra, 0.33.0; the rollout image installs exactly that one).

- Generation: token-id prompts in, `SamplingParams(logprobs=0)` so each output token carries
  its own logprob. `logprobs_mode="processed_logprobs"` makes that the logprob after temperature
  (and after top-k/top-p, which vLLM applies before taking it: with the training defaults
  top_p=1, top_k=-1 it is exactly log_softmax(logits / T), what the trainer recomputes; see
  grpo_rollout.engine). vLLM's default, raw_logprobs, would ignore the temperature.
- Weights: vLLM runs the model in worker processes, so tensors are packed into one byte
  buffer per call and handed to every worker through `LLM.collective_rpc`, where
  `WeightLoaderExtension` (installed with `worker_extension_cls`) unpacks them on the worker's
  device and calls the model's own `load_weights` (which maps Hugging Face names onto vLLM's
  fused layers). The prefix cache is reset afterwards: cached KV of the old weights is stale.

vLLM is imported only when this engine is built. The conversions are pure functions, tested
without vLLM or a GPU (tests/rollout/test_vllm_adapter.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from grpo_rollout.engine import Engine, EngineInfo, Sample, SamplingParams

VLLM_VERSION = "0.33.0"
EXTENSION = "grpo_rollout.vllm_engine.WeightLoaderExtension"

# (name, shape, dtype, offset, nbytes): plain values, so vLLM's RPC serializer passes them as is.
TensorEntry = tuple[str, list[int], str, int, int]


def llm_kwargs(model_path: str, *, dtype: str, seed: int, tokenizer_path: str | None, trust_remote_code: bool,
               tensor_parallel_size: int, gpu_memory_utilization: float, max_model_len: int | None,
               enforce_eager: bool, max_num_batched_tokens: int | None) -> dict[str, Any]:
    kwargs = dict(
        model=model_path, tokenizer=tokenizer_path or model_path, dtype=dtype, seed=seed,
        trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    return kwargs


def sampling_kwargs(params: SamplingParams, prompt_index: int) -> dict[str, Any]:
    """vllm.SamplingParams arguments for one prompt. vLLM gives the n samples of a request seeds
    seed, seed+1, ..., seed+n-1; prompt i starts at seed + i*n, so two identical prompts in one
    batch still get different samples and no seed is shared."""
    return dict(
        n=params.n,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k in (-1, 0) else params.top_k,
        seed=None if params.seed is None else params.seed + prompt_index * params.n,
        stop=list(params.stop) or None,
        logprobs=0,  # the sampled token's own logprob, no alternatives
        skip_special_tokens=True,
    )


def _token_logprob(position: Any, token_id: int) -> float:
    entry = position[token_id]  # {token_id: Logprob}: the sampled token is always present
    return float(entry.logprob)


def samples_from_output(output: Any) -> list[Sample]:
    """One vllm RequestOutput -> its samples in index order."""
    samples = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample with {reason!r} (expected stop or length)")
        token_ids = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError("vLLM returned no logprob for some tokens (SamplingParams.logprobs must be 0)")
        logprobs = [_token_logprob(pos, tok) for pos, tok in zip(completion.logprobs, token_ids)]
        samples.append(Sample(token_ids=token_ids, logprobs=logprobs, finish_reason=reason))
    return samples


def pack_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[bytes, list[TensorEntry]]:
    """Tensors -> one byte string and their entries (the worker extension unpacks it)."""
    entries: list[TensorEntry] = []
    parts: list[bytes] = []
    offset = 0
    for name, tensor in weights:
        data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        entries.append((name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset, len(data)))
        parts.append(data)
        offset += len(data)
    return b"".join(parts), entries


def unpack_tensors(data: bytes, entries: list[TensorEntry], device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    out = []
    for name, shape, dtype, offset, nbytes in entries:
        flat = buffer[offset:offset + nbytes].clone()  # own storage, aligned for the dtype view
        out.append((name, flat.view(getattr(torch, dtype)).reshape(shape).to(device)))
    return out


class WeightLoaderExtension:
    """Mixed into vLLM's GPU worker (worker_extension_cls); its methods run in every worker
    process through `LLM.collective_rpc`."""

    def grpo_load_weights(self, data: bytes, entries: list[TensorEntry]) -> int:
        weights = unpack_tensors(data, entries, self.device)
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)


class VLLMEngine(Engine):
    def __init__(self, model_path: str, *, dtype: str, seed: int, tokenizer_path: str | None = None,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 max_num_batched_tokens: int | None = None):
        import vllm

        if vllm.__version__ != VLLM_VERSION:
            raise RuntimeError(f"grpo_rollout's vLLM adapter is built for vllm=={VLLM_VERSION}, found {vllm.__version__}")
        self._model_path = model_path
        self._llm = vllm.LLM(**llm_kwargs(
            model_path, dtype=dtype, seed=seed, tokenizer_path=tokenizer_path, trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, enforce_eager=enforce_eager, max_num_batched_tokens=max_num_batched_tokens))
        self._tokenizer = self._llm.get_tokenizer()
        self._device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    def info(self) -> EngineInfo:
        return EngineInfo(engine="vllm", model=self._model_path, device=str(self._device), num_parameters=0,
                          capacity=256)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        sampling = [VSamplingParams(**sampling_kwargs(params, i)) for i in range(len(prompt_ids))]
        outputs = self._llm.generate(prompts, sampling, use_tqdm=False)
        return [samples_from_output(o) for o in outputs]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        data, entries = pack_tensors(weights)
        self._llm.collective_rpc("grpo_load_weights", args=(data, entries))
        self._llm.reset_prefix_cache()

    def close(self) -> None:
        shutdown = getattr(self._llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
