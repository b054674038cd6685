"""PPO's GAE and the critic's clipped value loss (grpo_trainer.algorithms), in float64 against
hand-worked cases and an independent reference: the published recursion (Schulman et al. 2016,
eq. 16) run over each response's own tokens in plain Python."""

from __future__ import annotations

import math
import random

import pytest
import torch

from grpo_trainer.algorithms import KLController, LossNormalizer, compute_gae_advantage_return, value_loss

F64 = torch.float64


def _gae(rewards, values, mask, gamma=1.0, lam=1.0):
    return compute_gae_advantage_return(torch.tensor(rewards, dtype=F64), torch.tensor(values, dtype=F64),
                                        torch.tensor(mask, dtype=F64), gamma=gamma, lam=lam)


def _whiten(per_sample: list[list[float]]) -> list[list[float]]:
    """(x - mean) / sqrt(unbiased var + 1e-8) over every token of the batch, with verl's guards
    (masked_mean divides by count + 1e-8)."""
    flat = [x for row in per_sample for x in row]
    n = len(flat)
    mean = sum(flat) / (n + 1e-8)
    var = sum((x - mean) ** 2 for x in flat) / (n + 1e-8) * n / (n - 1)
    return [[(x - mean) / (var + 1e-8) ** 0.5 for x in row] for row in per_sample]


def reference_gae(rewards, values, mask, gamma, lam):
    """The recursion over the tokens where mask is 1 only: a masked position (padding, a tool's
    tokens) is not a step of the episode."""
    raw, rets = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        steps = [t for t, m in enumerate(m_row) if m]
        adv, nxt_v, nxt_a = {}, 0.0, 0.0
        for t in reversed(steps):
            delta = r_row[t] + gamma * nxt_v - v_row[t]
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = v_row[t]
            adv[t] = nxt_a
        raw.append([adv[t] for t in steps])
        rets.append([adv[t] + v_row[t] for t in steps])
    return raw, rets


def test_gae_by_hand_with_gamma_and_lambda():
    # delta_2 = 1 - 0.8 = 0.2;              A_2 = 0.2
    # delta_1 = 0.9 * 0.8 - 0.2 = 0.52;     A_1 = 0.52 + 0.45 * 0.2 = 0.61
    # delta_0 = 0.9 * 0.2 - 0.5 = -0.32;    A_0 = -0.32 + 0.45 * 0.61 = -0.0455
    adv, ret = _gae([[0, 0, 1]], [[0.5, 0.2, 0.8]], [[1, 1, 1]], gamma=0.9, lam=0.5)
    assert ret[0].tolist() == pytest.approx([-0.0455 + 0.5, 0.61 + 0.2, 0.2 + 0.8], abs=1e-12)
    assert adv[0].tolist() == pytest.approx(_whiten([[-0.0455, 0.61, 0.2]])[0], abs=1e-12)


def test_with_gamma_and_lambda_one_the_returns_are_the_outcome_on_every_token():
    _, ret = _gae([[0, 0, 1], [0, -1, 0]], [[0.5, 0.2, 0.8], [0.3, 0.9, 7.0]], [[1, 1, 1], [1, 1, 0]])
    assert ret.flatten().tolist() == pytest.approx([1, 1, 1, -1, -1, 0], abs=1e-12)


def test_a_masked_token_inside_a_response_passes_value_and_advantage_through():
    """A tool's tokens in a multi-turn response are masked: they are not the policy's actions."""
    adv, ret = _gae([[0, 0, 1]], [[0.5, 9.0, 0.8]], [[1, 0, 1]])
    # over the two real steps: A_2 = 1 - 0.8 = 0.2, A_0 = 0 + 0.8 - 0.5 + 0.2 = 0.5
    assert ret[0].tolist() == pytest.approx([1.0, 0.0, 1.0], abs=1e-12)
    assert adv[0, 1] == 0 and adv[0, [0, 2]].tolist() == pytest.approx(_whiten([[0.5, 0.2]])[0], abs=1e-12)


def test_gae_matches_the_published_recursion_on_random_batches():
    rng = random.Random(7)
    for _ in range(20):
        batch, width = rng.randint(2, 6), rng.randint(2, 9)
        gamma, lam = rng.choice([1.0, 0.99, 0.7]), rng.choice([1.0, 0.95, 0.0])
        mask = [[1 if t < rng.randint(1, width) or rng.random() < 0.2 else 0 for t in range(width)]
                for _ in range(batch)]
        for row in mask:
            row[0] = 1
        rewards = [[rng.uniform(-1, 1) * m for m in row] for row in mask]
        values = [[rng.uniform(-2, 2) for _ in row] for row in mask]
        adv, ret = _gae(rewards, values, mask, gamma, lam)
        raw, rets = reference_gae(rewards, values, mask, gamma, lam)
        whitened = _whiten(raw)
        for i, row in enumerate(mask):
            steps = [t for t, m in enumerate(row) if m]
            assert ret[i, steps].tolist() == pytest.approx(rets[i], abs=1e-10)
            assert adv[i, steps].tolist() == pytest.approx(whitened[i], abs=1e-10)
            assert all(adv[i, t] == 0 and ret[i, t] == 0 for t, m in enumerate(row) if not m)


def test_value_loss_by_hand():
    """0.5 * mean(max((V - R)^2, (clip(V, V_old +- 0.5) - R)^2))."""
    vpreds = torch.tensor([[1.0, 0.0, 1.0, 4.0]], dtype=F64)
    old = torch.tensor([[0.2, 0.1, 0.0, 0.0]], dtype=F64)
    returns = torch.tensor([[0.5, 0.5, 1.2, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)     # the last token is padding
    # token 0: clipped 0.7, losses 0.25 / 0.04 -> 0.25;  token 1: clip leaves 0.0, 0.25 / 0.25 -> 0.25
    # token 2: clipped 0.5, losses 0.04 / 0.49 -> 0.49 (the clipped term wins)
    loss, metrics = value_loss(vpreds, returns, old, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.25 + 0.49) / 3, abs=1e-12)
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / (3 + 1e-8), abs=1e-12)   # verl's masked_mean guard


def test_value_loss_gradient_reaches_only_unclipped_predictions():
    vpreds = torch.tensor([[1.0, 0.3]], dtype=F64, requires_grad=True)
    loss, _ = value_loss(vpreds, torch.tensor([[1.2, 0.5]], dtype=F64), torch.tensor([[0.0, 0.2]], dtype=F64),
                         torch.ones(1, 2, dtype=F64), cliprange_value=0.5)
    loss.backward()
    # token 0's clipped term (0.5 vs 1.2) wins: the clamp cuts its gradient; token 1: 0.5 * 2 * (0.3 - 0.5) / 2
    assert vpreds.grad.flatten().tolist() == pytest.approx([0.0, -0.1], abs=1e-12)


def test_value_loss_micro_batches_add_up_to_the_whole_batch():
    torch.manual_seed(0)
    vpreds, old, ret = (torch.randn(4, 5, dtype=F64) for _ in range(3))
    mask = (torch.rand(4, 5) > 0.3).to(F64)
    for mode in ("token-mean", "seq-mean-token-mean"):
        whole, _ = value_loss(vpreds, ret, old, mask, cliprange_value=0.2, loss_agg_mode=mode)
        norm = LossNormalizer.from_masks(mode, [mask[:2], mask[2:]])
        parts = sum(value_loss(vpreds[s], ret[s], old[s], mask[s], cliprange_value=0.2, loss_agg_mode=mode,
                               normalizer=norm)[0] for s in (slice(0, 2), slice(2, 4)))
        assert parts.item() == pytest.approx(whole.item(), abs=1e-12)


def test_vf_explained_var_by_hand_over_the_response_tokens():
    from grpo_trainer.critic import explained_variance

    # returns 1, 2, 3 and values 1, 2, 2 on the response; the padding's 100 is not a token.
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=F64)
    values = torch.tensor([[1.0, 2.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    # Var(0, 0, 1) = 1/3 and Var(1, 2, 3) = 1, both with n - 1 (verl's torch.var)
    assert explained_variance(returns, values, mask) == pytest.approx(1 - (1 / 3) / (1 + 1e-5), abs=1e-12)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0, abs=1e-12)    # a perfect critic


def test_the_adaptive_kl_coefficient_moves_toward_the_target_by_hand():
    """Ziegler et al. 2019 / verl: value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon."""
    ctrl = KLController("adaptive", 0.1, target_kl=0.02, horizon=1000)
    ctrl.update(current_kl=0.021, n_steps=100)             # 5 % over: 1 + 0.05 * 100 / 1000
    assert ctrl.value == pytest.approx(0.1 * 1.005, abs=1e-15)
    ctrl.update(current_kl=0.1, n_steps=100)               # 400 % over, clipped to +20 %: 1 + 0.2 * 0.1
    assert ctrl.value == pytest.approx(0.1 * 1.005 * 1.02, abs=1e-15)
    ctrl.update(current_kl=0.0, n_steps=500)               # far under, clipped to -20 %: 1 - 0.2 * 0.5
    assert ctrl.value == pytest.approx(0.1 * 1.005 * 1.02 * 0.9, abs=1e-15)
    fixed = KLController("fixed", 0.1)
    fixed.update(current_kl=5.0, n_steps=1000)
    assert fixed.value == 0.1


# ---------------------------------------------------------------- rollout correction (TIS / MIS)

from grpo_trainer.algorithms.rollout_correction import rollout_is_weights, rollout_rejection_mask  # noqa: E402

# pi_old / pi_rollout per token: 1.5, 0.5, 4 | 1.1, 1.1, (padding)
RATIO = torch.tensor([[1.5, 0.5, 4.0], [1.1, 1.1, 9.0]], dtype=F64)
MASK3 = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
LOG_RATIO = RATIO.log() * MASK3


def test_token_tis_truncates_each_ratio_and_zeroes_padding():
    w = rollout_is_weights(LOG_RATIO, MASK3, "token", upper=2.0)
    assert w.flatten().tolist() == pytest.approx([1.5, 0.5, 2.0, 1.1, 1.1, 0.0], abs=1e-12)


def test_sequence_is_is_the_truncated_product_on_every_token():
    w = rollout_is_weights(LOG_RATIO, MASK3, "sequence", upper=2.0)
    # 1.5 * 0.5 * 4 = 3 -> 2 (truncated); 1.1 * 1.1 = 1.21
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 2.0, 1.21, 1.21, 0.0], abs=1e-12)


def test_sequence_is_metrics_report_the_raw_weights_as_verl():
    from grpo_trainer.algorithms.rollout_correction import correction_metrics

    w = rollout_is_weights(LOG_RATIO, MASK3, "sequence", upper=2.0)
    seq = LOG_RATIO.sum(dim=-1)     # log(3) and log(1.21)
    m = correction_metrics(LOG_RATIO[MASK3.bool()], MASK3[MASK3.bool()], torch.tensor([False, False]),
                           w[MASK3.bool()], seq)
    # raw: 1.5 * 0.5 * 4 = 3 (truncated to 2 in the loss) and 1.21; the mean is the applied weights'
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0, abs=1e-12)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(1.21, abs=1e-12)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((3 * 2.0 + 2 * 1.21) / 5, abs=1e-12)


def test_icepop_zeroes_weights_outside_the_band():
    w = rollout_is_weights(LOG_RATIO, MASK3, "token", upper=2.0, lower=0.8)
    assert w.flatten().tolist() == pytest.approx([1.5, 0.0, 0.0, 1.1, 1.1, 0.0], abs=1e-12)


def test_icepop_counts_the_tokens_it_zeroed_as_verl_oob_ratio():
    from grpo_trainer.algorithms.rollout_correction import correction_metrics

    def oob(level):
        w = rollout_is_weights(LOG_RATIO, MASK3, level, upper=2.0, lower=0.8)
        m = correction_metrics(LOG_RATIO[MASK3.bool()], MASK3[MASK3.bool()], torch.tensor([False, False]),
                               w[MASK3.bool()], LOG_RATIO.sum(dim=-1) if level == "sequence" else None, icepop=True)
        return m["rollout_corr/rollout_is_oob_ratio"]
    # token: 0.5 and 4 of the 5 response tokens fall outside [0.8, 2]
    assert oob("token") == pytest.approx(2 / 5, abs=1e-12)
    # sequence: row 0's weight 3 zeroes its 3 tokens; row 1's 1.21 keeps its 2
    assert oob("sequence") == pytest.approx(3 / 5, abs=1e-12)
    w = rollout_is_weights(LOG_RATIO, MASK3, "token", upper=2.0)    # TIS zeroes nothing: no such metric
    assert "rollout_corr/rollout_is_oob_ratio" not in correction_metrics(
        LOG_RATIO[MASK3.bool()], MASK3[MASK3.bool()], torch.tensor([False, False]), w[MASK3.bool()])


def test_token_mis_rejects_tokens_outside_the_ratio_band():
    # k1 = log(pi_rollout / pi_old): kept when 1/2 <= pi_rollout / pi_old <= 2, i.e. ratio in [0.5, 2]
    kept = rollout_rejection_mask(LOG_RATIO, MASK3, ["token_k1"], upper=2.0)
    assert kept.flatten().tolist() == [1, 1, 0, 1, 1, 0]


def test_sequence_mis_drops_a_whole_response():
    # seq_mean_k3: the mean of exp(l) - 1 - l over the response; row 0's 4x token pushes it over 0.3
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 4.0)]
    assert sum(k3) / 3 > 0.3 > 2 * (1.1 - 1 - math.log(1.1)) / 2
    kept = rollout_rejection_mask(LOG_RATIO, MASK3, ["seq_mean_k3"], upper=0.3)
    assert kept.flatten().tolist() == [0, 0, 0, 1, 1, 0]
    both = rollout_rejection_mask(LOG_RATIO, MASK3, ["token_k1", "seq_max_k2"], upper=2.0)
    # token_k1 drops token 2 of row 0; seq_max_k2 (0.5 * log(4)^2 = 0.96 <= 2) keeps both rows
    assert both.flatten().tolist() == [1, 1, 0, 1, 1, 0]
