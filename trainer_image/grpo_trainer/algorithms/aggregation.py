"""Loss aggregation: ``[B, T]`` per-token losses -> one scalar, and its micro-batch/data-parallel form.

Modes (verl's ``agg_loss`` / ``actor.loss_agg_mode``), for a mini-batch of sequences ``s`` with
``n_s`` response tokens, ``N = sum_s n_s`` tokens in all, ``R`` rows (sequences, empty or not)
and scale factor ``C``:

==========================  ===========================================  ===========
mode                        loss                                         denominator
==========================  ===========================================  ===========
token-mean                  sum_{s,t} l_st / N                           N
seq-mean-token-sum          sum_s (sum_t l_st) / R                       R
seq-mean-token-mean         sum_s (sum_t l_st / n_s) / R                 R
seq-mean-token-sum-norm     sum_{s,t} l_st / (R * C)   (Dr.GRPO)         R * C
==========================  ===========================================  ===========

``C`` defaults to the padded response width ``T`` (verl's ``loss_scale_factor``); set it to
``data.maxResponseLength`` so the normalisation is the same constant at every step.

The seq-mean modes count every sequence of the mini-batch, empty ones too (a response that
rollout-correction rejection masked whole, or an empty generation): verl's trainer passes
``global_batch_size`` = ppo_mini_batch_size x n to ``agg_loss``, so an emptied response still
weighs in the denominator and the others' gradient is not scaled up by R/S.

Every mode is ``numerator / denominator`` where the numerator is a sum over sequences. So a
mini-batch split into micro-batches (and across data-parallel ranks) gets the *same gradient* as
the whole mini-batch if each micro-batch contributes ``partial numerator / global denominator``.
The trainer's recipe, per optimizer step (mini-batch) and per rank::

    normalizer = LossNormalizer.from_masks(
        mode, [mb.response_mask for mb in my_micro_batches],   # this rank's share only
        scale_factor=spec.algorithm.loss_scale_factor or spec.data.max_response_length,
        dp_size=dp_world_size, process_group=dp_group,         # all_reduce(SUM) of the counts
    )
    for mb in my_micro_batches:
        loss_mat = ...                                         # [b, t] per-token losses
        loss = normalizer(loss_mat, mb.response_mask)          # partial sum * dp_size / global denom
        loss.backward()                                        # gradients ACCUMULATE (sum); no 1/k
    # FSDP2/DDP all-reduce the gradients as a MEAN over the dp_size ranks (their default), which
    # the dp_size factor above cancels. If your all-reduce is a SUM, build the normalizer with
    # dp_size=1 instead. Then optimizer.step().

Do not divide micro-batch losses by the number of micro-batches: the global denominator already
does it, exactly, for micro-batches of any (unequal) sizes and widths. For logging, the sum of a
rank's micro-batch losses divided by ``dp_size`` and summed over ranks is the mini-batch loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .masked import masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")


def loss_numerator(loss_mat: torch.Tensor, response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The additive part of ``mode``'s loss: summing it over micro-batches gives the mini-batch's."""
    _check_mode(mode)
    if mode == "seq-mean-token-mean":
        token_sums = masked_sum(loss_mat, response_mask, dim=-1)
        lengths = response_mask.sum(dim=-1).to(loss_mat.dtype)
        # An empty sequence has token_sums == 0, so clamping its length only avoids 0/0.
        return (token_sums / lengths.clamp(min=1)).sum()
    # token-mean, seq-mean-token-sum and the -norm variant all sum every response token's loss;
    # they differ only in the denominator.
    return masked_sum(loss_mat, response_mask)


def loss_denominator(response_mask: torch.Tensor, mode: str, *, scale_factor: float | None = None) -> float:
    """``mode``'s denominator counted over ``response_mask`` alone (one micro-batch, or a rank's share).

    Denominators are additive across micro-batches and ranks *given a fixed* ``scale_factor``
    (``LossNormalizer.from_masks`` fixes it before summing).
    """
    return float(_denominator(response_mask, mode, scale_factor).item())


def _denominator(response_mask: torch.Tensor, mode: str, scale_factor: float | None) -> torch.Tensor:
    # A tensor, so that aggregate_loss's default path does not synchronise with the device.
    _check_mode(mode)
    if mode == "token-mean":
        return response_mask.sum(dtype=torch.float64)
    if mode == "seq-mean-token-sum-norm":
        scale = response_mask.shape[-1] if scale_factor is None else scale_factor
        if scale <= 0:
            raise ValueError(f"scale_factor must be > 0 (got {scale_factor})")
        return torch.tensor(float(response_mask.shape[0] * scale), dtype=torch.float64)
    # seq-mean-*: every row counts, empty or not (verl's trainer: global_batch_size; module doc).
    return torch.tensor(float(response_mask.shape[0]), dtype=torch.float64)


def aggregate_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    *,
    scale_factor: float | None = None,
    denominator: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Aggregate per-token losses ``[B, T]`` into a scalar according to ``mode`` (see module doc).

    With the defaults this is the loss of ``loss_mat`` as a whole batch. For gradient accumulation
    pass the *global* ``denominator`` (and ``dp_size``), or use ``LossNormalizer``, which does:
    the result is then ``numerator(this micro-batch) * dp_size / denominator``. ``scale_factor``
    is only used to compute the denominator when none is given. A zero denominator (an empty
    batch) is treated as 1: the numerator is then 0 too.
    """
    if loss_mat.shape != response_mask.shape:
        raise ValueError(
            f"loss_mat and response_mask shapes differ: {tuple(loss_mat.shape)} vs {tuple(response_mask.shape)}"
        )
    numerator = loss_numerator(loss_mat, response_mask, mode)
    if denominator is None:
        den = _denominator(response_mask, mode, scale_factor).to(device=numerator.device, dtype=numerator.dtype)
        return numerator * dp_size / torch.where(den > 0, den, torch.ones_like(den))
    return numerator * (dp_size / (denominator if denominator > 0 else 1.0))


@dataclass(frozen=True, kw_only=True, slots=True)
class LossNormalizer:
    """Turns micro-batch losses into exact partial sums of the mini-batch loss (see module doc)."""

    mode: str
    """One of ``LOSS_AGG_MODES``."""
    denominator: float
    """The whole mini-batch's denominator, over all micro-batches of all data-parallel ranks."""
    dp_size: int = 1
    """The factor by which the gradient all-reduce divides: the data-parallel world size for
    FSDP/DDP's default mean reduction, 1 when gradients are summed (or without data parallelism)."""

    def __post_init__(self) -> None:
        _check_mode(self.mode)
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1 (got {self.dp_size})")
        if self.denominator < 0:
            raise ValueError(f"denominator must be >= 0 (got {self.denominator})")

    @classmethod
    def from_masks(
        cls,
        mode: str,
        response_masks: torch.Tensor | Sequence[torch.Tensor],
        *,
        scale_factor: float | None = None,
        dp_size: int = 1,
        process_group: object | None = None,
    ) -> LossNormalizer:
        """Build from this rank's micro-batch masks (or one mask of its whole share).

        With ``dp_size > 1`` the counts are summed over ``process_group`` with
        ``torch.distributed.all_reduce(SUM)`` (which must then be initialised, with ``dp_size``
        ranks in the group), so every rank gets the same global denominator. For
        ``seq-mean-token-sum-norm`` without a ``scale_factor`` the widest mask (over all ranks)
        sets it; pass ``data.maxResponseLength`` instead to keep it constant across steps.
        """
        _check_mode(mode)
        masks = [response_masks] if isinstance(response_masks, torch.Tensor) else list(response_masks)
        if not masks:
            raise ValueError("from_masks needs at least one response mask")
        device = masks[0].device
        if mode == "seq-mean-token-sum-norm" and scale_factor is None:
            width = torch.tensor(float(max(m.shape[-1] for m in masks)), dtype=torch.float64, device=device)
            scale_factor = _all_reduce(width, "max", dp_size, process_group).item()
        local = torch.stack([_denominator(m, mode, scale_factor).to(device) for m in masks]).sum()
        total = _all_reduce(local, "sum", dp_size, process_group)
        return cls(mode=mode, denominator=float(total.item()), dp_size=dp_size)

    def __call__(self, loss_mat: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the mini-batch loss; sum (``backward``) over micro-batches."""
        return aggregate_loss(loss_mat, response_mask, self.mode, denominator=self.denominator, dp_size=self.dp_size)


def _all_reduce(value: torch.Tensor, op: str, dp_size: int, process_group: object | None) -> torch.Tensor:
    if dp_size == 1:
        return value
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"LossNormalizer.from_masks(dp_size={dp_size}) sums counts across ranks and needs an initialised "
            "torch.distributed process group; without data parallelism pass dp_size=1"
        )
    world = dist.get_world_size(process_group)
    if world != dp_size:
        raise ValueError(f"dp_size={dp_size} but the process group has {world} ranks")
    if value.device.type == "cpu" and dist.get_backend(process_group) == "nccl":
        value = value.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(value, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=process_group)
    return value.cpu()
