"""verl's other policy losses (clip_cov, kl_cov, cispo, sapo, geo_mean, gpg, dppo_tv, dppo_kl, dro) against float64
references written here from the papers' formulas (plain numpy loops over the same random
inputs), for every aggregation mode the job spec allows with each."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpo_api.spec import SEQUENCE_LOSSES, PolicyLossConfig
from grpo_trainer.algorithms import LOSS_AGG_MODES, POLICY_LOSSES, aggregate_loss, policy_loss

F64 = torch.float64
CONFIG = PolicyLossConfig()
LENGTHS = (7, 3, 0, 5, 1, 6)  # row 2 is an empty response


def batch(seed: int = 0):
    """old/new log-probs, outcome advantages (one per response, some negative, one zero) and masks."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(LENGTHS), max(LENGTHS)
    old = -torch.rand(rows, width, generator=g, dtype=F64) * 3 - 0.05
    logp = old + (torch.rand(rows, width, generator=g, dtype=F64) - 0.5) * 0.9  # ratios ~ 0.64 .. 1.57
    adv = torch.tensor([1.3, -0.7, 0.4, 0.0, -1.6, 0.9], dtype=F64).unsqueeze(-1).expand(rows, width).clone()
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in LENGTHS], dtype=F64)
    return old, logp, adv, mask


def modes_for(loss: str) -> list[str]:
    return ["seq-mean-token-mean"] if loss in SEQUENCE_LOSSES else list(LOSS_AGG_MODES)


def token_rows(mask):
    """(row, [its response token positions]) for every row, the empty one included."""
    return [(i, [t for t in range(mask.shape[1]) if mask[i, t] > 0]) for i in range(mask.shape[0])]


def run(mode: str, loss_agg_mode: str, *tensors, config=CONFIG, **kwargs):
    old, logp, adv, mask = tensors
    logp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(mode, old, logp, adv, mask, loss_agg_mode=loss_agg_mode, config=config, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, metrics


# ---------------------------------------------------------------- the references (numpy, float64)


def ref_cispo(old, logp, adv, mask, low=0.2, high=0.2):
    """MiniMax-M1 eq. 4: J = sg(clip(r, 1-low, 1+high)) A log pi; loss -J per token. d/dlogp = -clip(r) A."""
    r = np.exp(logp - old)
    w = np.clip(r, 1 - low, 1 + high)
    return -w * adv * logp, -w * adv


def ref_sapo(old, logp, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """SAPO: loss -f(r) A, f(r) = 4/tau sigmoid(tau (r - 1)); d/dlogp = -A 4 sigmoid'(.) r."""
    r = np.exp(logp - old)
    tau = np.where(adv > 0, tau_pos, tau_neg)
    s = 1 / (1 + np.exp(-tau * (r - 1)))
    return -(4 / tau) * s * adv, -adv * 4 * s * (1 - s) * r


def ref_gpg(old, logp, adv, mask):
    return -adv * logp, -adv


def ref_dppo(old, logp, adv, mask, inside, c=3.0):
    """DPPO: -A sg(min(r, c)) log pi on the tokens inside the trust region; d/dlogp = -A min(r, c) there."""
    w = np.minimum(np.exp(logp - old), c) * inside
    return -adv * w * logp, -adv * w


def ref_dppo_tv(old, logp, adv, mask, low=0.05, high=0.05):
    moved = np.exp(logp) - np.exp(old)
    return ref_dppo(old, logp, adv, mask, np.where(adv > 0, moved <= high, moved >= -low))


def ref_dppo_kl(old, logp, adv, mask, low=0.01, high=0.01):
    p, q = np.exp(logp), np.exp(old)
    kl = q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))  # KL(Bern(p_old) || Bern(p))
    return ref_dppo(old, logp, adv, mask, np.where(adv > 0, (kl <= high) | (p <= q), (kl <= low) | (p >= q)))


def ref_dro(old, logp, adv, mask, beta=0.3):
    """DRO: -(A log pi - beta/2 (log pi - log pi_old)^2); d/dlogp = -(A - beta (log pi - log pi_old))."""
    x = logp - old
    return -(adv * logp - 0.5 * beta * x**2), -(adv - beta * x)


def ref_geo_mean_per_sequence(old, logp, adv, mask, low=0.2, high=0.2):
    """GMPO eq. 5 with verl's sign-aware clip in log space: per response i,
    L_i = -A_i exp(mean_t c_t), c_t = log r_t clamped to [-low, high] where that lowers A log r."""
    losses = []
    for i, toks in token_rows(mask):
        if not toks:
            losses.append(0.0)  # -A * exp(0 / eps) with A's mean over no tokens = 0
            continue
        a = float(np.mean([adv[i, t] for t in toks]))
        cs = []
        for t in toks:
            x = logp[i, t] - old[i, t]
            clamped = min(max(x, -low), high)
            cs.append(min(x, clamped) if a > 0 else max(x, clamped) if a < 0 else 0.0)
        losses.append(-a * math.exp(sum(cs) / len(cs)))
    return np.array(losses)


def as_np(*tensors):
    return [t.detach().numpy() for t in tensors]


def grad_weights(mask: torch.Tensor, mode: str) -> np.ndarray:
    """d loss / d loss_mat[i, t] of each aggregation mode: the factor each token's loss enters with."""
    ones = torch.zeros_like(mask, requires_grad=True)
    (w,) = torch.autograd.grad(aggregate_loss(ones, mask, mode), ones)
    return w.numpy()


# ---------------------------------------------------------------- per-token losses, every allowed mode


@pytest.mark.parametrize("name,ref,kwargs", [
    ("cispo", ref_cispo, {}), ("sapo", ref_sapo, {}), ("gpg", ref_gpg, {}), ("dro", ref_dro, {}),
    # bounds a share of the tokens crosses, both ways
    ("dppo_tv", ref_dppo_tv, {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05}),
    ("dppo_kl", ref_dppo_kl, {"clip_ratio_low": 0.01, "clip_ratio_high": 0.01}),
])
def test_token_losses_match_the_float64_reference_in_every_allowed_mode(name, ref, kwargs):
    tensors = batch()
    loss_mat, dloss = ref(*as_np(*tensors))
    if name.startswith("dppo"):
        assert 0 < (dloss == 0).sum() - (tensors[2] == 0).sum().item() < (tensors[3] > 0).sum()
    for mode in modes_for(name):
        loss, grad, _ = run(name, mode, *tensors, config=PolicyLossConfig(dro_beta=0.3), **kwargs)
        expected = aggregate_loss(torch.from_numpy(loss_mat), tensors[3], mode)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-12), mode
        # the gradient of each token: its own derivative times its weight in the aggregation;
        # nothing reaches padding or the empty response
        np.testing.assert_allclose(grad.numpy(), dloss * grad_weights(tensors[3], mode) * tensors[3].numpy(),
                                   rtol=1e-10, atol=1e-14)


def test_cispo_keeps_the_gradient_of_clipped_tokens_and_reports_them():
    # ratio 1.5 with A > 0 and ratio 0.5 with A < 0: PPO would drop both gradients; CISPO weights
    # them by the clipped ratio 1.2 / 0.8.
    old = torch.zeros(1, 2, dtype=F64)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    loss, grad, m = run("cispo", "seq-mean-token-sum", old, logp, adv, torch.ones(1, 2, dtype=F64))
    assert grad.tolist() == [[pytest.approx(-1.2), pytest.approx(0.8)]]
    assert float(m["pg_clipfrac"]) == pytest.approx(1.0) and float(m["pg_clipfrac_lower"]) == 0
    # CISPO's recipe: clip_ratio_low 10 leaves the ratio unbounded below
    _, grad, _ = run("cispo", "token-mean", old, logp, adv, torch.ones(1, 2, dtype=F64), clip_ratio_low=10.0)
    assert grad[0, 1].item() == pytest.approx(0.5 / 2)


def test_sapo_gate_has_slope_one_on_policy_and_its_temperatures_apply():
    old, logp, adv, mask = batch()
    _, grad, m = run("sapo", "seq-mean-token-mean", old, old.clone(), adv, mask)
    # r = 1: f'(1) = 1, the policy gradient -A (times the aggregation weight)
    np.testing.assert_allclose(grad.numpy(), -adv.numpy() * grad_weights(mask, "seq-mean-token-mean") * mask.numpy(),
                               rtol=1e-12, atol=1e-15)
    assert float(m["pg_clipfrac"]) == 0 and float(m["ppo_kl"]) == 0
    config = PolicyLossConfig(tau_pos=2.0, tau_neg=3.0)
    loss, _, _ = run("sapo", "seq-mean-token-mean", old, logp, adv, mask, config=config)
    loss_mat, _ = ref_sapo(*as_np(old, logp, adv, mask), tau_pos=2.0, tau_neg=3.0)
    assert loss.item() == pytest.approx(aggregate_loss(torch.from_numpy(loss_mat), mask, "seq-mean-token-mean").item())


# ---------------------------------------------------------------- GMPO


def test_geo_mean_is_the_mean_over_responses_of_the_clipped_geometric_ratio():
    old, logp, adv, mask = batch()
    for low, high in ((0.2, 0.2), (0.05, 0.4), (10.0, 10.0)):
        loss, grad, m = run("geo_mean", "seq-mean-token-mean", old, logp, adv, mask,
                            clip_ratio_low=low, clip_ratio_high=high)
        per_seq = ref_geo_mean_per_sequence(*as_np(old, logp, adv, mask), low=low, high=high)
        # verl: torch.mean over every response of the batch, the empty one too (rel 1e-7: verl's
        # 1e-8 guards in the per-response token means, kept here)
        assert loss.item() == pytest.approx(per_seq.mean(), rel=1e-7)
        # d L_i / d logp_t = L_i / n_i where the token's log-ratio was kept, 0 where clamped
        for i, toks in token_rows(mask):
            for t in toks:
                x = (logp[i, t] - old[i, t]).item()
                kept = (-low <= x <= high) or (x > high and adv[i, t] < 0) or (x < -low and adv[i, t] > 0)
                expected = per_seq[i] / len(toks) / len(LENGTHS) if kept else 0.0
                assert grad[i, t].item() == pytest.approx(expected, rel=1e-7, abs=1e-14), (low, high, i, t)
    assert grad[2].abs().sum() == 0 and (grad * (1 - mask)).abs().sum() == 0
    # clip fractions: clamped tokens with A > 0 / A < 0, over response tokens
    _, _, m = run("geo_mean", "seq-mean-token-mean", old, logp, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    log_ratio = (logp - old).numpy()
    clamped = (np.abs(log_ratio) > 0.1) & (mask.numpy() > 0)
    a = adv.numpy()
    assert float(m["pg_clipfrac"]) == pytest.approx((clamped & (a > 0)).sum() / mask.sum().item(), abs=1e-7)
    assert float(m["pg_clipfrac_lower"]) == pytest.approx((clamped & (a < 0)).sum() / mask.sum().item(), abs=1e-7)


# ---------------------------------------------------------------- Clip-Cov and KL-Cov


def covariances(old, logp, adv, mask):
    """(A - mean A)(logp - mean logp), the means over response tokens (the paper's eq. 8 term)."""
    cells = [(i, t) for i, toks in token_rows(mask) for t in toks]
    mean_a = np.mean([adv[c] for c in cells])
    mean_l = np.mean([logp[c] for c in cells])
    return {c: (adv[c] - mean_a) * (logp[c] - mean_l) for c in cells}


def ppo_token(old, logp, adv, c, low=0.2, high=0.2):
    r = math.exp(logp[c] - old[c])
    unclipped, clipped = -adv[c] * r, -adv[c] * min(max(r, 1 - low), 1 + high)
    return max(unclipped, clipped), clipped > unclipped


def test_clip_cov_cuts_the_gradient_of_tokens_in_the_covariance_band():
    tensors = batch()
    old, logp, adv, mask = as_np(*tensors)
    cov = covariances(old, logp, adv, mask)
    lb, ub = np.quantile(list(cov.values()), [0.3, 0.8])
    config = PolicyLossConfig(clip_cov_ratio=1.0, clip_cov_lb=float(lb), clip_cov_ub=float(ub))
    cut = {c for c, v in cov.items() if lb < v < ub and not ppo_token(old, logp, adv, c)[1]}
    assert 0 < len(cut) < len(cov)
    loss_mat = np.zeros_like(old)
    for c in cov:
        loss_mat[c] = 0.0 if c in cut else ppo_token(old, logp, adv, c)[0]
    for mode in LOSS_AGG_MODES:
        loss, grad, m = run("clip_cov", mode, *tensors, config=config)
        assert loss.item() == pytest.approx(aggregate_loss(torch.from_numpy(loss_mat), tensors[3], mode).item(),
                                            rel=1e-12, abs=1e-12), mode
        assert {c for c in cov if grad[c].item() == 0 and loss_mat[c] == 0} >= cut
        assert float(m["pg_clipfrac"]) == pytest.approx(len(cut) / len(cov), abs=1e-7)


def test_clip_cov_cuts_clip_cov_ratio_of_the_tokens_at_random_among_the_candidates():
    tensors = batch()
    tensors[2][3] = 0.5  # no zero advantage: a cut token is then one whose gradient is 0
    old, logp, adv, mask = as_np(*tensors)
    cov = covariances(old, logp, adv, mask)
    config = PolicyLossConfig(clip_cov_ratio=0.1, clip_cov_lb=-1e9, clip_cov_ub=1e9)  # int(0.1 * 22) = 2
    candidates = {c for c in cov if not ppo_token(old, logp, adv, c)[1]}
    seen = set()
    for seed in range(6):
        torch.manual_seed(seed)
        loss, grad, m = run("clip_cov", "token-mean", *tensors, config=config)
        cut = {c for c in candidates if grad[c].item() == 0}  # the others' gradient the PPO clip took
        assert len(cut) == 2 and float(m["pg_clipfrac"]) == pytest.approx(2 / len(cov), abs=1e-7)
        seen |= cut
    assert len(seen) > 2  # not always the same two


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    tensors = batch()
    old, logp, adv, mask = as_np(*tensors)
    cov = covariances(old, logp, adv, mask)
    config = PolicyLossConfig(kl_cov_ratio=0.2, ppo_kl_coef=0.7)  # int(0.2 * 22 tokens) = 4
    top = sorted(cov, key=cov.get, reverse=True)[:4]
    loss_mat, dloss = np.zeros_like(old), np.zeros_like(old)
    for c in cov:
        x = logp[c] - old[c]
        loss_mat[c] = -adv[c] * math.exp(x) + (0.7 * abs(x) if c in top else 0.0)
        dloss[c] = -adv[c] * math.exp(x) + (0.7 * np.sign(x) if c in top else 0.0)
    for mode in LOSS_AGG_MODES:
        loss, grad, m = run("kl_cov", mode, *tensors, config=config)
        assert loss.item() == pytest.approx(aggregate_loss(torch.from_numpy(loss_mat), tensors[3], mode).item(),
                                            rel=1e-12, abs=1e-12), mode
        np.testing.assert_allclose(grad.numpy(), dloss * grad_weights(tensors[3], mode) * mask, rtol=1e-10,
                                   atol=1e-14)
    # verl's ppo_kl for kl_cov: the mean absolute log-ratio
    assert float(m["ppo_kl"]) == pytest.approx(np.mean([abs(logp[c] - old[c]) for c in cov]), rel=1e-6)
    # at least one token is penalised however small the ratio
    tiny = PolicyLossConfig(kl_cov_ratio=1e-6, ppo_kl_coef=0.7)
    best = top[0]
    loss_mat[:] = 0
    for c in cov:
        x = logp[c] - old[c]
        loss_mat[c] = -adv[c] * math.exp(x) + (0.7 * abs(x) if c == best else 0.0)
    loss, _, _ = run("kl_cov", "token-mean", *tensors, config=tiny)
    assert loss.item() == pytest.approx(aggregate_loss(torch.from_numpy(loss_mat), tensors[3], "token-mean").item())


# ---------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "cispo", "sapo", "geo_mean", "gpg", "dppo_tv", "dppo_kl",
                                  "dro"])
def test_an_all_masked_batch_gives_zero_loss_and_no_nan(name):
    old, logp, adv, _ = batch()
    mask = torch.zeros_like(old)
    for mode in modes_for(name):
        loss, grad, metrics = run(name, mode, old, logp, adv, mask, config=PolicyLossConfig(dro_beta=0.3))
        assert loss.item() == 0 and torch.isfinite(grad).all() and grad.abs().sum() == 0
        assert all(torch.isfinite(torch.as_tensor(v)) for v in metrics.values())


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "sapo", "dro"])
def test_losses_with_parameters_refuse_to_run_without_the_config(name):
    old, logp, adv, mask = batch()
    with pytest.raises(ValueError, match=f"policy loss '{name}' reads its parameters from config"):
        policy_loss(name, old, logp, adv, mask, loss_agg_mode="seq-mean-token-mean")


def test_dro_refuses_a_config_without_its_beta():
    with pytest.raises(ValueError, match="policy loss 'dro' needs dro_beta > 0"):
        run("dro", "token-mean", *batch())


def test_metrics_carry_verls_names():
    tensors = batch()
    config = PolicyLossConfig(dro_beta=0.3)
    names = {n: set(run(n, modes_for(n)[0], *tensors, config=config)[2]) for n in POLICY_LOSSES.names()}
    three = {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert names["cispo"] == names["sapo"] == names["geo_mean"] == names["dppo_tv"] == names["dppo_kl"] == three
    assert names["clip_cov"] == {"pg_clipfrac", "ppo_kl"} and names["kl_cov"] == names["dro"] == {"ppo_kl"}
