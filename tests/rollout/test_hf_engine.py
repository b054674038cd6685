"""The transformers engine: samples, behaviour logprobs, finish reasons, seeding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_rollout.engine import SamplingParams
from grpo_rollout.hf_engine import HFEngine

from .conftest import chat_prompt


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A random init wide enough that greedy decoding is not one repeated token."""
    from grpo_rollout.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("sharp"), seed=3, initializer_range=0.5)


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    """Sliding-window attention on every layer: the engine keeps a DynamicCache for it."""
    from grpo_rollout.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("sliding"), seed=3, initializer_range=0.5,
                            use_sliding_window=True, sliding_window=64, max_window_layers=0)


@pytest.fixture(scope="module", params=["static-cache", "sliding-window"])
def model_dir(request, sharp_model, sliding_model):
    return sharp_model if request.param == "static-cache" else sliding_model


@pytest.fixture(scope="module")
def engine(sharp_model):
    return HFEngine(sharp_model, seed=0)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    # Different lengths: the batch is left-padded.
    return [chat_prompt(tokenizer, "copy the digit 3"),
            chat_prompt(tokenizer, "the answer is 4 then 5 and 6 with the digit 7"),
            chat_prompt(tokenizer, "answer")]


def recompute_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """What the trainer computes: one forward over prompt + response, no padding, logits / T."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logits = logits[len(prompt) - 1:-1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_n_samples_per_prompt_with_matching_logprobs(model_dir, prompts):
    params = SamplingParams(n=4, max_tokens=12, temperature=0.7, top_p=0.9, seed=5)
    groups = HFEngine(model_dir, seed=0).generate(prompts, params)
    assert [len(g) for g in groups] == [4, 4, 4]
    fresh = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for prompt, group in zip(prompts, groups):
        for s in group:
            assert 1 <= len(s.token_ids) <= 12 and len(s.logprobs) == len(s.token_ids)
            expected = recompute_logprobs(fresh, prompt, s.token_ids, temperature=0.7)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=1e-4)
    # n samples of a prompt are different draws, not copies.
    assert len({tuple(s.token_ids) for s in groups[1]}) > 1


def test_finish_reasons(tiny_model, prompts, tokenizer):
    engine = HFEngine(tiny_model)  # near-uniform: EOS comes up now and then
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    samples = [s for g in engine.generate(prompts, SamplingParams(n=8, max_tokens=16, seed=1)) for s in g]
    stopped = [s for s in samples if s.finish_reason == "stop"]
    capped = [s for s in samples if s.finish_reason == "length"]
    assert stopped and capped
    assert all(s.token_ids[-1] == eos and eos not in s.token_ids[:-1] for s in stopped)
    assert all(len(s.token_ids) == 16 and eos not in s.token_ids for s in capped)


def test_seeded_sampling_is_reproducible(engine, prompts):
    params = SamplingParams(n=3, max_tokens=10, seed=42)
    first = [[s.token_ids for s in g] for g in engine.generate(prompts, params)]
    again = [[s.token_ids for s in g] for g in engine.generate(prompts, params)]
    other = [[s.token_ids for s in g] for g in engine.generate(prompts, SamplingParams(n=3, max_tokens=10, seed=43))]
    assert first == again and first != other


def test_a_request_without_logprobs_samples_the_same_tokens_and_reports_none(engine, prompts):
    # An on-policy step asks for no behaviour logprobs (issue 47): the samples are those the same
    # seed draws with them, sampled and greedy, and carry None.
    for params in (SamplingParams(n=3, max_tokens=10, temperature=0.7, top_p=0.9, seed=42),
                   SamplingParams(n=1, max_tokens=10, temperature=0.0, seed=0)):
        with_lp = engine.generate(prompts, params)
        without = engine.generate(prompts, replace(params, logprobs=False))
        assert [[(s.token_ids, s.finish_reason) for s in g] for g in without] == \
            [[(s.token_ids, s.finish_reason) for s in g] for g in with_lp]
        assert all(s.logprobs is None for g in without for s in g)
        assert all(len(s.logprobs) == len(s.token_ids) for g in with_lp for s in g)


def test_greedy_follows_the_argmax(model_dir, prompts):
    engine = HFEngine(model_dir, seed=0)
    groups = engine.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=0.0))
    fresh = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for prompt, (a, b) in zip(prompts, groups):
        assert a.token_ids == b.token_ids
        ids = list(prompt)
        for tok in a.token_ids:
            with torch.no_grad():
                assert int(fresh(torch.tensor([ids])).logits[0, -1].argmax()) == tok
            ids.append(tok)
        # Greedy reports logprobs of the untempered distribution.
        torch.testing.assert_close(torch.tensor(a.logprobs), recompute_logprobs(fresh, prompt, a.token_ids, 1.0),
                                   atol=1e-4, rtol=1e-4)
    # top_k=1 sampling is greedy too.
    top1 = engine.generate(prompts, SamplingParams(n=1, max_tokens=8, top_k=1, seed=9))
    assert [g[0].token_ids for g in top1] == [g[0].token_ids for g in groups]


def test_stop_strings_end_generation(engine, prompts, tokenizer):
    greedy = engine.generate(prompts[:1], SamplingParams(n=1, max_tokens=8, temperature=0.0))[0][0]
    third_word = tokenizer.decode(greedy.token_ids[2:3], skip_special_tokens=True)
    assert third_word
    stopped = engine.generate(prompts[:1], SamplingParams(n=1, max_tokens=8, temperature=0.0, stop=(third_word,)))[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[:len(stopped.token_ids)]
    assert third_word in tokenizer.decode(stopped.token_ids, skip_special_tokens=True)
    assert len(stopped.token_ids) <= 3


def test_load_weights_checks_names_and_shapes_before_copying(sharp_model, prompts):
    engine = HFEngine(sharp_model)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    norm = "model.norm.weight"
    with pytest.raises(ValueError, match="unknown parameter 'model.nope'"):
        engine.load_weights([(norm, torch.zeros_like(before[norm])), ("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="does not match"):
        engine.load_weights([(norm, torch.zeros(3))])
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
    engine.load_weights([(norm, torch.full_like(before[norm], 2.0))])
    assert torch.equal(engine.model.state_dict()[norm], torch.full_like(before[norm], 2.0))


def test_invalid_sampling_params_are_value_errors():
    for bad in (dict(n=0), dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(ValueError, match="sampling"):
            SamplingParams(**bad)
