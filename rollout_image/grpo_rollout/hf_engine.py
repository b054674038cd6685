"""The transformers engine: CPU, development and tests (vLLM is the production engine).

A plain sampling loop over a Hugging Face causal LM with a KV cache: prompts left-padded into
one batch (each repeated n times), one forward per new token. Written out rather than calling
`model.generate` because the behaviour logprob of every sampled token must be exactly the one
the sampler used (see grpo_rollout.engine), and reproducibility must not depend on
transformers' logits-processor defaults.

On a GPU a decode step is hundreds of small kernels that Python launches slower than the GPU
runs them, so the step is captured once per batch as a CUDA graph and replayed. That needs fixed
shapes and addresses: the KV cache is allocated once for the whole batch (`_SlotCache`; a
DynamicCache also copies all of it at every token) and attention is masked over all its slots.
A decode step's attention reads each key/value head once for all the query heads that share it
(`_decode_attention`; sdpa with a padding mask would first copy every key/value head
`heads / kv_heads` times). Models with sliding-window layers keep transformers' DynamicCache
and run eagerly: their sliding layers need masks this engine doesn't build.
"""

from __future__ import annotations

import inspect
import io
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from grpo_rollout.engine import Engine, EngineInfo, Sample, SamplingParams

log = logging.getLogger(__name__)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude from `scaled` ([batch, vocab] logits already
    divided by the temperature). The most likely token always survives."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next tokens and their behaviour logprobs (None unless `params.logprobs`) for float32
    `logits` [batch, vocab]. The tokens drawn are the same either way."""
    if params.greedy:
        tokens, scaled = logits.argmax(dim=-1), logits
    else:
        scaled = logits / params.temperature
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    if not params.logprobs:
        return tokens, None
    return tokens, scaled.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]


ATTENTION = "grpo_decode_sdpa"


def _decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the cache slots the mask covers (the static cache's later slots are not
    written yet). One query token: two batched matmuls that read each key/value head once for
    all the query heads sharing it (sdpa would copy the cache per query head or run a kernel made
    for long queries). Longer queries (the prefill): sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if attention_mask is not None and attention_mask.shape[-1] < key.shape[2]:
        key, value = key[:, :, :attention_mask.shape[-1]], value[:, :, :attention_mask.shape[-1]]
    batch, heads, q_len, dim = query.shape
    if q_len != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)      # query heads by key/value head
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * (dim ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        scores = (scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool
                  else scores + attention_mask)
    out = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTENTION, _decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)   # masks from 2-D ones: as sdpa's


def _auto_class(config):
    """transformers' Auto class of the generating model: a VL config's is the image-text-to-text one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def _full_attention_only(config) -> bool:
    types = getattr(config, "layer_types", None) or ["full_attention"]
    return getattr(config, "sliding_window", None) is None and all(t == "full_attention" for t in types)


class _SlotCache:
    """The KV cache of one batch, duck-typing transformers' Cache: keys and values in
    [b, kv_heads, slots, head_dim] buffers allocated at the first write, every forward writing its
    tokens at the cache slots in `self.slots` (the engine sets it; a fixed buffer under CUDA
    graphs). transformers' StaticCache picks the slots itself, and not the same way in every 5.x
    release (5.17 appends at a counter it keeps on the device)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slots: torch.Tensor | None = None
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx not in self.keys:
            b, heads, _, _ = key_states.shape
            self.keys[layer_idx] = key_states.new_zeros(b, heads, self.capacity, key_states.shape[-1])
            self.values[layer_idx] = value_states.new_zeros(b, heads, self.capacity, value_states.shape[-1])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys, values


class _SlotDecode:
    """One decode step over a _SlotCache with fixed input buffers and a mask over every slot (the
    engine's own `real` buffer, updated in place between steps). On a GPU the step is captured as
    a CUDA graph and replayed: it is hundreds of small kernels that Python launches slower than
    the GPU runs them."""

    def __init__(self, model, cache_kwarg: str, cache: _SlotCache, real: torch.Tensor, first_slot: int,
                 capture: bool):
        dev, b = real.device, real.shape[0]
        self.tokens = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.slot = torch.full((1,), first_slot, dtype=torch.long, device=dev)
        cache.slots = self.slot
        self.model, self.graph = model, None
        self.kwargs = {"input_ids": self.tokens, "position_ids": self.positions, "cache_position": self.slot,
                       "attention_mask": real[:, None, None, :], "use_cache": True, cache_kwarg: cache}
        if capture:
            try:
                self._capture(dev)
            except RuntimeError as exc:   # a forward that syncs or changes shapes: run eagerly
                log.warning("hf engine: decoding without a CUDA graph (capturing the step failed: %s)", exc)

    def _capture(self, dev: torch.device) -> None:
        # Warm-up on a side stream, as capture wants; it writes slot `first_slot`, which the first
        # real step overwrites.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(**self.kwargs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.model(**self.kwargs).logits
        self.graph = graph

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        self.tokens.copy_(tokens[:, None])
        self.positions.copy_(positions)
        self.slot.fill_(slot)
        if self.graph is None:
            return self.model(**self.kwargs).logits
        self.graph.replay()
        return self.logits


class HFEngine(Engine):
    accepts_lora_adapters = True   # load_lora_adapters, from the base weights read again

    def __init__(self, model_path: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 max_batch_sequences: int | None = None, seed: int = 0, tokenizer_path: str | Path | None = None,
                 trust_remote_code: bool = False):
        """max_batch_sequences: sequences decoded together; default 64 on CPU, 256 on a GPU (a
        decode step costs about the same for 64 or 256 sequences there: it is launch-bound)."""
        from transformers import AutoConfig, AutoTokenizer

        self._model_path = str(model_path)
        self._dtype, self._trust_remote_code = getattr(torch, dtype), trust_remote_code
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            # An explicit index: the collective path pins this GPU with torch.cuda.set_device.
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path), trust_remote_code=trust_remote_code)
        _register_attention()
        config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
        self.model = _auto_class(config).from_pretrained(
            str(model_path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code,
            attn_implementation=ATTENTION).to(self._device).eval()
        # A vision-language model (Qwen2.5-VL): generate takes the prompts' images (module docstring).
        self._images = self._unsampled = None
        if getattr(config, "vision_config", None) is not None:
            from transformers import AutoImageProcessor
            self._images = AutoImageProcessor.from_pretrained(str(tokenizer_path or model_path))
            self.accepts_images = True
            # Its image/video placeholders are never sampled: a response holding one would not
            # match the trainer's images (transformers counts every placeholder of the row). A
            # trained model gives them ~0 probability; the tiny random one does not.
            self._unsampled = torch.tensor(sorted({getattr(config, k) for k in ("image_token_id", "video_token_id")
                                                   if getattr(config, k, None) is not None}), device=self._device)
        self._static_cache = _full_attention_only(self.model.config)
        self._cuda_graphs = self._static_cache and self._device.type == "cuda"
        self._eos = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self._pad = pad if pad is not None else min(self._eos, default=0)
        self._max_batch = max_batch_sequences or (256 if self._device.type == "cuda" else 64)
        # Requests without a seed still get reproducible samples: their seeds come from here.
        self._seeds = torch.Generator().manual_seed(seed)
        self._targets = self.model.state_dict(keep_vars=True)
        # LoRA (load_lora_adapters): the base weights it needs, read again from the model's files
        # at the first adapter sync; and which weights are no longer the base's.
        self._base: dict[str, torch.Tensor] = {}
        self._not_base: set[str] = set()
        # transformers 5.x renamed the forward's `past_key_values` to `cache`; the cache object
        # is updated in place either way, so we keep our own reference to it.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self._device

    def sleep(self, level: int) -> bool:
        """The hf engine keeps no KV cache between calls (each generate builds its own): on a GPU
        what the last generation left in torch's caching allocator goes back to the device for
        the trainer; the weights stay at either level (the dev engine: nothing to re-sync). On
        CPU a no-op."""
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        return False

    def info(self) -> EngineInfo:
        return EngineInfo(engine="hf", model=self._model_path, device=str(self._device),
                          num_parameters=sum(p.numel() for p in self.model.parameters()),
                          capacity=self._max_batch)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 images: list[list[bytes]] | None = None) -> list[list[Sample]]:
        """`images`: a VL model's, per prompt, as encoded bytes (PNG, JPEG ...), one for each
        image-token run of its prompt ids, in order."""
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        if images is not None and self._images is None:
            raise ValueError(f"{self._model_path} is not a vision-language model: it takes no images")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        # Sampling runs where the logits are (one [batch, vocab] copy to the host per token cost
        # more than the forward on a GPU); on CPU this is the same generator as ever.
        generator = torch.Generator(device=self._device).manual_seed(seed)
        rows = [p for p in prompt_ids for _ in range(params.n)]
        row_images = [i for i in images for _ in range(params.n)] if images is not None else None
        samples: list[Sample] = []
        for start in range(0, len(rows), self._max_batch):
            window = slice(start, start + self._max_batch)
            samples.extend(self._generate_batch(rows[window], params, generator,
                                                row_images[window] if row_images is not None else None))
        return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompt_ids))]

    def _vision_prefill(self, ids: torch.Tensor, mask: torch.Tensor, images: list[list[bytes]]) -> tuple[dict, torch.Tensor]:
        """A VL prefill's extra inputs (pixel values, grids, Qwen's mrope positions [3, b, L] over
        the left-padded rows) and each row's last text position, from which decoding counts on:
        text positions run on from the image's (rope deltas), the same in all three dims."""
        from PIL import Image
        flat = [Image.open(io.BytesIO(b)).convert("RGB") for row in images for b in row]
        inputs = self._images(images=flat, return_tensors="pt") if flat else None
        grid = inputs["image_grid_thw"].to(self._device) if flat else None
        types = (ids == self.model.config.image_token_id).int()
        positions, _ = self.model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid,
                                                       attention_mask=mask.long())
        extra = {"position_ids": positions}
        if flat:
            extra |= {"pixel_values": inputs["pixel_values"].to(self._device, self.model.dtype), "image_grid_thw": grid}
        return extra, positions[0, :, -1:]

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams, generator: torch.Generator,
                        images: list[list[bytes]] | None = None) -> list[Sample]:
        from transformers import DynamicCache
        b, width, max_tokens = len(rows), max(len(r) for r in rows), params.max_tokens
        dev, static = self._device, self._static_cache
        ids = torch.tensor([[self._pad] * (width - len(r)) + r for r in rows], device=dev)
        # Which cache slots (prompt, then response) each row attends to: its own prompt tokens
        # (left-padded), then every response slot once written.
        slots = width + max_tokens if static else width
        real = torch.zeros(b, slots, dtype=torch.bool, device=dev)
        real[:, :width] = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows], device=dev)
        # Positions count real tokens only, so a padded row sees the same positions (hence the
        # same logits) as it would alone.
        positions = (real[:, :width].long().cumsum(dim=-1) - 1).clamp(min=0)
        if static:
            cache = _SlotCache(slots)
            cache.slots = torch.arange(width, device=dev)
            # 4-D masks ([b, 1, queries, slots written so far], True = attend) are used as given.
            causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
            prefill = {"attention_mask": real[:, None, None, :width] & causal, "cache_position": cache.slots}
        else:
            cache = DynamicCache(config=self.model.config)
            prefill = {"attention_mask": real.long()}
        if images is not None:
            vision, last = self._vision_prefill(ids, real[:, :width], images)
            logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **vision, **prefill,
                                **{self._cache_kwarg: cache}).logits
            positions = last
        else:
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                                **prefill, **{self._cache_kwarg: cache}).logits
            positions = positions[:, -1:]
        decode = None     # made at the first decode step: a response of one token needs none
        eos = torch.tensor(sorted(self._eos), dtype=torch.long, device=self._device)
        token_buf = torch.empty(b, max_tokens, dtype=torch.long, device=self._device)
        logprob_buf = torch.empty(b, max_tokens, dtype=torch.float32, device=self._device) if params.logprobs else None
        # A row is done at its first EOS (or stop string); its length then stays put. Rows that
        # are done keep being decoded with the others, their tokens are dropped.
        done = torch.zeros(b, dtype=torch.bool, device=self._device)
        lengths = torch.full((b,), max_tokens, dtype=torch.long, device=self._device)
        texts: list[list[int]] | None = [[] for _ in rows] if params.stop else None
        steps = 0
        for t in range(max_tokens):
            last = logits[:, -1, :].float()
            if self._unsampled is not None:
                last = last.index_fill(-1, self._unsampled, float("-inf"))
            tokens, logprobs = sample_next(last, params, generator)
            token_buf[:, t] = tokens
            if logprob_buf is not None:
                logprob_buf[:, t] = logprobs
            steps = t + 1
            hit = ~done & torch.isin(tokens, eos)
            if texts is not None:   # stop strings: decoded on the host, row by row
                stop_hit = [False] * b
                for i, (tok, was_done) in enumerate(zip(tokens.tolist(), done.tolist())):
                    if not was_done:
                        texts[i].append(tok)
                        stop_hit[i] = self._hit_stop(texts[i], params.stop)
                hit |= torch.tensor(stop_hit, device=self._device)
            lengths = torch.where(hit, steps, lengths)
            done |= hit
            if bool(done.all()) or steps == max_tokens:
                break
            positions = positions + 1
            if static:
                real[:, width + t] = True
            else:
                real = torch.cat([real, real.new_ones((b, 1))], dim=-1)
            decode = decode or self._decoder(cache, real, width)
            logits = decode(tokens, positions, real, width + t)
        token_rows = token_buf[:, :steps].tolist()
        logprob_rows = logprob_buf[:, :steps].tolist() if logprob_buf is not None else [None] * b
        return [Sample(toks[:n], None if lps is None else lps[:n], "stop" if stopped else "length")
                for toks, lps, n, stopped in zip(token_rows, logprob_rows, lengths.tolist(), done.tolist())]

    def _decoder(self, cache, real: torch.Tensor, width: int):
        """decode(tokens, positions, real, slot) -> logits: one new token per row (written to cache
        slot `slot` of a _SlotCache), attending where `real` says."""
        if self._static_cache:
            step = _SlotDecode(self.model, self._cache_kwarg, cache, real, width, capture=self._cuda_graphs)
            self._cuda_graphs = step.graph is not None    # failed once: don't try again
            return lambda tokens, positions, real, slot: step(tokens, positions, slot)

        def eager(tokens, positions, real, slot):
            return self.model(input_ids=tokens[:, None], position_ids=positions, attention_mask=real.long(),
                              use_cache=True, **{self._cache_kwarg: cache}).logits
        return eager

    def _hit_stop(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        return bool(stop) and any(s in self.decode(token_ids) for s in stop)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(weights)
        for name, tensor in batch:
            target = self._targets.get(name)
            if target is None:
                raise ValueError(f"unknown parameter {name!r} for {self._model_path}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
        for name, tensor in batch:
            self._targets[name].copy_(tensor)
            self._not_base.add(name)

    @torch.no_grad()
    def load_lora_adapters(self, adapters) -> None:
        weights = {module: f"{module}.weight" for module in adapters}
        for module, adapter in adapters.items():
            target = self._targets.get(weights[module])
            if target is None or target.ndim != 2:
                raise ValueError(f"LoRA adapter for {module!r}: {self._model_path} has no linear layer of that name")
            rank = adapter.a.shape[0] if adapter.a.ndim == 2 else -1
            if (rank < 1 or tuple(adapter.a.shape) != (rank, target.shape[1])
                    or tuple(adapter.b.shape) != (target.shape[0], rank)):
                raise ValueError(f"LoRA adapter for {module!r}: A {tuple(adapter.a.shape)} and B "
                                 f"{tuple(adapter.b.shape)} don't fit its weight {tuple(target.shape)}")
        # Every weight that isn't the base's (an earlier merged update, or an adapter not sent
        # now) goes back to it; the adapted ones are recomputed from it: nothing accumulates.
        restore = self._not_base - set(weights.values())
        base = self._base_weights([*weights.values(), *restore])
        for name in restore:
            self._targets[name].copy_(base[name])
        for module, adapter in adapters.items():
            w = base[weights[module]]
            a, b = adapter.a.to(self._device), adapter.b.to(self._device)
            # grpo_trainer.lora.merge, the trainer's merged weights, exactly: the same float32 math.
            self._targets[weights[module]].copy_((w.float() + adapter.scaling * (b.float() @ a.float())).to(w.dtype))
        self._not_base = set(weights.values())

    def _base_weights(self, names) -> dict[str, torch.Tensor]:
        """The named weights as this engine loaded them: the model's files, read again (once) with
        the same loader and dtype. Kept on the engine's device: one more copy of the adapted
        weights (`grpo rollout --no-lora-adapters` takes merged weights instead, without it)."""
        missing = [n for n in names if n not in self._base]
        if missing:
            from transformers import AutoConfig
            log.info("hf engine: reading the base weights of %d tensors for LoRA adapters from %s", len(missing),
                     self._model_path)
            config = AutoConfig.from_pretrained(self._model_path, trust_remote_code=self._trust_remote_code)
            loaded = _auto_class(config).from_pretrained(self._model_path, dtype=self._dtype,
                                                         trust_remote_code=self._trust_remote_code).state_dict()
            for n in missing:
                self._base[n] = loaded[n].to(self._device)
            del loaded
        return self._base
