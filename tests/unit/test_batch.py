"""Trainer batching: dynamic-sampling selection and token-budget micro-batches."""

from grpo_trainer.batch import Sample, check_complete, keep_prompts, micro_batches


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
