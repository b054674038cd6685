"""Advantage estimators, registries, KL estimators of grpo_trainer.algorithms, and the
spec naming the same algorithms.

Hand-worked cases carry their arithmetic in comments; random cases compare against float64
references written as naive per-sample Python loops (independent of the vectorised code).
"""

from __future__ import annotations

import math
import statistics
import typing

import numpy as np
import pytest
import torch

from grpo_api.spec import AdvEstimator, AlgorithmSpec
from grpo_trainer.algorithms import (
    ADV_ESTIMATORS,
    KL_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    compute_advantages,
    kl_penalty,
    register_adv_est,
)

F64 = torch.float64


def outcome_rewards(scores: list[float], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome rewards as the trainer builds them: the score on each response's last token."""
    rewards = torch.zeros(len(scores), width, dtype=F64)
    mask = torch.zeros(len(scores), width, dtype=F64)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        mask[i, :length] = 1
        if length:
            rewards[i, length - 1] = score
    return rewards, mask


def per_sample(advantages: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The scalar an outcome estimator broadcast over each response (checks it is constant)."""
    out = []
    for row, m in zip(advantages, mask):
        values = row[m.bool()]
        assert torch.allclose(values, values[0].expand_as(values)), "advantage not constant over the response"
        assert torch.all(row[~m.bool()] == 0), "advantage leaked into padding"
        out.append(values[0].item())
    return out


# ---------------------------------------------------------------- registries


def test_registry_rejects_duplicates_and_lists_known_names_on_unknown_lookup():
    reg = Registry("widget")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="'a' is already registered"):
        reg.register("a")(lambda: 2)
    assert reg.get("a")() == 1  # the first registration survived
    with pytest.raises(ValueError, match=r"unknown widget 'b'; known: a"):
        reg.get("b")


def test_builtin_estimator_names_are_taken_and_typos_fail_loudly():
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda *a, **k: None)
    rewards, mask = outcome_rewards([1.0, 0.0], [2, 2], 2)
    with pytest.raises(ValueError) as err:
        compute_advantages("gpro", rewards, mask, [0, 0])
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo"):
        assert name in str(err.value)


def test_custom_registry_is_used_instead_of_the_default():
    reg = Registry("advantage estimator")

    @reg.register("constant")
    def constant(token_level_rewards, response_mask, groups, *, norm_adv_by_std, gamma, epsilon):
        return response_mask * 7, response_mask * 7

    rewards, mask = outcome_rewards([1.0, 0.0], [2, 1], 2)
    adv, _ = compute_advantages("constant", rewards, mask, [0, 0], registry=reg)
    assert adv.tolist() == [[7, 7], [7, 0]]
    assert "constant" not in ADV_ESTIMATORS


# ---------------------------------------------------------------- hand-worked estimators

# Groups: a = three samples scoring 1, 0, 0; b = two scoring 2, 4; c = one sample scoring 0.5.
IDS = ["a", "a", "a", "b", "b", "c"]
SCORES = [1.0, 0.0, 0.0, 2.0, 4.0, 0.5]
LENGTHS = [1, 2, 3, 4, 2, 3]


def test_grpo_hand_worked():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 5)
    adv, returns = compute_advantages("grpo", rewards, mask, IDS)
    # a: mean 1/3; Bessel var = ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std = 1/sqrt(3)
    #    1 -> (2/3) sqrt(3) = 1.1547005;  0 -> -(1/3) sqrt(3) = -0.5773503
    # b: mean 3, std = sqrt((1 + 1) / 1) = sqrt(2): 2 -> -1/sqrt(2), 4 -> +1/sqrt(2)
    # c: alone -> mean 0, std 1: 0.5 / (1 + 1e-6)
    expected = [1.1547005, -0.5773503, -0.5773503, -0.7071068, 0.7071068, 0.5]
    assert per_sample(adv, mask) == pytest.approx(expected, abs=2e-6)
    assert torch.equal(returns, adv)


def test_grpo_scores_are_the_sum_of_token_rewards():
    # Rewards spread over tokens: 0.5 + 0.5 = 1 and 0 + 0 -> the group {1, 0} -> +-1/sqrt(2).
    rewards = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, _ = compute_advantages("grpo", rewards, mask, [0, 0])
    assert per_sample(adv, mask) == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-6)


def test_drgrpo_is_score_minus_group_mean_without_std_scaling():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 5)
    adv, _ = compute_advantages("grpo", rewards, mask, IDS, norm_adv_by_std=False)
    # a: 1 - 1/3, 0 - 1/3, 0 - 1/3;  b: 2 - 3, 4 - 3;  c: alone, mean 0 -> 0.5
    assert per_sample(adv, mask) == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 0.5], abs=1e-12)


def test_rloo_hand_worked():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 5)
    adv, returns = compute_advantages("rloo", rewards, mask, IDS)
    # a: 1 - mean(0, 0) = 1;  0 - mean(1, 0) = -0.5 (twice);  b: 2 - 4 = -2, 4 - 2 = 2;  c: alone keeps 0.5
    assert per_sample(adv, mask) == pytest.approx([1.0, -0.5, -0.5, -2.0, 2.0, 0.5], abs=1e-12)
    assert torch.equal(returns, adv)


def test_opo_hand_worked():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 5)
    adv, _ = compute_advantages("opo", rewards, mask, IDS)
    # a: baseline = (1*1 + 2*0 + 3*0) / (1+2+3) = 1/6 -> 5/6, -1/6, -1/6
    # b: baseline = (4*2 + 2*4) / (4+2) = 8/3 -> 2 - 8/3 = -2/3, 4 - 8/3 = 4/3;  c: alone -> 0.5
    assert per_sample(adv, mask) == pytest.approx([5 / 6, -1 / 6, -1 / 6, -2 / 3, 4 / 3, 0.5], abs=1e-12)


def test_reinforce_plus_plus_hand_worked():
    # gamma 0.5. Sample 0: rewards [0, 0, 1], full -> returns [0.25, 0.5, 1].
    # Sample 1: rewards [0, 2, 5] but the 5 sits on padding (mask [1, 1, 0]): it must not flow
    # back into the response -> returns [1, 2] on the response.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, returns = compute_advantages("reinforce_plus_plus", rewards, mask, [0, 1], gamma=0.5)
    assert returns[mask.bool()].tolist() == pytest.approx([0.25, 0.5, 1.0, 1.0, 2.0])
    # Whitening over the 5 response tokens [0.25, 0.5, 1, 1, 2]: mean 0.95, deviations
    # [-0.7, -0.45, 0.05, 0.05, 1.05], sum of squares 1.8, unbiased var 1.8/4 = 0.45,
    # std sqrt(0.45) = 0.6708204 -> [-1.0434984, -0.6708204, 0.0745356, 0.0745356, 1.5652476]
    expected = [-1.0434984, -0.6708204, 0.0745356, 0.0745356, 1.5652476]
    assert adv[mask.bool()].tolist() == pytest.approx(expected, abs=1e-6)
    assert adv[1, 2] == 0


def test_reinforce_plus_plus_baseline_hand_worked():
    # Groups {1, 0} and {3, 1}, every response 2 tokens. Minus group means (0.5, 2): 0.5, -0.5, 1, -1.
    # Tokens [.5,.5,-.5,-.5,1,1,-1,-1]: mean 0, sum of squares 5, unbiased var 5/7, std 0.8451543
    # -> 0.5/0.8451543 = 0.5916080, 1/0.8451543 = 1.1832160
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0, 1.0], [2, 2, 2, 2], 3)
    adv, returns = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, ["p", "p", "q", "q"])
    assert per_sample(adv, mask) == pytest.approx([0.5916080, -0.5916080, 1.1832160, -1.1832160], abs=1e-6)
    assert torch.equal(returns, adv)


# ---------------------------------------------------------------- float64 naive references


def _random_batch(seed: int, sizes=(4, 3, 1, 5, 2), width=7):
    gen = torch.Generator().manual_seed(seed)
    ids = [f"uid-{g}" for g, n in enumerate(sizes) for _ in range(n)]
    order = torch.randperm(len(ids), generator=gen).tolist()  # groups interleaved, as after shuffling
    ids = [ids[i] for i in order]
    lengths = torch.randint(1, width + 1, (len(ids),), generator=gen).tolist()
    mask = torch.zeros(len(ids), width, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rewards = torch.randn(len(ids), width, generator=gen, dtype=F64) * mask
    return rewards, mask, ids


def _by_group(ids, values):
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return groups


def _whiten_reference(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def _reference_scalars(estimator, rewards, mask, ids, *, norm_adv_by_std=True, eps=1e-6):
    scores = [float(r.sum()) for r in rewards]
    lengths = [float(m.sum()) for m in mask]
    out = [0.0] * len(scores)
    for members in _by_group(ids, scores).values():
        s = [scores[i] for i in members]
        n = len(s)
        for i in members:
            if estimator == "grpo":
                mean, std = (statistics.mean(s), statistics.stdev(s)) if n > 1 else (0.0, 1.0)
                out[i] = (scores[i] - mean) / (std + eps) if norm_adv_by_std else scores[i] - mean
            elif estimator == "rloo":
                out[i] = scores[i] - (sum(s) - scores[i]) / (n - 1) if n > 1 else scores[i]
            elif estimator == "opo":
                ls = [lengths[j] for j in members]
                out[i] = scores[i] - (sum(a * b for a, b in zip(ls, s)) / sum(ls) if n > 1 else 0.0)
            elif estimator == "reinforce_plus_plus_baseline":
                out[i] = scores[i] - (statistics.mean(s) if n > 1 else 0.0)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "estimator,norm", [("grpo", True), ("grpo", False), ("rloo", True), ("opo", True)]
)
def test_group_estimators_match_naive_float64_reference(estimator, norm, seed):
    rewards, mask, ids = _random_batch(seed)
    adv, _ = compute_advantages(estimator, rewards, mask, ids, norm_adv_by_std=norm)
    expected = _reference_scalars(estimator, rewards, mask, ids, norm_adv_by_std=norm)
    assert adv.dtype == F64
    assert per_sample(adv, mask) == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_plus_plus_baseline_matches_naive_reference(seed):
    rewards, mask, ids = _random_batch(seed)
    adv, _ = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, ids)
    centered = _reference_scalars("reinforce_plus_plus_baseline", rewards, mask, ids)
    tokens = [centered[i] for i in range(len(ids)) for _ in range(int(mask[i].sum()))]
    assert adv[mask.bool()].tolist() == pytest.approx(_whiten_reference(tokens), rel=1e-7, abs=1e-9)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_naive_reference(gamma):
    rewards, mask, ids = _random_batch(3)
    adv, returns = compute_advantages("reinforce_plus_plus", rewards, mask, ids, gamma=gamma)
    ref_returns = []
    for r, m in zip(rewards.tolist(), mask.tolist()):
        n = int(sum(m))
        ref_returns += [sum(gamma ** (k - t) * r[k] for k in range(t, n)) for t in range(n)]
    assert returns[mask.bool()].tolist() == pytest.approx(ref_returns, rel=1e-10, abs=1e-12)
    assert adv[mask.bool()].tolist() == pytest.approx(_whiten_reference(ref_returns), rel=1e-7, abs=1e-9)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("seed", range(3))
def test_grpo_advantages_have_zero_mean_and_unit_std_per_group(seed):
    rewards, mask, ids = _random_batch(seed, sizes=(4, 3, 5, 2))
    adv, _ = compute_advantages("grpo", rewards, mask, ids)
    scalars = per_sample(adv, mask)
    for members in _by_group(ids, scalars).values():
        values = [scalars[i] for i in members]
        assert statistics.mean(values) == pytest.approx(0.0, abs=1e-12)
        assert statistics.stdev(values) == pytest.approx(1.0, rel=1e-5)


def test_drgrpo_advantages_are_not_rescaled():
    # A group with a large spread keeps its scale under Dr.GRPO, while GRPO normalises it away.
    rewards, mask = outcome_rewards([10.0, -10.0, 0.1, -0.1], [3, 3, 3, 3], 3)
    dr, _ = compute_advantages("grpo", rewards, mask, [0, 0, 1, 1], norm_adv_by_std=False)
    grpo, _ = compute_advantages("grpo", rewards, mask, [0, 0, 1, 1])
    assert per_sample(dr, mask) == pytest.approx([10.0, -10.0, 0.1, -0.1])
    assert per_sample(grpo, mask) == pytest.approx([0.7071068, -0.7071068, 0.7071068, -0.7071068], abs=1e-4)


def test_group_id_forms_agree_and_bad_lengths_are_refused():
    rewards, mask, ids = _random_batch(5)
    dense = {g: i for i, g in enumerate(dict.fromkeys(ids))}
    as_list, _ = compute_advantages("grpo", rewards, mask, ids)
    as_numpy, _ = compute_advantages("grpo", rewards, mask, np.array(ids, dtype=object))
    as_tensor, _ = compute_advantages("grpo", rewards, mask, torch.tensor([dense[g] * 10 for g in ids]))
    assert torch.equal(as_list, as_numpy) and torch.equal(as_list, as_tensor)
    with pytest.raises(ValueError, match="group_ids has 3 entries but the batch has"):
        compute_advantages("grpo", rewards, mask, ids[:3])


def test_advantages_carry_no_autograd_graph_and_keep_float32():
    rewards, mask = outcome_rewards([1.0, 0.0], [2, 2], 2)
    rewards = rewards.float().requires_grad_()
    adv, _ = compute_advantages("grpo", rewards, mask.float(), [0, 0])
    assert adv.dtype == torch.float32 and not adv.requires_grad


# ---------------------------------------------------------------- KL estimators

LOGP = torch.tensor([math.log(0.5), math.log(0.25)], dtype=F64)
REF = torch.tensor([math.log(0.25), math.log(0.5)], dtype=F64)
LN2 = math.log(2)
# Token 0: logp - ref = ln 2; token 1: logp - ref = -ln 2.
HAND_KL = {
    "k1": [LN2, -LN2],
    "abs": [LN2, LN2],
    "k2": [0.5 * LN2**2, 0.5 * LN2**2],  # 0.2402265
    # log r = ref - logp: token 0: r = 1/2 -> 0.5 + ln2 - 1 = 0.1931472; token 1: r = 2 -> 2 - ln2 - 1 = 0.3068528
    "k3": [0.5 + LN2 - 1, 2 - LN2 - 1],
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_estimators_hand_worked(kind):
    assert kl_penalty(LOGP, REF, kind).tolist() == pytest.approx(HAND_KL[ALIASES.get(kind, kind)], abs=1e-12)


def test_low_var_kl_is_clamped_for_stability():
    # ref - logp = 30 -> clamped to 20 -> exp(20) - 21 ~ 4.85e8 -> clamped to 10
    value = kl_penalty(torch.tensor([-31.0]), torch.tensor([-1.0]), "low_var_kl")
    assert value.item() == 10.0


@pytest.mark.parametrize("kind", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_plus_suffix_keeps_the_value_and_takes_k2s_gradient(kind):
    gen = torch.Generator().manual_seed(0)
    logp = (torch.randn(6, generator=gen, dtype=F64) - 2).requires_grad_()
    ref = torch.randn(6, generator=gen, dtype=F64) - 2
    value = kl_penalty(logp, ref, kind)
    assert torch.allclose(value, kl_penalty(logp, ref, kind[:-1]), atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    assert torch.allclose(grad, (logp - ref).detach(), atol=1e-12, rtol=0)  # d/dlogp 0.5 (logp - ref)^2
    if kind in ("k1+", "kl+"):  # and it really differs from the plain estimator's gradient (1)
        (plain,) = torch.autograd.grad(kl_penalty(logp, ref, kind[:-1]).sum(), logp)
        assert not torch.allclose(grad, plain)


def test_unknown_kl_type_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown KL type 'k4'") as err:
        kl_penalty(LOGP, REF, "k4")
    assert "low_var_kl+" in str(err.value)
    assert set(KL_TYPES) >= {"k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl", "k3+", "low_var_kl+"}


# ---------------------------------------------------------------- the spec's names


def test_the_spec_offers_exactly_the_registered_algorithms():
    """grpo_api can't import torch, so the spec restates the registries' names; a name added on
    one side only would pass `grpo validate` and then fail in the trainer, or never be offered."""
    spec = AlgorithmSpec.model_fields
    # gae is PPO's: it needs the critic's values, so it is not a registered outcome estimator
    assert {e.value for e in AdvEstimator} - {"gae"} == set(ADV_ESTIMATORS.names())
    assert set(typing.get_args(spec["policy_loss"].annotation)) == set(POLICY_LOSSES.names())
    assert typing.get_args(spec["loss_agg_mode"].annotation) == LOSS_AGG_MODES
    assert set(typing.get_args(spec["kl_loss_type"].annotation)) == set(KL_TYPES)
