"""The vLLM engine: a thin adapter over `vllm.LLM` (the version pinned in pyproject's `vllm`
extra, 0.26.x, the newest that runs on torch 2.11; the rollout image installs exactly that
one, and bench/vllm_check.py is what ran it on an H200).

- Generation: token-id prompts in, `SamplingParams(logprobs=0)` so each output token carries
  its own logprob (none when the request asks for none: they cost ~0.6 s of a 4.4 s generation).
  `logprobs_mode="processed_logprobs"` makes that the logprob after temperature
  (and after top-k/top-p, which vLLM applies before taking it: with the training defaults
  top_p=1, top_k=-1 it is exactly log_softmax(logits / T), what the trainer recomputes; see
  grpo_rollout.engine). vLLM's default, raw_logprobs, would ignore the temperature.
- Weights: vLLM runs the model in worker processes. `WeightLoaderExtension` (installed with
  `worker_extension_cls`) runs in each of them through `LLM.collective_rpc` and calls the
  model's own `load_weights` (which maps Hugging Face names onto vLLM's fused layers). The
  tensors reach it through CUDA IPC (grpo_rollout.cuda_ipc), GPU to GPU: straight from the
  trainer's buffer when the trainer shares the GPU (`load_weights_ipc`), or from one buffer
  this process fills with what arrived by NCCL or gRPC (`load_weights`). With tensor
  parallelism (workers on several GPUs) they travel as one byte string instead. The prefix
  cache is reset afterwards: cached KV of the old weights is stale.

- LoRA: `grpo rollout` takes a LoRA policy as merged weights (W + scaling x B @ A through the
  paths above; `accepts_lora_adapters` False). Built with `max_lora_rank`, the engine runs vLLM's
  own LoRA (`enable_lora`, one adapter at a time) and takes adapter-only syncs: each version's
  adapters are written as a PEFT folder (`write_peft_adapter`, on /dev/shm where there is one),
  added at once under a new lora_int_id (a bad adapter fails the sync, not a later generate),
  the previous one removed, and every generate call carries that LoRARequest. Merged weights
  load into it too (the wrapped layers' weights are `<module>.base_layer.weight` there:
  `lora_base_names`). On the H200 (bench/RESULTS.md, 2026-12-02 fourth session) adapter and merged
  log-probs agree (mean abs 0.025, against 0.86 to the base), but the LoRA engine generates 256 x
  512 in 6.1-7.1 s against 5.45 s without LoRA and starts in 168 s against ~90: `grpo rollout`
  keeps taking LoRA policies as merged weights into an engine without LoRA.

- Images (a vision-language model, issue 45): a prompt's ids hold each image's placeholder run
  widened to the image's token count (what the trainer's processor made); vLLM widens a single
  `<|image_pad|>` itself from the image it is given (`multi_modal_data`), as verl's
  raw_prompt_ids give it, so each run is narrowed back to one token (`narrow_image_runs`). The
  image and video placeholders are never sampled (`logit_bias` -100: the trainer counts every
  placeholder of a row against its images).

vLLM is imported only when this engine is built. The conversions are pure functions, tested
without vLLM or a GPU (tests/rollout/test_vllm_adapter.py).
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_rollout import cuda_ipc
from grpo_rollout.engine import Engine, EngineInfo, LoraAdapter, Sample, SamplingParams

log = logging.getLogger("grpo_rollout.vllm")

VLLM_VERSIONS = "0.26."
"""The vLLM releases this adapter runs with (a prefix of vllm.__version__)."""
EXTENSION = "grpo_rollout.vllm_engine.WeightLoaderExtension"
VLLM_QUANTIZATION = {"fp8": {"quantization": "fp8_per_block", "quantization_config": {"ignore": [r"re:.*mlp\.gate$"]}}}
"""spec.rollout.quantization -> vLLM's arguments. verl's FP8 scheme (128x128 weight blocks, dynamic
activations, the MoE routers `mlp.gate` left unquantized) is vLLM 0.26's online fp8_per_block with
those layers ignored."""

# (name, shape, dtype, offset, nbytes): plain values, so vLLM's RPC serializer passes them as is.
TensorEntry = tuple[str, list[int], str, int, int]


def llm_kwargs(model_path: str, *, dtype: str, seed: int, tokenizer_path: str | None, trust_remote_code: bool,
               tensor_parallel_size: int, gpu_memory_utilization: float, max_model_len: int | None,
               enforce_eager: bool, max_num_batched_tokens: int | None,
               quantization: str | None = None, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    kwargs = dict(
        model=model_path, tokenizer=tokenizer_path or model_path, dtype=dtype, seed=seed,
        trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION, kv_cache_dtype=kv_cache_dtype,
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if quantization is not None:
        kwargs.update(VLLM_QUANTIZATION[quantization])
    return kwargs


def single_token_stops(tokenizer: Any, stops: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """Stop strings that are one token of the vocabulary (Qwen3's `</tool_call>`, `</answer>` in many
    templates) as token ids, the rest as strings. vLLM has to detokenize every response to find
    a stop string, which cost 6 s of 13 in the agent loop's 256 x 4 turns on an H200
    (bench/RESULTS.md); a stop token id is checked on the sampled id. The response's ids are
    the same either way: both end with the stop's token."""
    ids, strings = [], []
    for stop in stops:
        encoded = tokenizer.encode(stop, add_special_tokens=False) if tokenizer is not None else []
        if len(encoded) == 1 and tokenizer.decode(encoded, skip_special_tokens=False) == stop:
            ids.append(encoded[0])
        else:
            strings.append(stop)
    return ids, strings


def sampling_kwargs(params: SamplingParams, tokenizer: Any = None) -> dict[str, Any]:
    """vllm.SamplingParams arguments (the same for every prompt). No per-request seed: vLLM samples a seeded
    request with its own generator, one kernel per sequence and decode step, which cost 2.4 s of
    7.0 for 256 x 512 tokens on an H200 (bench/RESULTS.md). The engine's seed (LLM(seed=...),
    rollout.seed) makes a server's sequence of samples reproducible instead; `params.seed`
    (the per-shard seed the server derives) is honoured by the hf engine only. With `tokenizer`,
    single-token stop strings become stop token ids (`single_token_stops`)."""
    stop_ids, stops = single_token_stops(tokenizer, tuple(params.stop))
    return dict(
        n=params.n,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k in (-1, 0) else params.top_k,
        stop=stops or None,
        stop_token_ids=stop_ids or None,
        logprobs=0 if params.logprobs else None,  # the sampled token's own logprob, no alternatives
        skip_special_tokens=True,
        detokenize=bool(stops),  # text is decoded for the rewards anyway; stop strings need it here
    )


def narrow_image_runs(prompt_ids: list[int], image_token_id: int) -> list[int]:
    """Each run of `image_token_id` as one token: vLLM's processor widens one placeholder per image."""
    return [t for i, t in enumerate(prompt_ids) if t != image_token_id or i == 0 or prompt_ids[i - 1] != image_token_id]


def _token_logprob(position: Any, token_id: int) -> float:
    entry = position[token_id]  # {token_id: Logprob}: the sampled token is always present
    return float(entry.logprob)


def samples_from_output(output: Any, logprobs: bool = True) -> list[Sample]:
    """One vllm RequestOutput -> its samples in index order; `logprobs`: they were asked for
    (else the samples' are None)."""
    samples = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample with {reason!r} (expected stop or length)")
        token_ids = list(completion.token_ids)
        if not logprobs:
            samples.append(Sample(token_ids=token_ids, logprobs=None, finish_reason=reason))
            continue
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError("vLLM returned no logprob for some tokens (SamplingParams.logprobs must be 0)")
        values = [_token_logprob(pos, tok) for pos, tok in zip(completion.logprobs, token_ids)]
        samples.append(Sample(token_ids=token_ids, logprobs=values, finish_reason=reason))
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


def pack_on_device(weights: Iterable[tuple[str, torch.Tensor]], device: torch.device
                   ) -> tuple[torch.Tensor, list[cuda_ipc.IpcEntry]]:
    """Tensors -> one uint8 buffer on `device` (64-byte aligned offsets) and their entries."""
    weights = list(weights)
    entries: list[cuda_ipc.IpcEntry] = []
    offset = 0
    for name, tensor in weights:
        entries.append((name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset))
        offset += -(-tensor.numel() * tensor.element_size() // 64) * 64
    buffer = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
    for (_, tensor), (_, _, _, start) in zip(weights, entries):
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        buffer[start:start + flat.numel()].copy_(flat, non_blocking=True)
    return buffer, entries


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.26 accepts (vllm.config.lora.MaxLoRARanks)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    fitting = [r for r in LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"spec.model.lora.rank {rank}: vLLM takes adapters of rank <= {LORA_RANKS[-1]} "
                         "(set model.lora.merge: true to send merged weights instead)")
    return fitting[0]


def write_peft_adapter(adapters: "Mapping[str, LoraAdapter]", folder: Path) -> None:
    """`adapters` (by module name, grpo_api.weights' naming) as a PEFT adapter folder, the layout
    vLLM's LoRA loader (and PEFT) read: adapter_model.safetensors with
    `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`, and adapter_config.json whose
    lora_alpha / r is the adapters' scaling. One rank and one scaling for all (a PEFT config has one)."""
    from safetensors.torch import save_file

    if not adapters:
        raise ValueError("an adapter sync without adapters")
    ranks = {a.a.shape[0] for a in adapters.values()}
    scalings = {a.scaling for a in adapters.values()}
    if len(ranks) != 1 or len(scalings) != 1:
        raise ValueError(f"LoRA adapters of ranks {sorted(ranks)} and scalings {sorted(scalings)}: vLLM takes one "
                         "rank and one scaling per adapter")
    rank, scaling = ranks.pop(), scalings.pop()
    tensors = {}
    for module, a in adapters.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.a.detach().to("cpu").contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = a.b.detach().to("cpu").contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scaling * rank,
              "target_modules": sorted({m.rpartition(".")[2] for m in adapters}), "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None,
              "base_model_name_or_path": None}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def environment_defaults() -> None:
    """Settings this adapter needs before vLLM is imported (a user's own values win)."""
    # This process touches CUDA (the engine's device, IPC buffers) before vLLM starts its
    # workers, so they must be spawned, not forked.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # Without FlashInfer installed, vLLM 0.26's sampler still imports it; its torch sampler
    # is the one to use then.
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def lora_base_names(names: Iterable[str], param_names: Iterable[str], packed_modules: Mapping[str, list[str]]
                    ) -> dict[str, str]:
    """Hugging Face weight names -> the names a LoRA-enabled vLLM model loads them under.

    vLLM's LoRA wraps each adapted layer, so its weight becomes `<module>.base_layer.weight`, and
    the model's own `load_weights` (which maps `q_proj` onto the fused `qkv_proj` by substring)
    no longer finds `<module>.weight`. `q_proj.weight` renamed `q_proj.base_layer.weight` maps onto
    `qkv_proj.base_layer.weight`: the fused layer is found through the model's
    `packed_modules_mapping` (fused name -> its parts). Names of layers that aren't wrapped stay."""
    wrapped = {p[: -len(".base_layer.weight")] for p in param_names if p.endswith(".base_layer.weight")}
    if not wrapped:
        return {}
    fused = {part: whole for whole, parts in packed_modules.items() for part in parts}
    out = {}
    for name in names:
        module, dot, leaf = name.rpartition(".")
        if not dot or leaf not in ("weight", "bias"):
            continue
        parent, dot, last = module.rpartition(".")
        if parent + dot + fused.get(last, last) in wrapped:
            out[name] = f"{module}.base_layer.{leaf}"
    return out


class WeightLoaderExtension:
    """Mixed into vLLM's GPU worker (worker_extension_cls); its methods run in every worker
    process through `LLM.collective_rpc`."""

    def _load(self, weights: list[tuple[str, torch.Tensor]], requantize: bool = False) -> None:
        """The model's own load_weights, with the names of LoRA-wrapped layers mapped (lora_base_names).
        requantize (a quantized engine, which takes a whole version in one call): inside vLLM's
        layerwise reload, which puts each layer back in checkpoint layout, takes the model.dtype
        weights and quantizes the layer again, with its first load's code, into the same storage
        (captured CUDA graphs read it) once all its shards are in. A bare load_weights fails on the
        transposed FP8 weights (bench/RESULTS.md, "FP8 rollouts on vLLM 0.26")."""
        # The reload needs the model itself (under the CUDA-graph wrapper, as vLLM's own reload takes it);
        # plain loads go through the wrapper, as they ran on the H200.
        model = self.model_runner.get_model() if requantize else self.model_runner.model
        if not hasattr(self, "_grpo_names"):
            self._grpo_names = ([n for n, _ in model.named_parameters()], getattr(model, "packed_modules_mapping", {}))
        params, packed = self._grpo_names
        renamed = lora_base_names([n for n, _ in weights], params, packed)
        weights = [(renamed.get(n, n), t) for n, t in weights] if renamed else weights
        if not requantize:
            model.load_weights(weights=weights)
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        initialize_layerwise_reload(model)
        model.load_weights(weights=weights)
        finalize_layerwise_reload(model, self.model_runner.model_config)

    def grpo_load_weights(self, data: bytes, entries: list[TensorEntry], requantize: bool = False) -> int:
        weights = unpack_tensors(data, entries, self.device)
        self._load(weights, requantize)
        return len(weights)

    def grpo_load_ipc(self, ipc: tuple, entries: list, keep: bool, requantize: bool = False) -> int:
        """Copy from a CUDA buffer another process on this GPU shares; `keep` maps it for good
        (the trainer's long-lived buffer), else the mapping is dropped once copied."""
        buffer = cuda_ipc.open_buffer(cuda_ipc.IpcBuffer(*ipc), self.device, keep=keep)
        weights = cuda_ipc.views(buffer, [tuple(e) for e in entries])
        self._load(weights, requantize)
        torch.cuda.synchronize(self.device)   # the sender may reuse its buffer once we return
        return len(weights)


class VLLMEngine(Engine):
    def __init__(self, model_path: str, *, dtype: str, seed: int, tokenizer_path: str | None = None,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 max_num_batched_tokens: int | None = None, max_lora_rank: int | None = None,
                 enable_sleep_mode: bool = False, quantization: str | None = None, kv_cache_dtype: str = "auto"):
        """max_lora_rank: run vLLM's LoRA and take adapter-only syncs of adapters up to that rank.
        enable_sleep_mode: vLLM's sleep mode (its CuMem allocator), for `sleep` (colocated placement).
        quantization: spec.rollout.quantization (VLLM_QUANTIZATION); each weight sync is then
        quantized again as a whole version (`loads_whole_versions`).
        kv_cache_dtype: spec.rollout.kvCacheDtype, vLLM's own values ("fp8": e4m3, scales 1.0)."""
        if quantization is not None and max_lora_rank is not None:
            raise ValueError("a quantized engine takes merged weights only (no max_lora_rank)")
        environment_defaults()
        import vllm

        if not vllm.__version__.startswith(VLLM_VERSIONS):
            raise RuntimeError(f"grpo_rollout's vLLM adapter runs with vllm {VLLM_VERSIONS}x, found {vllm.__version__}")
        self._model_path = model_path
        self._tensor_parallel = tensor_parallel_size
        self._llm = vllm.LLM(**llm_kwargs(
            model_path, dtype=dtype, seed=seed, tokenizer_path=tokenizer_path, trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, enforce_eager=enforce_eager, max_num_batched_tokens=max_num_batched_tokens,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype),
            **({"enable_sleep_mode": True} if enable_sleep_mode else {}),
            **({} if max_lora_rank is None else dict(enable_lora=True, max_loras=1,
                                                     max_lora_rank=vllm_max_lora_rank(max_lora_rank))))
        config = self._llm.llm_engine.vllm_config
        # What a benchmark reads back: vLLM's own startup lines don't reach the server's log
        log.info("vLLM %s: dtype %s, weights %s, KV cache %s (%d blocks of %d tokens), gpu_memory_utilization %s",
                 vllm.__version__, config.model_config.dtype, config.model_config.quantization or "unquantized",
                 config.cache_config.cache_dtype, config.cache_config.num_gpu_blocks or 0,
                 config.cache_config.block_size, gpu_memory_utilization)
        self.accepts_lora_adapters = max_lora_rank is not None
        self.loads_whole_versions = quantization is not None
        self._lora = None            # the LoRARequest of the adapters every generate call applies
        self._lora_versions = 0
        shm = Path("/dev/shm")
        self._lora_root = Path(tempfile.mkdtemp(prefix="grpo-lora-", dir=shm if shm.is_dir() else None)) \
            if max_lora_rank is not None else None
        self._tokenizer = self.tokenizer = self._llm.get_tokenizer()   # the agent loop renders tool turns with it
        # A vision-language model takes the prompts' images (module docstring).
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._image_token = getattr(config, "image_token_id", None) if getattr(config, "vision_config", None) else None
        self.accepts_images = self._image_token is not None
        self._unsampled = {t: -100.0 for t in (self._image_token, getattr(config, "video_token_id", None))
                           if self.accepts_images and t is not None}
        self._device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    def sleep(self, level: int) -> bool:
        """vLLM's sleep mode: level 1 offloads the weights to host memory and discards the KV
        cache; level 2 discards both (the trainer sends the weights again anyway)."""
        self._llm.sleep(level=level)
        return level >= 2

    def wake_up(self, parts: list[str]) -> None:
        # Explicit tags, never None: vLLM maps every pool again on None, awake ones included.
        self._llm.wake_up(tags=parts)
        if "kv_cache" in parts and hasattr(self._llm, "reset_prefix_cache"):
            self._llm.reset_prefix_cache()     # cached prefixes were computed by the old weights

    def info(self) -> EngineInfo:
        return EngineInfo(engine="vllm", model=self._model_path, device=str(self._device), num_parameters=0,
                          capacity=256)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 images: list[list[bytes]] | None = None) -> list[list[Sample]]:
        """`images`: a VL model's, per prompt, as encoded bytes, one for each image-token run of its ids."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if images is not None and not self.accepts_images:
            raise ValueError(f"{self._model_path} is not a vision-language model: it takes no images")
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        if images is not None:
            from PIL import Image
            prompts = [TokensPrompt(prompt_token_ids=narrow_image_runs(ids, self._image_token),
                                    multi_modal_data={"image": [Image.open(io.BytesIO(b)).convert("RGB") for b in row]})
                       if row else prompt for ids, row, prompt in zip(prompt_ids, images, prompts)]
        sampling = VSamplingParams(**sampling_kwargs(params, self._tokenizer), logit_bias=self._unsampled or None)
        outputs = self._llm.generate(prompts, sampling, use_tqdm=False, lora_request=self._lora)
        return [samples_from_output(o, params.logprobs) for o in outputs]

    def load_lora_adapters(self, adapters: Mapping[str, LoraAdapter]) -> None:
        if not self.accepts_lora_adapters:
            return super().load_lora_adapters(adapters)
        from vllm.lora.request import LoRARequest

        self._lora_versions += 1
        folder = self._lora_root / f"v{self._lora_versions}"
        write_peft_adapter(adapters, folder)
        request = LoRARequest(f"policy-{self._lora_versions}", self._lora_versions, str(folder))
        try:
            # Loaded now (vLLM would load it at its first request): a bad adapter fails this sync.
            self._llm.llm_engine.add_lora(request)
        except Exception as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(f"vLLM refused the LoRA adapters: {exc}") from exc
        self._drop_lora()
        self._lora = request
        self._llm.reset_prefix_cache()

    def _drop_lora(self) -> None:
        if self._lora is not None:
            self._llm.llm_engine.remove_lora(self._lora.lora_int_id)
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
            self._lora = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._drop_lora()      # merged weights are the whole policy
        if self._tensor_parallel > 1 or self._device.type != "cuda":
            data, entries = pack_tensors(weights)
            self._llm.collective_rpc("grpo_load_weights", args=(data, entries, self.loads_whole_versions))
        else:
            buffer, entries = pack_on_device(weights, self._device)
            torch.cuda.synchronize(self._device)
            self._llm.collective_rpc("grpo_load_ipc", args=(cuda_ipc.share(buffer).as_tuple(), entries, False,
                                                            self.loads_whole_versions))
            del buffer
        self._llm.reset_prefix_cache()

    def load_weights_ipc(self, ipc: cuda_ipc.IpcBuffer, entries: list[cuda_ipc.IpcEntry]) -> None:
        if self._tensor_parallel > 1:
            raise ValueError("backend cuda_ipc needs rollout.tensorParallelSize 1 (the workers are on other GPUs)")
        self._drop_lora()
        self._llm.collective_rpc("grpo_load_ipc", args=(ipc.as_tuple(), entries, True, self.loads_whole_versions))
        self._llm.reset_prefix_cache()

    def close(self) -> None:
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)
        shutdown = getattr(self._llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
