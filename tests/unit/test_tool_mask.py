"""Tool tokens are in a multi-turn trajectory but not in its losses: the response mask from the
rollout record reaches the micro-batches, the token rewards, the policy loss, the KL and the
entropy, checked against a hand computation in float64; old shards without the mask still read."""

import pyarrow as pa
import torch

from grpo_api.records import ROLLOUT_SCHEMA
from grpo_trainer import batch as batching
from grpo_trainer.algorithms import LossNormalizer, kl_penalty, policy_loss

MASK = [1, 1, 0, 0, 0, 1, 1]     # model call, 3 tool tokens, model answer


def samples():
    return [batching.Sample("u", 0, 0, [5, 6], [1, 2, 3, 4, 5, 6, 7], [-1.0] * 7, 1.0, "stop", 0, MASK),
            batching.Sample("u", 0, 1, [5, 6], [8, 9, 10], [-1.0] * 3, 0.0, "stop", 0, None)]


def test_micro_batch_and_token_rewards_mask_tool_tokens():
    s = samples()
    mb = batching.collate([0, 1], s, None, pad_id=0, device=torch.device("cpu"))
    assert mb.response_mask[0].tolist() == [0, *[float(m) for m in MASK]]   # position t predicts token t+1
    assert mb.response_mask[1].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    rewards, mask = batching.token_rewards(s)
    assert mask[0].tolist() == MASK and mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 0, 1.0]       # on the last model token


def test_losses_over_model_tokens_only_match_a_hand_computation():
    s = samples()
    mb = batching.collate([0, 1], s, None, pad_id=0, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    shape = mb.response_mask.shape
    logp, old, ref = (-torch.rand(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    m = mb.response_mask.double()
    for mode in ("token-mean", "seq-mean-token-mean"):
        norm = LossNormalizer.from_masks(mode, [mb.response_mask], scale_factor=8, dp_size=1)
        loss, _ = policy_loss("vanilla", old, logp, adv, m, clip_ratio_low=10.0, clip_ratio_high=10.0,
                              clip_ratio_c=100.0, loss_agg_mode=mode, normalizer=norm)
        per_token = -adv * torch.exp(logp - old)      # no clipping at these ratios
        if mode == "token-mean":
            expected = (per_token * m).sum() / m.sum()
        else:
            expected = ((per_token * m).sum(-1) / m.sum(-1)).mean()
        assert torch.allclose(loss, expected, rtol=1e-10), mode
        # the tool tokens' values don't matter at all
        noisy = logp + (1 - m) * 5.0
        loss2, _ = policy_loss("vanilla", old, noisy, adv, m, clip_ratio_low=10.0, clip_ratio_high=10.0,
                               clip_ratio_c=100.0, loss_agg_mode=mode, normalizer=norm)
        assert torch.allclose(loss, loss2, rtol=1e-12)
    norm = LossNormalizer.from_masks("token-mean", [mb.response_mask], scale_factor=8, dp_size=1)
    kl = norm(kl_penalty(logp, ref, "low_var_kl"), m)
    r = ref - logp
    expected_kl = (((torch.exp(r) - r - 1).clamp(-10, 10)) * m).sum() / m.sum()   # k3, verl's low_var_kl
    assert torch.allclose(kl, expected_kl, rtol=1e-10)
    entropy = torch.rand(shape, generator=gen, dtype=torch.float64)
    assert torch.allclose(norm(entropy, m), (entropy * m).sum() / m.sum())


def test_old_shards_without_the_mask_still_read():
    old_schema = pa.schema([f for f in ROLLOUT_SCHEMA if f.name not in ("response_mask", "num_turns", "agent")])
    row = {"uid": "u", "prompt_index": 0, "sample_index": 0, "prompt_ids": [1], "response_ids": [2, 3],
           "response_logprobs": [-0.5, -0.5], "reward": 1.0, "reward_extra": "{}", "finish_reason": "stop",
           "policy_version": 0, "data_source": "d", "ground_truth": "g", "worker": "w"}
    [old] = batching.samples_from_table(pa.Table.from_pylist([row], schema=old_schema))
    assert old.loss_mask is None and old.mask().tolist() == [1, 1]
    new = pa.Table.from_pylist([{**row, "response_mask": [1, 0], "num_turns": 2, "agent": "{}"}], schema=ROLLOUT_SCHEMA)
    [s] = batching.samples_from_table(new)
    assert s.loss_mask == [1, 0] and s.last_model_token == 0


def test_multi_turn_metrics_count_turns_calls_and_errors():
    from grpo_trainer.metrics import multi_turn_metrics
    ok = {"name": "lookup", "error": ""}
    rows = [{"num_turns": 3, "tool_calls": [ok]}, {"num_turns": 5, "tool_calls": [ok, {"name": "x", "error": "timeout"}]},
            {"num_turns": 1, "tool_calls": []}]
    samples = [batching.Sample("u", 0, i, [1], [2], [-0.1], 0.0, "stop", 0, [1], a) for i, a in enumerate(rows)]
    none = {"tool_calls/errors/parse": 0, "tool_calls/errors/unknown_tool": 0, "tool_calls/errors/tool_error": 0,
            "tool_calls/errors/unavailable": 0, "tool_calls/errors/crash": 0}
    assert multi_turn_metrics(samples) == {"num_turns/mean": 3.0, "num_turns/min": 1, "num_turns/max": 5,
                                           "tool_calls/mean": 1.0, "tool_calls/errors": 1,
                                           "tool_calls/error_fraction": 1 / 3,      # 1 failed of 3 calls
                                           **none, "tool_calls/errors/timeout": 1}
    assert multi_turn_metrics([batching.Sample("u", 0, 0, [1], [2], [-0.1], 0.0, "stop", 0)]) == {}
