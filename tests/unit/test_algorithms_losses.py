"""Policy losses, loss aggregation and exact gradient accumulation of grpo_trainer.algorithms."""

from __future__ import annotations

import math
import os

import pytest
import torch

from grpo_trainer.algorithms import (
    LOSS_AGG_MODES,
    LossNormalizer,
    aggregate_loss,
    loss_denominator,
    policy_loss,
)

F64 = torch.float64

# ---------------------------------------------------------------- aggregation, by hand

# Row 0: 4 tokens; row 1: 2 tokens; row 2: an empty response. The 9s sit on padding.
LOSS = torch.tensor([[1.0, 2, 3, 4], [5, 6, 9, 9], [9, 9, 9, 9]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=F64)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 21 / 6),  # (1+2+3+4+5+6) / 6 tokens = 3.5
        ("seq-mean-token-sum", 21 / 3),  # (10 + 11 + 0) / 3 sequences, the empty one too = 7.0
        ("seq-mean-token-mean", (10 / 4 + 11 / 2) / 3),  # (2.5 + 5.5 + 0) / 3
        ("seq-mean-token-sum-norm", 21 / (3 * 4)),  # 21 / (3 rows * width 4) = 1.75
    ],
)
def test_aggregate_loss_hand_worked(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected, abs=1e-12)


def test_seq_mean_token_sum_norm_uses_the_given_scale_factor():
    # Dr.GRPO's constant: 21 / (3 rows * 7) = 1.0, whatever the padded width.
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", scale_factor=7).item() == pytest.approx(1.0)


def test_nan_on_padding_does_not_poison_the_loss():
    loss = LOSS.clone()
    loss[2] = float("nan")
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(aggregate_loss(loss, MASK, mode))


def test_unknown_aggregation_mode_is_refused():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'seq-mean'.*token-mean"):
        aggregate_loss(LOSS, MASK, "seq-mean")


# ---------------------------------------------------------------- vanilla PPO, by hand


def one_token(ratio: float, advantage: float, **kwargs):
    """Loss, d loss / d logp, and metrics for a single token with the given ratio and advantage."""
    old = torch.tensor([[-1.0]], dtype=F64)
    logp = (old + math.log(ratio)).requires_grad_()
    loss, metrics = policy_loss(
        "vanilla", old, logp, torch.tensor([[advantage]], dtype=F64), torch.ones(1, 1, dtype=F64), **kwargs
    )
    (grad,) = torch.autograd.grad(loss, logp)
    # Fractions are masked means with verl's 1e-8 guard in the denominator: round them.
    return loss.item(), grad.item(), {k: round(float(v), 6) for k, v in metrics.items()}


def test_clip_higher_lets_ratio_1_25_through_with_0_28_but_not_with_0_2():
    # A = 1, ratio 1.25: with clipRatioHigh 0.28 the bound is 1.28 -> unclipped, loss -1.25,
    # gradient -A * ratio = -1.25. With 0.2 the bound is 1.2 -> loss -1.2, no gradient.
    loss, grad, m = one_token(1.25, 1.0, clip_ratio_high=0.28)
    assert (loss, grad) == (pytest.approx(-1.25), pytest.approx(-1.25))
    assert m["pg_clipfrac"] == 0 and m["pg_clipfrac_high"] == 0
    loss, grad, m = one_token(1.25, 1.0, clip_ratio_high=0.2)
    assert (loss, grad) == (pytest.approx(-1.2), 0.0)
    assert m["pg_clipfrac"] == 1 and m["pg_clipfrac_high"] == 1 and m["pg_clipfrac_low"] == 0


def test_lower_clip_for_negative_advantages():
    # A = -1, ratio 0.7 < 1 - 0.2: max(0.7, 0.8) = 0.8, clipped, no gradient.
    loss, grad, m = one_token(0.7, -1.0)
    assert (loss, grad) == (pytest.approx(0.8), 0.0)
    assert m["pg_clipfrac"] == 1 and m["pg_clipfrac_low"] == 1 and m["pg_clipfrac_lower"] == 0
    # The asymmetric low bound is its own knob: with clipRatioLow 0.4 the bound is 0.6 -> unclipped.
    loss, grad, _ = one_token(0.7, -1.0, clip_ratio_low=0.4)
    assert (loss, grad) == (pytest.approx(0.7), pytest.approx(0.7))


def test_dual_clip_caps_negative_advantage_losses_at_clip_ratio_c():
    # A = -1, ratio 4: max(4, 1.2) = 4 would be the PPO loss; the dual clip takes min(4, 3 * 1) = 3.
    loss, grad, m = one_token(4.0, -1.0)
    assert (loss, grad) == (pytest.approx(3.0), 0.0)
    assert m["pg_clipfrac_lower"] == 1 and m["pg_clipfrac"] == 0
    # With A > 0 the dual clip does not apply: ratio 4 is clipped at 1.2 -> -1.2.
    assert one_token(4.0, 1.0)[0] == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        one_token(1.0, 1.0, clip_ratio_c=1.0)


def test_unclipped_token_has_the_plain_policy_gradient_and_ppo_kl_is_reported():
    # A = -1, ratio 1.1 (inside [0.8, 1.2]) -> loss 1.1, gradient -A * ratio = 1.1, ppo_kl = -ln 1.1
    loss, grad, m = one_token(1.1, -1.0)
    assert (loss, grad) == (pytest.approx(1.1), pytest.approx(1.1))
    assert m["ppo_kl"] == pytest.approx(-math.log(1.1), abs=1e-6)


def test_huge_log_ratio_is_clamped_so_gradients_stay_finite():
    # float32: exp(100) = inf, and a clipped inf times a zero gradient would be NaN.
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), 100.0, requires_grad=True)
    loss, _ = policy_loss("vanilla", old, logp, torch.ones(1, 1), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and torch.isfinite(logp.grad).all()


def _vanilla_reference(old, logp, adv, mask, low, high, c):
    """Naive per-token loop, plain Python floats for the branch logic, torch scalars for autograd."""
    total, count = 0.0, 0
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[b, t]:
                continue
            ratio = torch.exp(logp[b, t] - old[b, t])
            a = adv[b, t]
            unclipped, clipped = -a * ratio, -a * torch.clamp(ratio, 1 - low, 1 + high)
            loss = torch.maximum(unclipped, clipped)
            if a < 0:
                loss = torch.minimum(loss, -a * c)
            total, count = total + loss, count + 1
    return total / count


@pytest.mark.parametrize("seed", range(3))
def test_vanilla_matches_naive_reference_in_value_and_gradient(seed):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=gen, dtype=F64) - 2
    logp = (old + 0.4 * torch.randn(4, 6, generator=gen, dtype=F64)).requires_grad_()
    adv = torch.randn(4, 6, generator=gen, dtype=F64)
    mask = (torch.rand(4, 6, generator=gen) < 0.8).to(F64)
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.5)
    loss, metrics = policy_loss("vanilla", old, logp, adv, mask, **kwargs)
    ref = _vanilla_reference(old, logp, adv, mask, 0.2, 0.28, 1.5)
    (grad,) = torch.autograd.grad(loss, logp)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
    ratio = torch.exp(logp - old).detach()
    on = mask.bool()
    high = ((ratio > 1.28) & (adv > 0))[on].double().mean()
    low = ((ratio < 0.8) & (adv < 0))[on].double().mean()
    assert float(metrics["pg_clipfrac"]) == pytest.approx(float(high + low))
    assert float(metrics["pg_clipfrac_high"]) == pytest.approx(float(high))
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(float(((ratio > 1.5) & (adv < 0))[on].double().mean()))
    assert float(metrics["ppo_kl"]) == pytest.approx(float((old - logp.detach())[on].mean()))
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


# ---------------------------------------------------------------- GSPO


def test_gspo_clips_the_sequence_ratio_by_hand():
    # Token log-ratios 0.2 and 0.4 -> sequence ratio exp(mean) = exp(0.3) = 1.3498588, A = 1.
    old = torch.zeros(1, 2, dtype=F64)
    logp = torch.tensor([[0.2, 0.4]], dtype=F64, requires_grad=True)
    adv, mask = torch.ones(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64)
    # clipRatioHigh 0.2: 1.35 > 1.2 -> loss -1.2, no gradient.
    loss, m = policy_loss("gspo", old, logp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.2) and float(m["pg_clipfrac"]) == pytest.approx(1)
    assert torch.autograd.grad(loss, logp)[0].abs().max() == 0
    # clipRatioHigh 0.4: unclipped, loss -1.3498588; d/dlogp_t = -A * s / |y| = -0.6749294 per token.
    loss, m = policy_loss("gspo", old, logp, adv, mask, clip_ratio_high=0.4, loss_agg_mode="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-1.3498588) and float(m["pg_clipfrac"]) == 0
    assert grad[0].tolist() == pytest.approx([-0.6749294, -0.6749294])


def test_gspo_gradient_is_the_gradient_of_the_sequence_level_objective():
    # GSPO's objective: mean_i max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean_t(logp - old)),
    # written directly per sequence; the token-level form with seq-mean-token-mean must match it.
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(5, 7, generator=gen, dtype=F64) - 2
    logp = (old + 0.1 * torch.randn(5, 7, generator=gen, dtype=F64)).requires_grad_()
    lengths = [7, 3, 5, 1, 6]
    mask = torch.tensor([[1.0] * n + [0.0] * (7 - n) for n in lengths], dtype=F64)
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3], dtype=F64)
    adv = seq_adv[:, None] * mask
    loss, _ = policy_loss("gspo", old, logp, adv, mask, clip_ratio_low=0.05, clip_ratio_high=0.05,
                          loss_agg_mode="seq-mean-token-mean")
    terms = []
    for i, n in enumerate(lengths):
        s = torch.exp((logp[i, :n] - old[i, :n]).mean())
        a = seq_adv[i]
        terms.append(torch.maximum(-a * s, -a * torch.clamp(s, 0.95, 1.05)))
    ref = torch.stack(terms).mean()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    g, rg = torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0]
    assert torch.allclose(g, rg, rtol=1e-10, atol=1e-14)


def test_unknown_policy_loss_lists_the_known_ones():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; known: cispo, clip_cov, .*, vanilla"):
        policy_loss("ppo", x, x, x, x)


# ---------------------------------------------------------------- gradient accumulation

T = 6
LENGTHS = [6, 1, 4, 0, 3, 5, 2, 6]  # one empty response; rows of very different lengths


def _minibatch():
    gen = torch.Generator().manual_seed(42)
    b = len(LENGTHS)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=F64)
    feats = torch.randn(b, T, 3, generator=gen, dtype=F64)
    old = torch.randn(b, T, generator=gen, dtype=F64) - 2
    adv = torch.randn(b, generator=gen, dtype=F64)[:, None] * mask
    return mask, feats, old, adv


def _micro_loss(w, rows, mode, mask, feats, old, adv, normalizer=None):
    """Policy loss of rows ``rows``, the micro-batch trimmed to its own longest response (unequal widths)."""
    width = max(1, int(mask[rows].sum(-1).max()))
    m, f, o, a = mask[rows, :width], feats[rows, :width], old[rows, :width], adv[rows, :width]
    logp = o + 0.5 * torch.tanh(f @ w)  # ratios around 1, some clipped
    loss, _ = policy_loss("vanilla", o, logp, a, m, loss_agg_mode=mode, normalizer=normalizer)
    return loss


def _grad(loss, w):
    return torch.autograd.grad(loss, w)[0]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_of_unequal_sizes_give_the_minibatch_gradient(mode):
    mask, feats, old, adv = _minibatch()
    w = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    scale = T  # the trainer passes maxResponseLength; the whole mini-batch is padded to it here
    whole = policy_loss_whole(w, mode, mask, feats, old, adv, scale)
    full_grad = _grad(whole, w)

    micro = [slice(0, 3), slice(3, 4), slice(4, 8)]
    norm = LossNormalizer.from_masks(mode, [mask[r] for r in micro], scale_factor=scale)
    losses = [_micro_loss(w, r, mode, mask, feats, old, adv, norm) for r in micro]
    assert sum(losses).item() == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(sum(_grad(x, w) for x in losses), full_grad, rtol=1e-10, atol=1e-14)

    # The test can tell: averaging per-micro-batch losses (no normaliser) gives another gradient.
    naive = sum(_micro_loss(w, r, mode, mask, feats, old, adv) for r in micro) / len(micro)
    assert not torch.allclose(_grad(naive, w), full_grad, rtol=1e-3)


def policy_loss_whole(w, mode, mask, feats, old, adv, scale):
    """The whole mini-batch in one call: the reference the accumulated gradients must reproduce."""
    assert mask.shape[-1] == scale  # so the default scale factor (the padded width) is `scale`
    logp = old + 0.5 * torch.tanh(feats @ w)
    loss, _ = policy_loss("vanilla", old, logp, adv, mask, loss_agg_mode=mode)
    plain = aggregate_loss(_loss_mat(logp, old, adv), mask, mode, scale_factor=scale)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-12)
    return loss


def _loss_mat(logp, old, adv):
    ratio = torch.exp(logp - old)
    mat = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    return torch.where(adv < 0, torch.minimum(mat, -adv * 3.0), mat)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_two_data_parallel_ranks_with_mean_allreduce_give_the_minibatch_gradient(mode):
    # Rank 0 holds rows 0-4 in two micro-batches, rank 1 rows 5-7 in one; FSDP averages the ranks'
    # gradients, which dp_size=2 in the normaliser compensates.
    mask, feats, old, adv = _minibatch()
    w = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    full_grad = _grad(policy_loss_whole(w, mode, mask, feats, old, adv, T), w)
    ranks = [[slice(0, 2), slice(2, 5)], [slice(5, 8)]]
    # all_reduce(SUM) of the ranks' local denominators == the whole mini-batch's denominator
    local = [sum(loss_denominator(mask[r], mode, scale_factor=T) for r in micro) for micro in ranks]
    assert sum(local) == loss_denominator(mask, mode, scale_factor=T)
    norm = LossNormalizer(mode=mode, denominator=sum(local), dp_size=2)
    rank_grads = [
        sum(_grad(_micro_loss(w, r, mode, mask, feats, old, adv, norm), w) for r in micro) for micro in ranks
    ]
    assert torch.allclose((rank_grads[0] + rank_grads[1]) / 2, full_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_responses_emptied_by_rejection_still_count_in_the_seq_mean_denominator(mode):
    # verl's trainer divides by global_batch_size (every sequence of the mini-batch); a response that
    # rollout-correction rejection masked whole must not scale the others' gradient up by R/S.
    mask, feats, old, adv = _minibatch()
    mask[[1, 6]] = 0.0  # two more responses rejected whole: 3 of the 8 rows are empty
    adv = adv * mask
    w = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    logp = old + 0.5 * torch.tanh(feats @ w)
    mat = _loss_mat(logp, old, adv).detach()
    # float64 reference, written per sequence: (1 / R) * sum over non-empty s of its sum (or mean)
    per_seq = []
    for s in range(len(LENGTHS)):
        toks = [float(mat[s, t]) for t in range(T) if mask[s, t] > 0]
        if toks:
            per_seq.append(sum(toks) if mode == "seq-mean-token-sum" else sum(toks) / len(toks))
    expected = math.fsum(per_seq) / len(LENGTHS)
    # Two ranks, rank 1 holding only empty rows in one of its micro-batches; all-reduced counts.
    ranks = [[slice(0, 2), slice(2, 5)], [slice(5, 7), slice(7, 8)]]
    local = [sum(loss_denominator(mask[r], mode) for r in micro) for micro in ranks]
    assert sum(local) == len(LENGTHS)
    norm = LossNormalizer(mode=mode, denominator=sum(local), dp_size=2)
    total = sum(_micro_loss(w, r, mode, mask, feats, old, adv, norm).item() for micro in ranks for r in micro)
    assert total / 2 == pytest.approx(expected, rel=1e-12)  # FSDP's mean over the 2 ranks
    assert aggregate_loss(mat, mask, mode).item() == pytest.approx(expected, rel=1e-12)


def test_normalizer_takes_the_widest_mask_as_default_scale_factor_and_checks_its_mode():
    mask = _minibatch()[0]
    norm = LossNormalizer.from_masks("seq-mean-token-sum-norm", [mask[:2, :6], mask[2:, :4]])
    assert norm.denominator == 8 * 6  # 8 rows * widest micro-batch (6)
    x = torch.zeros(2, 6, dtype=F64)
    with pytest.raises(ValueError, match="normalizer was built for 'seq-mean-token-sum-norm'"):
        policy_loss("vanilla", x, x, x, mask[:2], normalizer=norm)
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        LossNormalizer.from_masks("token-mean", mask, dp_size=2)


# ---------------------------------------------------------------- real 2-rank gloo run


def _gloo_worker(rank: int, world: int, init_file: str, mode: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mask, feats, old, adv = _minibatch()
        w = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
        full_grad = _grad(policy_loss_whole(w, mode, mask, feats, old, adv, T), w)
        micro = [[slice(0, 2), slice(2, 5)], [slice(5, 8)]][rank]
        norm = LossNormalizer.from_masks(mode, [mask[r] for r in micro], scale_factor=T, dp_size=world)
        grad = sum(_grad(_micro_loss(w, r, mode, mask, feats, old, adv, norm), w) for r in micro)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grad /= world  # FSDP/DDP's default: the mean over ranks
        assert torch.allclose(grad, full_grad, rtol=1e-10, atol=1e-14), (rank, grad, full_grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_normalizer_all_reduces_counts_across_real_gloo_ranks(mode, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(2, os.fspath(tmp_path / "rendezvous"), mode), nprocs=2, join=True)
