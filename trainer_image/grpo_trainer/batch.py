"""From rollout shards to training tensors: samples, advantages, per-rank shares, micro-batches.

Micro-batches are formed from length-sorted samples under a token budget
(`trainer.maxTokensPerGPU`) or a count (`trainer.microBatchSizePerGPU`), so padding stays small
on mixed lengths. Tensors are over the shifted sequence (position t predicts token t+1);
`response_mask` marks the positions that predict response tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from grpo_trainer.algorithms import compute_advantages


@dataclass
class Sample:
    uid: str
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float] | None   # None: the engine was asked for none (engine_logprobs_needed)
    reward: float
    finish_reason: str
    policy_version: int = 0       # of the weights that generated it
    loss_mask: list[int] | None = None   # multi-turn: 1 for the model's tokens, 0 for tools'; None: all 1
    agent: dict | None = None            # multi-turn: the trajectory's turns and tool calls (record `agent`)
    reward_error: str | None = None      # how the reward function failed (record `reward_error`), None: it didn't
    reward_extra: dict | None = None     # the reward function's extra fields, its error message (record `reward_extra`)
    images: list[bytes] = field(default_factory=list)   # a VL model's prompt images, encoded (record `images`)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def mask(self) -> torch.Tensor:
        """[len(response_ids)]: which response tokens the losses, the KL and the entropy see."""
        if self.loss_mask is None:
            return torch.ones(len(self.response_ids))
        return as_tensor(self.loss_mask, np.float32)

    @property
    def last_model_token(self) -> int:
        """Where the outcome reward goes: the last token the model sampled."""
        if self.loss_mask is None:
            return len(self.response_ids) - 1
        return max((i for i, m in enumerate(self.loss_mask) if m), default=len(self.response_ids) - 1)


def as_tensor(values: list, dtype) -> torch.Tensor:
    """A CPU tensor from a list of numbers, through numpy: ~7x faster than torch.tensor on the
    step's ~0.5 M token ids and log-probs, which it collates each step (issue 47)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))


def samples_from_table(table: pa.Table, read_image=None) -> list[Sample]:
    """`read_image(uri) -> bytes`: how a VL model's prompt images (the record's `images`) are read;
    without it they are left out."""
    # Shards written before multi-turn have no response_mask: every response token is the model's.
    # Nor reward_error (no reward function failure was recorded then: none is counted).
    has_mask = "response_mask" in table.column_names
    rows = table.select(["uid", "prompt_index", "sample_index", "prompt_ids", "response_ids",
                         "response_logprobs", "reward", "finish_reason", "policy_version", "reward_extra"]
                        + (["response_mask", "agent"] if has_mask else [])
                        + (["reward_error"] if "reward_error" in table.column_names else [])
                        + (["images"] if read_image is not None and "images" in table.column_names else [])).to_pylist()
    samples = [Sample(r["uid"], r["prompt_index"], r["sample_index"], r["prompt_ids"], r["response_ids"],
                      r["response_logprobs"], float(r["reward"]), r["finish_reason"], r["policy_version"],
                      r.get("response_mask"), json.loads(r["agent"]) if r.get("agent") else None,
                      r.get("reward_error"), json.loads(r["reward_extra"]) if r["reward_extra"] else {},
                      [read_image(u) for u in r.get("images") or ()])
               for r in rows]
    for s in samples:
        if s.loss_mask is not None and len(s.loss_mask) != len(s.response_ids):
            raise ValueError(f"sample {s.uid}/{s.sample_index}: {len(s.loss_mask)} response_mask entries for "
                             f"{len(s.response_ids)} response tokens")
    return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))


def keep_prompts(samples: list[Sample], keep: list[int]) -> list[Sample]:
    """The samples of the kept prompts (dynamic sampling), their prompts renumbered 0..len-1."""
    new_index = {p: i for i, p in enumerate(sorted(keep))}
    kept = [s for s in samples if s.prompt_index in new_index]
    for s in kept:
        s.prompt_index = new_index[s.prompt_index]
    return sorted(kept, key=lambda s: (s.prompt_index, s.sample_index))


def check_complete(samples: list[Sample], num_prompts: int, n: int) -> None:
    """Every prompt of the step has exactly n samples: nothing missing, nothing duplicated."""
    seen = {(s.prompt_index, s.sample_index) for s in samples}
    expected = {(p, i) for p in range(num_prompts) for i in range(n)}
    if len(samples) != len(seen) or seen != expected:
        missing, extra = expected - seen, seen - expected
        raise RuntimeError(f"rollouts incomplete: {len(samples)} rows for {num_prompts}x{n}; "
                           f"missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}, "
                           f"duplicates {len(samples) - len(seen)}")


def check_staleness(samples: list[Sample], current_version: int, max_staleness: int) -> float:
    """The batch's mean staleness (policy updates between the weights that generated a sample
    and the ones it trains). By construction every sample lies within rollout.maxStaleness; a
    batch outside it would train on an unbounded ratio, so it is refused, not clipped."""
    lags = [current_version - s.policy_version for s in samples]
    bad = [(s.uid, s.sample_index, s.policy_version) for s, lag in zip(samples, lags)
           if not 0 <= lag <= max_staleness]
    if bad:
        raise RuntimeError(f"rollouts outside rollout.maxStaleness={max_staleness}: training policy version "
                           f"{current_version}, but {len(bad)} samples were generated at versions "
                           f"{sorted({v for *_, v in bad})} (e.g. {bad[0][0]}/{bad[0][1]})")
    return sum(lags) / len(lags)


def token_rewards(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] token-level rewards (the outcome reward on each response's last model token) and the
    response mask (0 on tool tokens), T the longest response."""
    width = max(len(s.response_ids) for s in samples)
    mask = torch.zeros(len(samples), width)
    rewards = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        mask[i, :len(s.response_ids)] = s.mask()
        rewards[i, s.last_model_token] = s.reward
    return rewards, mask


def advantages_per_sample(samples: list[Sample], estimator: str, *, norm_adv_by_std: bool,
                          gamma: float) -> list[torch.Tensor]:
    """Advantages of each sample's response tokens (the whole step's batch is one computation:
    group statistics and REINFORCE++ whitening need every sample)."""
    rewards, mask = token_rewards(samples)
    adv, _ = compute_advantages(estimator, rewards, mask, [s.uid for s in samples],
                                norm_adv_by_std=norm_adv_by_std, gamma=gamma)
    return [adv[i, :len(s.response_ids)] for i, s in enumerate(samples)]


def rank_share(indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's contiguous share of a mini-batch's sample indices (sizes divide evenly)."""
    per = len(indices) // world
    return indices[rank * per:(rank + 1) * per]


def micro_batches(indices: list[int], samples: list[Sample], *, max_count: int,
                  max_tokens: int | None, packed: bool = False, share_prompts: bool = False) -> list[list[int]]:
    """Group samples, longest first, so each micro-batch's padded size (count x longest), or
    `packed` its tokens, stays within `max_tokens` (or its count within `max_count` when there's
    no token budget). `share_prompts` (packed, model.sharePrompts): the responses to one prompt
    stay together, largest group first, and a prompt counts once per micro-batch."""
    prompt_of = {i: tuple(samples[i].prompt_ids) if share_prompts else None for i in indices}
    if share_prompts:
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i in indices:
            by_prompt.setdefault(prompt_of[i], []).append(i)
        units = sorted(by_prompt.items(), key=lambda kv: -(len(kv[0]) + sum(len(samples[i].response_ids)
                                                                            for i in kv[1])))
        order = [i for _, unit in units for i in unit]
    else:
        order = sorted(indices, key=lambda i: -samples[i].length)
    groups: list[list[int]] = []
    size, prompts = 0, set()
    for i in order:
        prompt = prompt_of[i]
        cost = len(samples[i].response_ids) if share_prompts and prompt in prompts else samples[i].length
        if groups:
            g = groups[-1]
            size = size + cost if packed or share_prompts else (len(g) + 1) * samples[g[0]].length
            if size <= max_tokens if max_tokens else len(g) < max_count:
                g.append(i)
                prompts.add(prompt)
                continue
        groups.append([i])
        size, prompts = samples[i].length, {prompt}
    return groups


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` cut into `count` micro-batches, halving the largest first: with a token budget
    the ranks' shares can fall into different numbers of micro-batches, but every forward and
    backward of FSDP is a collective, so all ranks must run as many (verl all-reduces the count
    too). A part of a group that fits the budget fits it."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda k: len(groups[k]))
        g = groups[largest]
        if len(g) < 2:
            raise ValueError(f"{sum(map(len, groups))} samples can't make {count} micro-batches")
        groups[largest:largest + 1] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups


@dataclass
class Packed:
    """A micro-batch's samples as one row without padding (model.useRemovePadding): each with its
    own positions from 0, from which transformers masks attention to each sample alone.

    With model.sharePrompts the model's row holds each distinct prompt once, followed by the
    responses to it (the shared row, m tokens); `expand` maps the row above (the full row, n
    tokens), in which `source` is given, to it. Attention runs on the shared row's queries: a
    prompt's first sample takes the prompt and its response, each other sample its response
    alone (`cu_seqlens_q`), and each attends to its prompt's and its own keys and values, which
    `key_index` gathers into a row of its own (`cu_seqlens_k`; the samples in the same order)."""
    input_ids: torch.Tensor      # [1, m]
    position_ids: torch.Tensor   # [1, m]: a response's positions continue its prompt's
    source: torch.Tensor         # [n]: where full position j's prediction goes in the padded [b, L-1]
    #                               tensors, flattened (row x (L-1) + t); -1 for a sample's last token
    cu_seqlens: torch.Tensor     # [b + 1] int32: where each sample starts in the full row, and n
    max_length: int              # the longest sample
    expand: torch.Tensor | None = None          # [n]: the shared position of each full position
    key_index: torch.Tensor | None = None       # [n]: the shared position of each key, sample by sample
    cu_seqlens_q: torch.Tensor | None = None    # [b + 1] int32: each sample's queries in the shared row
    cu_seqlens_k: torch.Tensor | None = None    # [b + 1] int32: each sample's keys in key_index
    max_length_q: int = 0                       # the most queries of a sample
    # The model row's positions that predict a response token, and where each prediction goes in
    # the padded [b, L-1] tensors (flattened): computed on the host while collating, so that the
    # forward passes index with them without waiting for the GPU.
    scored: torch.Tensor | None = None          # [k] positions in the model's row
    scored_dest: torch.Tensor | None = None     # [k] row x (L-1) + t


@dataclass
class MicroBatch:
    indices: list[int]
    input_ids: torch.Tensor       # [b, L]
    attention_mask: torch.Tensor  # [b, L]
    targets: torch.Tensor         # [b, L-1] = input_ids shifted left
    response_mask: torch.Tensor   # [b, L-1]
    advantages: torch.Tensor      # [b, L-1]
    behaviour_logprobs: torch.Tensor | None  # [b, L-1]: the engine's logprob of each response token; None: none reported
    response_start: int = 0       # first position that predicts a response token, over all rows
    predicts_response: torch.Tensor | None = None   # [b, L-1] bool: the positions of the responses' spans
    returns: torch.Tensor | None = None      # [b, L-1], PPO: the critic's targets
    old_values: torch.Tensor | None = None   # [b, L-1], PPO: the critic's values before its update
    is_weights: torch.Tensor | None = None   # [b, L-1], rollout correction's importance weights
    packed: Packed | None = None  # the model's input without padding; its outputs go back to [b, L-1]
    pixels: object | None = None  # vision.PixelInputs: a VL model's images of these rows, in row order
    num_tokens: int = field(kw_only=True)   # the rows' tokens, counted on the host


def response_span(mb: MicroBatch, row: int, samples: list[Sample]) -> slice:
    """The positions of `mb`'s row that predict its sample's response tokens."""
    s = samples[mb.indices[row]]
    return slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.response_ids))


def set_response_values(micro_batches: list[MicroBatch], samples: list[Sample], name: str,
                        per_sample: torch.Tensor) -> None:
    """Write `per_sample[i, :len(response i)]` ([N, T], by sample index) into each micro-batch's
    `name` tensor, at the positions of sample i's response."""
    for mb in micro_batches:
        setattr(mb, name, scatter_response_values(mb, per_sample, samples, like=mb.response_mask))


def scatter_response_values(mb: MicroBatch, per_sample: torch.Tensor, samples: list[Sample], *,
                            like: torch.Tensor) -> torch.Tensor:
    """`per_sample[i, :len(response i)]` at the positions of sample i's response in `mb`'s
    [b, L-1] layout (dtype and device of `like`), zero elsewhere."""
    out = torch.zeros_like(like)
    for row, i in enumerate(mb.indices):
        span = response_span(mb, row, samples)
        out[row, span] = per_sample[i, :span.stop - span.start].to(out)
    return out


def gather_response_values(micro_batches: list[MicroBatch], per_mb: list[torch.Tensor], samples: list[Sample],
                           width: int) -> torch.Tensor:
    """The inverse of `set_response_values` for this rank's micro-batches: [N, width] by sample
    index, zero for the samples of other ranks (an all-reduce sum then gathers them)."""
    out = torch.zeros(len(samples), width, dtype=torch.float32, device=per_mb[0].device if per_mb else "cpu")
    for mb, values in zip(micro_batches, per_mb):
        for row, i in enumerate(mb.indices):
            span = response_span(mb, row, samples)
            out[i, :span.stop - span.start] = values[row, span].float()
    return out


def collate(indices: list[int], samples: list[Sample], advantages: list[torch.Tensor] | None, pad_id: int,
            device: torch.device, *, pack: bool = False, share_prompts: bool = False) -> MicroBatch:
    """`advantages`: per sample, by index; None leaves them 0 (set later: set_response_values).
    The losses' tensors are [b, L-1] (padded) either way; `pack` adds the model's input as one
    row without padding (`Packed`), `share_prompts` with each prompt once."""
    width = max(samples[i].length for i in indices)
    b = len(indices)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros(b, width, dtype=torch.long)
    resp_mask = torch.zeros(b, width - 1)
    adv = torch.zeros(b, width - 1)
    # The engine's log-probs, when every sample has them (an on-policy step asks for none).
    behaviour = torch.zeros(b, width - 1) if all(samples[i].behaviour_logprobs is not None for i in indices) else None
    span = torch.zeros(b, width - 1, dtype=torch.bool)
    for row, i in enumerate(indices):
        s = samples[i]
        p, r = len(s.prompt_ids), len(s.response_ids)
        if s.behaviour_logprobs is not None and len(s.behaviour_logprobs) != r:
            raise ValueError(f"sample {s.uid}/{s.sample_index}: {len(s.behaviour_logprobs)} behaviour logprobs "
                             f"for {r} response tokens")
        input_ids[row, :p + r] = as_tensor(s.prompt_ids + s.response_ids, np.int64)
        attention[row, :p + r] = 1
        resp_mask[row, p - 1:p - 1 + r] = s.mask()
        span[row, p - 1:p - 1 + r] = True
        if advantages is not None:
            adv[row, p - 1:p - 1 + r] = advantages[i]
        if behaviour is not None:
            behaviour[row, p - 1:p - 1 + r] = as_tensor(s.behaviour_logprobs, np.float32)
    start = min(len(samples[i].prompt_ids) for i in indices) - 1
    return MicroBatch(indices, input_ids.to(device), attention.to(device), input_ids[:, 1:].to(device),
                      resp_mask.to(device), adv.to(device), behaviour.to(device) if behaviour is not None else None,
                      response_start=start,
                      predicts_response=span.to(device), num_tokens=int(attention.sum()),
                      packed=_pack(input_ids, attention, span, device, [len(samples[i].prompt_ids) for i in indices]
                                   if share_prompts else None) if pack or share_prompts else None)


def _pack(input_ids: torch.Tensor, attention: torch.Tensor, predicts_response: torch.Tensor, device: torch.device,
          prompt_lengths: list[int] | None = None) -> Packed:
    lengths = attention.sum(dim=1).tolist()
    width = input_ids.shape[1]
    keep = attention.bool()
    positions = torch.cat([torch.arange(n) for n in lengths])
    rows = torch.cat([torch.full((n,), row) for row, n in enumerate(lengths)])
    source = torch.where(positions < torch.tensor(lengths)[rows] - 1, rows * (width - 1) + positions, -1)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    full = input_ids[keep]
    valid = source >= 0
    scored = torch.zeros_like(valid)
    scored[valid] = predicts_response.flatten()[source[valid]]
    scored = scored.nonzero().squeeze(1)
    scored_dest = source[scored].to(device)
    if prompt_lengths is None:
        return Packed(full.unsqueeze(0).to(device), positions.unsqueeze(0).to(device), source.to(device),
                      cu_seqlens.to(device), max(lengths), scored=scored.to(device), scored_dest=scored_dest)
    # The shared row: each distinct prompt once (its first row's copy), then the responses to it;
    # each full position maps to its token's one copy there.
    rows_by_prompt: dict[tuple[int, ...], list[int]] = {}
    for row, p in enumerate(prompt_lengths):
        rows_by_prompt.setdefault(tuple(input_ids[row, :p].tolist()), []).append(row)
    expand = torch.empty(len(full), dtype=torch.long)
    shared: list[int] = []        # the full position of each shared one
    key_index: list[torch.Tensor] = []
    queries, keys = [0], [0]      # each sample's queries and keys, in the shared row's order
    for rows in rows_by_prompt.values():
        p, prompt = prompt_lengths[rows[0]], len(shared)
        shared.extend(range(int(cu_seqlens[rows[0]]), int(cu_seqlens[rows[0]]) + p))
        for row in rows:
            start, end = int(cu_seqlens[row]), int(cu_seqlens[row + 1])
            expand[start:start + p] = torch.arange(prompt, prompt + p)
            expand[start + p:end] = torch.arange(len(shared), len(shared) + end - start - p)
            shared.extend(range(start + p, end))
            key_index.append(expand[start:end])
            queries.append(len(shared))
            keys.append(keys[-1] + end - start)
    first = as_tensor(shared, np.int64)
    cu_q = torch.tensor(queries, dtype=torch.int32)
    return Packed(full[first].unsqueeze(0).to(device), positions[first].unsqueeze(0).to(device), source.to(device),
                  cu_seqlens.to(device), max(lengths), expand=expand.to(device),
                  key_index=torch.cat(key_index).to(device), cu_seqlens_q=cu_q.to(device),
                  cu_seqlens_k=torch.tensor(keys, dtype=torch.int32).to(device),
                  max_length_q=int((cu_q[1:] - cu_q[:-1]).max()),
                  # a prompt's last position predicts each of its responses' first token
                  scored=expand[scored].to(device), scored_dest=scored_dest)
