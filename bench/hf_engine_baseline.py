# Verbatim copy of rollout_image/grpo_rollout/hf_engine.py at commit 055cafa (before issue 14's change:
# host-side sampling, 64-sequence batches): bench/h200_bench.py measures it as the "default" engine.
"""The transformers engine: CPU, development and tests (vLLM is the production engine).

A plain sampling loop over a Hugging Face causal LM with a KV cache: prompts left-padded into
one batch (each repeated n times), one forward per new token. Written out rather than calling
`model.generate` because the behaviour logprob of every sampled token must be exactly the one
the sampler used (see grpo_rollout.engine), and reproducibility must not depend on
transformers' logits-processor defaults.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import inspect

import torch

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


class HFEngine(Engine):
    def __init__(self, model_path: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 max_batch_sequences: int = 64, seed: int = 0, tokenizer_path: str | Path | None = None,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._model_path = str(model_path)
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            # An explicit index: the collective path pins this GPU with torch.cuda.set_device.
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path), trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code).to(self._device).eval()
        self._eos = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self._pad = pad if pad is not None else min(self._eos, default=0)
        self._max_batch = max_batch_sequences
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
        generator = torch.Generator().manual_seed(seed)
        rows = [p for p in prompt_ids for _ in range(params.n)]
        samples: list[Sample] = []
        for start in range(0, len(rows), self._max_batch):
            samples.extend(self._generate_batch(rows[start:start + self._max_batch], params, generator))
        return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompt_ids))]

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams, generator: torch.Generator) -> list[Sample]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self._pad] * (width - len(r)) + r for r in rows], device=self._device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self._device)
        # Left padding: positions count real tokens only, so a padded row sees the same
        # positions (hence the same logits) as it would alone.
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        from transformers import DynamicCache
        cache = {self._cache_kwarg: DynamicCache(config=self.model.config)}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **cache)
        samples = [Sample([], [], "length") for _ in rows]
        done = [False] * len(rows)
        for _ in range(params.max_tokens):
            tokens, logprobs = sample_next(out.logits[:, -1, :].float().cpu(), params, generator)
            for i, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
                if done[i]:
                    continue
                samples[i].token_ids.append(tok)
                samples[i].logprobs.append(lp)
                if tok in self._eos or self._hit_stop(samples[i].token_ids, params.stop):
                    samples[i].finish_reason = "stop"
                    done[i] = True
            if all(done):
                break
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=tokens[:, None].to(self._device), attention_mask=mask, position_ids=positions,
                             use_cache=True, **cache)
        return samples

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
