"""Trainer batching: dynamic-sampling selection, token-budget micro-batches, behaviour logprobs
and the staleness bound."""

import pytest
import torch

from grpo_trainer.algorithms import policy_loss
from grpo_trainer.batch import (Sample, check_complete, check_staleness, collate, gather_response_values, keep_prompts,
                                micro_batches, scatter_response_values, split_to)


def sample(prompt: int, i: int, length: int = 3) -> Sample:
    return Sample(f"0-{prompt}", prompt, i, [1] * length, [2] * length, [0.0] * length, float(i), "stop")


def test_keep_prompts_renumbers_the_kept_groups():
    samples = [sample(p, i) for p in range(5) for i in range(2)]
    kept = keep_prompts(samples, [4, 1])
    assert [(s.uid, s.prompt_index, s.sample_index) for s in kept] == [
        ("0-1", 0, 0), ("0-1", 0, 1), ("0-4", 1, 0), ("0-4", 1, 1)]
    check_complete(kept, 2, 2)


def test_micro_batches_stay_within_the_token_budget():
    samples = [sample(0, i, length=n) for i, n in enumerate([10, 3, 7, 2, 9, 4])]
    groups = micro_batches(list(range(6)), samples, max_count=100, max_tokens=40)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:   # padded size: count x longest sequence (prompt + response)
        assert len(g) * max(samples[i].length for i in g) <= 40
    assert len(groups) == 3   # 20,18 | 14,8 | 6,4: longest first, greedily filled


def test_packed_micro_batches_count_tokens_not_count_times_longest():
    samples = [sample(0, i, length=n) for i, n in enumerate([10, 3, 7, 2, 9, 4])]
    groups = micro_batches(list(range(6)), samples, max_count=100, max_tokens=40, packed=True)
    assert groups == [[0, 4], [2, 5, 1, 3]]     # 20+18 | 14+8+6+4: two where padding needs three
    assert all(sum(samples[i].length for i in g) <= 40 for g in groups)


def test_micro_batches_split_to_as_many_as_another_rank_has_within_the_budget():
    samples = [sample(0, i, length=n) for i, n in enumerate([10, 3, 7, 2, 9, 4])]
    groups = micro_batches(list(range(6)), samples, max_count=100, max_tokens=40)   # 3, as above
    split = split_to(groups, 5)
    assert len(split) == 5 and sorted(i for g in split for i in g) == list(range(6))
    assert all(len(g) * max(samples[i].length for i in g) <= 40 for g in split)
    assert split_to(groups, 3) == groups
    with pytest.raises(ValueError, match="6 samples can't make 7 micro-batches"):
        split_to(groups, 7)


def test_forward_only_log_probs_go_back_into_the_updates_layout():
    """Values computed on one grouping of the samples land at the same responses' positions of
    another (trainer.logProbMaxTokensPerGPU's micro-batches against the update's)."""
    samples = [Sample("0-0", 0, i, [5] * p, [6] * r, [0.0] * r, 0.0, "stop") for i, (p, r) in
               enumerate([(2, 3), (4, 1), (1, 4), (3, 2)])]
    cpu = torch.device("cpu")
    update = [collate(g, samples, None, 0, cpu) for g in ([0, 1], [2, 3])]
    forward = [collate(g, samples, None, 0, cpu, pack=True) for g in ([3, 1, 2], [0])]
    # each response position's value names its sample and token: 10 x sample + token
    per_mb = [scatter_response_values(mb, torch.tensor([[10. * i + t for t in range(4)] for i in range(4)]),
                                      samples, like=mb.response_mask.float()) for mb in forward]
    per_sample = gather_response_values(forward, per_mb, samples, width=4)
    for mb in update:
        got = scatter_response_values(mb, per_sample, samples, like=mb.response_mask.float())
        for row, i in enumerate(mb.indices):
            want = [10. * i + t for t in range(len(samples[i].response_ids))]
            assert got[row][mb.response_mask[row].bool()].tolist() == want


def test_packed_collate_is_one_row_with_positions_from_0_and_a_map_back():
    """Hand-worked on the two samples below: a's 5 tokens then b's 4, positions restarting at 0;
    packed position j's prediction lands at row x 4 + t of the padded [2, 4] tensors (-1: a
    sample's last token, which predicts nothing of its own)."""
    a = Sample("0-0", 0, 0, [11, 12], [21, 22, 23], [-0.5, -1.0, -2.0], 1.0, "stop")
    b = Sample("0-0", 0, 1, [11, 12, 13], [24], [-0.25], 0.0, "length")
    mb = collate([0, 1], [a, b], None, pad_id=0, device=torch.device("cpu"), pack=True)
    assert mb.packed.input_ids.tolist() == [[11, 12, 21, 22, 23, 11, 12, 13, 24]]
    assert mb.packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert mb.packed.source.tolist() == [0, 1, 2, 3, -1, 4, 5, 6, -1]
    # the padded tensors the losses read are the unpacked micro-batch's
    plain = collate([0, 1], [a, b], None, pad_id=0, device=torch.device("cpu"))
    assert plain.packed is None and torch.equal(mb.response_mask, plain.response_mask)
    assert torch.equal(mb.targets.flatten()[mb.packed.source[mb.packed.source >= 0]],
                       mb.packed.input_ids[0, 1:][mb.packed.source[:-1] >= 0])
    # the positions that predict a response token (12, 21, 22 of a; 13 of b) and where each lands
    assert mb.packed.scored.tolist() == [1, 2, 3, 7] and mb.packed.scored_dest.tolist() == [1, 2, 3, 6]
    assert mb.targets.flatten()[mb.packed.scored_dest].tolist() == [21, 22, 23, 24]
    assert mb.num_tokens == 9


def test_shared_prompt_micro_batches_keep_a_prompts_responses_together_and_count_it_once():
    """model.sharePrompts: prompt 0's three samples (4 + 6 tokens each) cost 4 + 3 x 6 = 22 tokens
    of the budget, not 30; prompt 1's two (2 + 5 each) 12, after the larger group. Hand-worked."""
    samples = [Sample(f"0-{p}", p, i, [p + 1] * n, [9] * r, [0.0] * r, 0.0, "stop") for i, (p, n, r) in
               enumerate([(1, 2, 5), (0, 4, 6), (0, 4, 6), (1, 2, 5), (0, 4, 6)])]

    def shared(budget):
        return micro_batches(list(range(5)), samples, max_count=100, max_tokens=budget, packed=True,
                             share_prompts=True)
    assert shared(40) == [[1, 2, 4, 0, 3]]                 # 22 + 12
    assert shared(22) == [[1, 2, 4], [0, 3]]               # two, where unshared rows need three:
    assert micro_batches(list(range(5)), samples, max_count=100, max_tokens=22, packed=True) == [[1, 2], [4, 0], [3]]
    assert shared(16) == [[1, 2], [4], [0, 3]]             # a group over the budget is split: 4 + 6 + 6 | 10


def test_shared_prompt_collate_is_each_prompt_once_with_maps_to_the_full_row():
    """Hand-worked: a and c share prompt [11, 12], b has its own. The full row is a, b, c packed
    as with useRemovePadding; the model's row is [11, 12] a's response, c's response, then b.
    `expand` takes each full position to its token's one copy (c's prompt to a's); a response's
    positions continue its prompt's. Attention's queries are the model's row as it is, a's prompt
    and response, c's response, b's prompt and response; each sample's keys are its prompt's and
    its own, gathered by `key_index` in the same order."""
    a = Sample("0-0", 0, 0, [11, 12], [21, 22, 23], None, 1.0, "stop")
    b = Sample("0-1", 1, 0, [13], [24, 25], None, 0.0, "stop")
    c = Sample("0-0", 0, 1, [11, 12], [26], None, 0.0, "length")
    mb = collate([0, 1, 2], [a, b, c], None, pad_id=0, device=torch.device("cpu"), share_prompts=True)
    packed = mb.packed
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 23, 26, 13, 24, 25]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 0, 1, 2]]
    full = [11, 12, 21, 22, 23, 13, 24, 25, 11, 12, 26]
    assert packed.expand.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 0, 1, 5]
    assert packed.input_ids[0, packed.expand].tolist() == full
    assert packed.cu_seqlens.tolist() == [0, 5, 8, 11]
    assert packed.cu_seqlens_q.tolist() == [0, 5, 6, 9] and packed.max_length_q == 5
    assert packed.key_index.tolist() == [0, 1, 2, 3, 4, 0, 1, 5, 6, 7, 8]
    assert packed.cu_seqlens_k.tolist() == [0, 5, 8, 11]
    assert packed.input_ids[0, packed.key_index].tolist() == [11, 12, 21, 22, 23, 11, 12, 26, 13, 24, 25]
    assert packed.source.tolist() == collate([0, 1, 2], [a, b, c], None, 0, torch.device("cpu"), pack=True).packed.source.tolist()
    # the positions of the model's row that predict a response token: a's 12 21 22, b's 13 24,
    # and c's first token from the shared prompt's last position (the same 12 as a's)
    assert packed.scored.tolist() == [1, 2, 3, 6, 7, 1]
    assert packed.input_ids[0, packed.scored].tolist() == [12, 21, 22, 13, 24, 12]
    assert mb.targets.flatten()[packed.scored_dest].tolist() == [21, 22, 23, 24, 25, 26]
    assert mb.num_tokens == 11


def test_collate_aligns_behaviour_logprobs_with_the_response_positions():
    """Hand-worked: position t predicts token t+1, so response token j of a sample whose prompt
    has p tokens sits at column p-1+j of the [b, L-1] tensors, in both rows of the batch."""
    a = Sample("0-0", 0, 0, [11, 12], [21, 22, 23], [-0.5, -1.0, -2.0], 1.0, "stop", 3)
    b = Sample("0-0", 0, 1, [11, 12, 13], [24], [-0.25], 0.0, "length", 3)
    advantages = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([-1.0])]
    mb = collate([0, 1], [a, b], advantages, pad_id=0, device=torch.device("cpu"))
    # input_ids  a: 11 12 21 22 23 | b: 11 12 13 24 0  -> 4 predicting positions per row
    assert mb.input_ids.tolist() == [[11, 12, 21, 22, 23], [11, 12, 13, 24, 0]]
    assert mb.response_mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert mb.behaviour_logprobs.tolist() == [[0.0, -0.5, -1.0, -2.0], [0.0, 0.0, -0.25, 0.0]]
    assert mb.targets[mb.response_mask.bool()].tolist() == [21, 22, 23, 24]
    # As old logprobs, the ratio of each response token is against its behaviour logprob: with
    # the current policy's logprobs one nat above them on row a's tokens and equal on b's,
    # ppo_kl (mean of old - new over response tokens) is -3/4; the prompt and padding columns,
    # whatever they hold, take no part.
    logp = mb.behaviour_logprobs + torch.tensor([[-9.0, 1.0, 1.0, 1.0], [-9.0, -9.0, 0.0, -9.0]])
    _, metrics = policy_loss("vanilla", mb.behaviour_logprobs, logp, mb.advantages, mb.response_mask)
    assert float(metrics["ppo_kl"]) == -0.75


def test_collate_refuses_logprobs_that_do_not_match_the_response():
    bad = Sample("0-0", 0, 0, [1, 2], [3, 4], [-1.0], 1.0, "stop")
    with pytest.raises(ValueError, match="1 behaviour logprobs for 2 response tokens"):
        collate([0], [bad], [torch.zeros(2)], pad_id=0, device=torch.device("cpu"))


def test_staleness_beyond_the_bound_is_refused():
    samples = [Sample("0-0", 0, i, [1], [2], [0.0], 0.0, "stop", v) for i, v in enumerate([4, 5, 5])]
    assert check_staleness(samples, 5, max_staleness=1) == 1 / 3
    assert check_staleness(samples[1:], 5, max_staleness=0) == 0.0
    with pytest.raises(RuntimeError, match=r"rollout.maxStaleness=0: training policy version 5, but 1 samples "
                                            r"were generated at versions \[4\]"):
        check_staleness(samples, 5, max_staleness=0)
    with pytest.raises(RuntimeError, match=r"versions \[5\]"):     # from a later policy: impossible too
        check_staleness(samples, 4, max_staleness=1)
