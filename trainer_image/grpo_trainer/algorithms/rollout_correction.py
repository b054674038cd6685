"""Rollout correction (verl's ``algorithm.rollout_correction``, decoupled mode): importance weights
and rejection between the trainer's old policy and the rollout engine's, whose log-probs differ
(bf16 kernels, another attention implementation, a policy one update behind).

``log_ratio = old_logp - rollout_logp`` is ``log(pi_old / pi_rollout)`` per response token.

- IS weights (``rollout_is``): ``token``: ``exp(log_ratio)``; ``sequence``: the product over the
  response, broadcast to its tokens. Safety-bounded to ``exp(+-20)``, then truncated at ``upper``
  (TIS), or, with a ``lower`` bound, zeroed outside ``[lower, upper]`` (IcePop). Constants: they
  change the measure, not the objective.
- Rejection (``rollout_rs``, every option must pass): ``token_k1`` keeps a token whose
  ``log(pi_rollout / pi_old)`` lies in ``[log lower, log upper]``; ``token_k2`` / ``token_k3``
  one whose k2 / k3 divergence is ``<= upper``; ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*``
  apply the same test to the sum / mean / max over the response, keeping or dropping it whole.
  Rejected tokens leave the loss and its denominator.

Formulas and metric names follow verl's ``rollout_corr_helper.py``.
"""

from __future__ import annotations

import math

import torch

from .masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, *, upper: float,
                       lower: float | None = None) -> torch.Tensor:
    """[B, T] importance weights, 0 on padding (module doc)."""
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        total = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is must be token or sequence (got {level!r})")
    raw = raw * mask
    if lower is None:
        return raw.clamp(max=upper).detach()
    return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw)).detach()


def rollout_rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, options: list[str], *, upper: float,
                           lower: float | None = None) -> torch.Tensor:
    """The response mask without the rejected tokens (module doc); for k1 options `lower`
    defaults to 1 / upper."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergence = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}
    keep = torch.ones_like(mask, dtype=torch.bool)
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {option!r}; known: {', '.join(RS_OPTIONS)}")
        level, kind = option.rsplit("_", 1)
        stat = divergence[kind]
        if level == "seq_sum":
            stat = masked_sum(stat, mask, dim=-1).unsqueeze(-1)
        elif level == "seq_mean":
            stat = masked_mean(stat, mask, dim=-1).unsqueeze(-1)
        elif level == "seq_max":
            stat = stat.masked_fill(~mask.bool(), float("-inf")).max(dim=-1, keepdim=True).values
        if kind == "k1":
            low = math.log(lower if lower is not None else 1.0 / upper)
            passed = (stat >= low) & (stat <= math.log(upper))
        else:
            passed = stat <= upper
        keep &= passed.expand_as(mask)
    return mask * keep.to(mask.dtype)


def correction_metrics(log_ratio: torch.Tensor, kept: torch.Tensor, rejected_responses: torch.Tensor,
                       weights: torch.Tensor | None, seq_log_ratios: torch.Tensor | None = None, *,
                       icepop: bool = False) -> dict[str, float]:
    """The mismatch, the rejected shares and the weights' distribution (verl's names, under
    ``rollout_corr/``), from flat tensors: every response token's log ratio, whether it is kept
    and its weight, and for every response whether any of its tokens was rejected.

    With sequence-level weights pass ``seq_log_ratios`` (each response's summed log ratio): max and
    min are then the raw weights, before the safety bound's lower side and the truncation, as
    verl's ``compute_is_metrics`` reports them (so a run shows how far off a response really is).

    With ``icepop`` (a lower bound) ``rollout_is_oob_ratio`` is the share of response tokens whose
    weight IcePop zeroed, as verl names it."""
    metrics = {"rollout_corr/log_ratio_abs_mean": float(log_ratio.abs().mean()),
               "rollout_corr/rollout_rs_masked_fraction": float(1 - kept.float().mean()),
               "rollout_corr/rollout_rs_seq_masked_fraction": float(rejected_responses.float().mean())}
    if weights is not None:
        metrics |= {"rollout_corr/rollout_is_mean": float(weights.mean()),
                    "rollout_corr/rollout_is_max": float(weights.max()),
                    "rollout_corr/rollout_is_min": float(weights.min()),
                    # the effective sample size as a fraction of the tokens: (mean w)^2 / mean(w^2)
                    "rollout_corr/rollout_is_eff_sample_size": float(weights.mean() ** 2 / weights.square().mean())}
        if icepop:      # a raw weight is >= exp(-20) > 0, so a zero on a response token is IcePop's
            metrics["rollout_corr/rollout_is_oob_ratio"] = float((weights == 0).double().mean())
        if seq_log_ratios is not None:
            metrics |= {"rollout_corr/rollout_is_max": math.exp(min(float(seq_log_ratios.max()), SAFETY_BOUND)),
                        "rollout_corr/rollout_is_min": math.exp(float(seq_log_ratios.min()))}
    return metrics
