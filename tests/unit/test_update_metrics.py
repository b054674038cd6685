"""What the console and the dashboards show of an update (actor/pg_loss, actor/entropy,
actor/kl_loss, actor/grad_norm) is the mini-batch's own value, however the trainer splits it into
micro-batches (padded rows, packed rows) and although it sums them on the device and reads them
once (`grpo_trainer.actor.update_policy`). Checked against the published formulas, computed here in
float64 sample by sample: on-policy (ratio 1) GRPO's token-mean loss is -sum(A_t)/N over the
response tokens, the entropy the token mean of softmax(logits / T)'s, the KL loss the token mean of
k3 (verl's low_var_kl) between the policy and a reference."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_api.spec import GRPOJobSpec
from grpo_trainer import batch as batching
from grpo_trainer.actor import compute_logprobs, update_policy
from grpo_trainer.batch import Sample

TEMPERATURE = 0.7


def tiny_qwen3(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=64, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).float()


def samples() -> list[Sample]:
    """Two prompts, three responses each, of different lengths and rewards."""
    out = []
    for p, prompt in enumerate([[3, 4, 5], [6, 7]]):
        for i, (response, reward) in enumerate([([9, 10, 11, 12], 1.0), ([13], 0.0), ([14, 15], 0.5 * p)]):
            out.append(Sample(f"u{p}", p, i, prompt, [t + p for t in response], None, reward, "stop"))
    return out


def spec() -> GRPOJobSpec:
    return GRPOJobSpec.model_validate({
        "model": {"path": "/m"}, "data": {"trainFiles": ["/d.parquet"], "trainBatchSize": 2},
        "algorithm": {"useKLLoss": True, "klLossType": "low_var_kl", "lossAggMode": "token-mean"},
        "rollout": {"n": 3, "temperature": TEMPERATURE},
        "trainer": {"miniBatchSize": 2, "microBatchSizePerGPU": 6, "lr": 1e-3}, "storage": {"uri": "file:///unused"}})


def reference_metrics(policy, ref, rows: list[Sample], advantages: list[torch.Tensor]) -> dict[str, float]:
    """float64, one sample at a time, no padding: the formulas as published."""
    policy, ref = copy.deepcopy(policy).double(), copy.deepcopy(ref).double()
    pg, entropy, kl, n = 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for s, adv in zip(rows, advantages):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            span = slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.response_ids))
            targets = torch.tensor(s.response_ids)
            logp_all = torch.log_softmax(policy(input_ids=ids).logits[0, span] / TEMPERATURE, dim=-1)
            ref_all = torch.log_softmax(ref(input_ids=ids).logits[0, span] / TEMPERATURE, dim=-1)
            logp = logp_all.gather(-1, targets[:, None])[:, 0]
            ref_logp = ref_all.gather(-1, targets[:, None])[:, 0]
            pg += float(-adv.double().sum())                       # ratio 1: -A per token
            entropy += float(-(logp_all.exp() * logp_all).sum())
            log_ratio = ref_logp - logp
            kl += float((log_ratio.exp() - log_ratio - 1).clamp(-10, 10).sum())   # k3
            n += len(s.response_ids)
    return {"actor/pg_loss": pg / n, "actor/entropy": entropy / n, "actor/kl_loss": kl / n}


@pytest.mark.parametrize(("layout", "rows_per_micro_batch"), [("padded", 6), ("padded", 2), ("packed", 4),
                                                               ("packed", 1)])
def test_the_logged_update_metrics_are_the_mini_batchs_however_it_is_split(layout, rows_per_micro_batch):
    rows, job = samples(), spec()
    advantages = batching.advantages_per_sample(rows, "grpo", norm_adv_by_std=True, gamma=1.0)
    policy, ref = tiny_qwen3(0), tiny_qwen3(1)
    want = reference_metrics(policy, ref, rows, advantages)
    assert want["actor/pg_loss"] != 0 and want["actor/kl_loss"] > 0     # the check can fail

    groups = [list(range(i, min(i + rows_per_micro_batch, len(rows)))) for i in range(0, len(rows), rows_per_micro_batch)]
    mbs = [batching.collate(g, rows, advantages, 0, torch.device("cpu"), pack=layout == "packed") for g in groups]
    ref_logp = {id(mb): lp for mb, lp in zip(mbs, compute_logprobs(ref, mbs, TEMPERATURE))}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    result = update_policy(policy, optimizer, scheduler, job, [mbs], {}, ref_logp, 1, torch.device("cpu"))

    for key, value in want.items():
        assert result.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert result.metrics["actor/pg_clipfrac"] == 0 and result.metrics["actor/ppo_kl"] == 0   # on-policy
    assert result.metrics["actor/grad_norm"] == pytest.approx(_grad_norm_of_the_whole_batch(job, rows, advantages),
                                                              rel=1e-4)
    assert result.tokens == sum(s.length for s in rows)


def _grad_norm_of_the_whole_batch(job, rows, advantages) -> float:
    """The gradient's norm with the whole mini-batch as one padded micro-batch (the split's reference)."""
    policy, ref = tiny_qwen3(0), tiny_qwen3(1)
    mb = batching.collate(list(range(len(rows))), rows, advantages, 0, torch.device("cpu"))
    ref_logp = {id(mb): compute_logprobs(ref, [mb], TEMPERATURE)[0]}
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return update_policy(policy, optimizer, scheduler, job, [[mb]], {}, ref_logp, 1,
                         torch.device("cpu")).metrics["actor/grad_norm"]
