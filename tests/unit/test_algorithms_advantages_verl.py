"""verl's other outcome estimators (gpg, grpo_passk, grpo_vectorized, rloo_vectorized) against
float64 references written here as per-sample Python loops from the papers' formulas."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from grpo_trainer.algorithms import compute_advantages

F64 = torch.float64


def random_batch(seed: int):
    """Groups of 1..5 samples (a lone one included), scores in {0, 1, random}, an empty response."""
    rng = random.Random(seed)
    sizes = [4, 1, 5, 2, 3]
    ids = [f"p{g}" for g, n in enumerate(sizes) for _ in range(n)]
    rng.shuffle(ids)
    scores = [rng.choice([0.0, 1.0, round(rng.uniform(-1, 2), 3)]) for _ in ids]
    lengths = [rng.randint(1, 6) for _ in ids]
    lengths[3] = 0
    scores[3] = 0.0  # an empty response has no token to carry a reward
    width = 6
    rewards = torch.zeros(len(ids), width, dtype=F64)
    mask = torch.zeros(len(ids), width, dtype=F64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        if n:
            rewards[i, n - 1] = s
    return ids, scores, rewards, mask


def members(ids):
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return groups


def check_broadcast(advantages, mask, expected):
    for i, value in enumerate(expected):
        row = advantages[i]
        assert torch.all(row[~mask[i].bool()] == 0)
        for a in row[mask[i].bool()].tolist():
            assert a == pytest.approx(value, rel=1e-12, abs=1e-12), i


@pytest.mark.parametrize("seed", range(4))
def test_gpg_scales_the_group_centred_score_by_batch_over_nonzero(seed):
    ids, scores, rewards, mask = random_batch(seed)
    alpha = len(scores) / max(sum(s != 0 for s in scores), 1)
    expected = []
    groups = members(ids)
    for i, g in enumerate(ids):
        mates = groups[g]
        mean = statistics.fmean(scores[j] for j in mates) if len(mates) > 1 else 0.0
        expected.append(alpha * (scores[i] - mean))
    advantages, returns = compute_advantages("gpg", rewards, mask, ids)
    check_broadcast(advantages, mask, expected)
    assert torch.equal(advantages, returns)


def test_gpg_with_every_score_zero_gives_zero():
    ids, _, rewards, mask = random_batch(0)
    advantages, _ = compute_advantages("gpg", torch.zeros_like(rewards), mask, ids)
    assert advantages.abs().sum() == 0


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_grpo_passk_gives_only_the_best_the_gap_to_the_second(seed, norm):
    ids, scores, rewards, mask = random_batch(seed)
    ids = [("lone" if g == "p1" else g) for g in ids]
    lone = ids.index("lone")
    ids[lone] = ids[0]  # pass@k needs two samples per group
    expected = [0.0] * len(ids)
    for mates in members(ids).values():
        ranked = sorted(mates, key=lambda j: scores[j], reverse=True)
        gap = scores[ranked[0]] - scores[ranked[1]]
        if norm:
            gap /= statistics.stdev(scores[j] for j in mates) + 1e-6
        expected[ranked[0]] = gap  # on ties the gap is 0, whichever of them gets it
    advantages, _ = compute_advantages("grpo_passk", rewards, mask, ids, norm_adv_by_std=norm)
    check_broadcast(advantages, mask, expected)


def test_grpo_passk_refuses_a_group_of_one():
    ids, _, rewards, mask = random_batch(0)
    with pytest.raises(ValueError, match="grpo_passk needs at least 2 samples per prompt group"):
        compute_advantages("grpo_passk", rewards, mask, ids)


@pytest.mark.parametrize("seed", range(4))
def test_vectorized_spellings(seed):
    ids, scores, rewards, mask = random_batch(seed)
    grpo, _ = compute_advantages("grpo", rewards, mask, ids)
    assert torch.equal(compute_advantages("grpo_vectorized", rewards, mask, ids)[0], grpo)
    # RLOO: score minus the mean of the others; verl's vectorised form gives a lone sample 0
    expected = []
    for i, g in enumerate(ids):
        others = [scores[j] for j in members(ids)[g] if j != i]
        expected.append(scores[i] - statistics.fmean(others) if others else 0.0)
    advantages, _ = compute_advantages("rloo_vectorized", rewards, mask, ids)
    check_broadcast(advantages, mask, expected)
