"""The transformers engine: CPU, development and tests (vLLM is the production engine).

A plain sampling loop over a Hugging Face causal LM with a KV cache: prompts left-padded into
one batch (each repeated n times), one forward per new token. Written out rather than calling
`model.generate` because the behaviour logprob of every sampled token must be exactly the one
the sampler used (see grpo_rollout.engine), and reproducibility must not depend on
transformers' logits-processor defaults.

Decoding is memory-bound, so the loop moves as few bytes as it can: the KV cache is allocated
once for the whole batch (transformers' StaticCache; a DynamicCache copies all of it at every
token), and a decode step's attention reads each key/value head once for all the query heads
that share it (`_decode_attention`; sdpa with a padding mask would first copy every key/value
head `heads / kv_heads` times). Models with sliding-window layers keep a DynamicCache: the
static one's sliding layers are ring buffers that the masks here don't describe.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import inspect

import torch
import torch.nn.functional as F

from grpo_rollout.engine import Engine, EngineInfo, Sample, SamplingParams


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


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their behaviour logprobs for float32 `logits` [batch, vocab]."""
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / params.temperature
    logprobs = scaled.log_softmax(dim=-1)
    probs = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


ATTENTION = "grpo_decode_sdpa"


def _decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """sdpa, except for one query token with grouped key/value heads: the query heads of a group
    become that group's queries ([b, kv_heads, heads / kv_heads, d]), so the cache is read once."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTENTION, _decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)   # masks from 2-D ones: as sdpa's


def _full_attention_only(config) -> bool:
    types = getattr(config, "layer_types", None) or ["full_attention"]
    return getattr(config, "sliding_window", None) is None and all(t == "full_attention" for t in types)


class HFEngine(Engine):
    def __init__(self, model_path: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 max_batch_sequences: int | None = None, seed: int = 0, tokenizer_path: str | Path | None = None,
                 trust_remote_code: bool = False):
        """max_batch_sequences: sequences decoded together; default 64 on CPU, 256 on a GPU (a
        decode step costs about the same for 64 or 256 sequences there: it is launch-bound)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._model_path = str(model_path)
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            # An explicit index: the collective path pins this GPU with torch.cuda.set_device.
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path), trust_remote_code=trust_remote_code)
        _register_attention()
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code,
            attn_implementation=ATTENTION).to(self._device).eval()
        self._static_cache = _full_attention_only(self.model.config)
        self._eos = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self._pad = pad if pad is not None else min(self._eos, default=0)
        self._max_batch = max_batch_sequences or (256 if self._device.type == "cuda" else 64)
        # Requests without a seed still get reproducible samples: their seeds come from here.
        self._seeds = torch.Generator().manual_seed(seed)
        self._targets = self.model.state_dict(keep_vars=True)
        # transformers 5.x renamed the forward's `past_key_values` to `cache`; the cache object
        # is updated in place either way, so we keep our own reference to it.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self._device

    def info(self) -> EngineInfo:
        return EngineInfo(engine="hf", model=self._model_path, device=str(self._device),
                          num_parameters=sum(p.numel() for p in self.model.parameters()),
                          capacity=self._max_batch)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        # Sampling runs where the logits are (one [batch, vocab] copy to the host per token cost
        # more than the forward on a GPU); on CPU this is the same generator as ever.
        generator = torch.Generator(device=self._device).manual_seed(seed)
        rows = [p for p in prompt_ids for _ in range(params.n)]
        samples: list[Sample] = []
        for start in range(0, len(rows), self._max_batch):
            samples.extend(self._generate_batch(rows[start:start + self._max_batch], params, generator))
        return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompt_ids))]

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams, generator: torch.Generator) -> list[Sample]:
        from transformers import DynamicCache, StaticCache
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
            cache = {self._cache_kwarg: StaticCache(config=self.model.config, max_cache_len=slots)}
            # 4-D masks ([b, 1, queries, slots], True = attend) are used as given.
            causal = torch.ones(width, slots, dtype=torch.bool, device=dev).tril()
            prefill = {"attention_mask": real[:, None, None, :] & causal, "cache_position": torch.arange(width, device=dev)}
        else:
            cache = {self._cache_kwarg: DynamicCache(config=self.model.config)}
            prefill = {"attention_mask": real.long()}
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **prefill, **cache)
        positions = positions[:, -1:]
        eos = torch.tensor(sorted(self._eos), dtype=torch.long, device=self._device)
        token_buf = torch.empty(b, max_tokens, dtype=torch.long, device=self._device)
        logprob_buf = torch.empty(b, max_tokens, dtype=torch.float32, device=self._device)
        # A row is done at its first EOS (or stop string); its length then stays put. Rows that
        # are done keep being decoded with the others, their tokens are dropped.
        done = torch.zeros(b, dtype=torch.bool, device=self._device)
        lengths = torch.full((b,), max_tokens, dtype=torch.long, device=self._device)
        texts: list[list[int]] | None = [[] for _ in rows] if params.stop else None
        steps = 0
        for t in range(max_tokens):
            tokens, logprobs = sample_next(out.logits[:, -1, :].float(), params, generator)
            token_buf[:, t], logprob_buf[:, t] = tokens, logprobs
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
                decode = {"attention_mask": real[:, None, None, :],
                          "cache_position": torch.tensor([width + t], device=dev)}
            else:
                real = torch.cat([real, real.new_ones((b, 1))], dim=-1)
                decode = {"attention_mask": real.long()}
            out = self.model(input_ids=tokens[:, None], position_ids=positions, use_cache=True, **decode, **cache)
        token_rows = token_buf[:, :steps].tolist()
        logprob_rows = logprob_buf[:, :steps].tolist()
        return [Sample(toks[:n], lps[:n], "stop" if stopped else "length")
                for toks, lps, n, stopped in zip(token_rows, logprob_rows, lengths.tolist(), done.tolist())]

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
