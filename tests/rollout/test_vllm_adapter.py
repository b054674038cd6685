"""The vLLM adapter's conversions, without vLLM or a GPU (the engine itself needs both). The
objects below have the shape of vLLM 0.26's RequestOutput / CompletionOutput / Logprob (the
engine itself ran on an H200: bench/vllm_check.py, bench/RESULTS.md)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from grpo_rollout import cuda_ipc
from grpo_rollout.engine import SamplingParams
from grpo_rollout.vllm_engine import (EXTENSION, llm_kwargs, lora_base_names, narrow_image_runs, pack_on_device,
                                      pack_tensors, sampling_kwargs, samples_from_output, unpack_tensors)


def completion(index, token_ids, logprobs, finish_reason):
    positions = [{tok: SimpleNamespace(logprob=lp, rank=1, decoded_token="t")} for tok, lp in zip(token_ids, logprobs)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=positions, finish_reason=finish_reason,
                           text="...", stop_reason=None)


def test_engine_arguments_ask_for_tempered_logprobs_and_our_weight_loader():
    kw = llm_kwargs("/models/qwen3", dtype="bfloat16", seed=3, tokenizer_path=None, trust_remote_code=False,
                    tensor_parallel_size=2, gpu_memory_utilization=0.6, max_model_len=1536, enforce_eager=False,
                    max_num_batched_tokens=8192)
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["worker_extension_cls"] == EXTENSION
    assert (kw["tokenizer"], kw["tensor_parallel_size"], kw["max_model_len"]) == ("/models/qwen3", 2, 1536)
    # The extension class must be importable by that name in vLLM's worker processes.
    module, _, name = EXTENSION.rpartition(".")
    assert hasattr(__import__(module, fromlist=[name]), name)
    assert "quantization" not in kw
    # FP8 rollouts: verl's scheme (128x128 weight blocks, dynamic activations, MoE routers in bf16),
    # vLLM's online fp8_per_block.
    fp8 = llm_kwargs("/models/qwen3", dtype="bfloat16", seed=3, tokenizer_path=None, trust_remote_code=False,
                     tensor_parallel_size=1, gpu_memory_utilization=0.6, max_model_len=1536, enforce_eager=False,
                     max_num_batched_tokens=8192, quantization="fp8")
    assert fp8 == {**kw, "tensor_parallel_size": 1, "quantization": "fp8_per_block",
                   "quantization_config": {"ignore": [r"re:.*mlp\.gate$"]}}
    assert re.match(fp8["quantization_config"]["ignore"][0][3:], "model.layers.3.mlp.gate")
    assert not re.match(fp8["quantization_config"]["ignore"][0][3:], "model.layers.3.mlp.gate_proj")
    # The KV cache in the model's dtype unless spec.rollout.kvCacheDtype says fp8 (vLLM's own value).
    assert kw["kv_cache_dtype"] == "auto"
    kv = llm_kwargs("/models/qwen3", dtype="bfloat16", seed=3, tokenizer_path=None, trust_remote_code=False,
                    tensor_parallel_size=2, gpu_memory_utilization=0.6, max_model_len=1536, enforce_eager=False,
                    max_num_batched_tokens=8192, kv_cache_dtype="fp8")
    assert kv == {**kw, "kv_cache_dtype": "fp8"}


def test_sampling_parameters_map_to_vllm():
    params = SamplingParams(n=4, max_tokens=256, temperature=0.8, top_p=0.95, top_k=-1, seed=100, stop=("</answer>",))
    first = sampling_kwargs(params)
    assert first == dict(n=4, max_tokens=256, temperature=0.8, top_p=0.95, top_k=0, stop=["</answer>"],
                         stop_token_ids=None, logprobs=0, skip_special_tokens=True, detokenize=True)
    # No per-request seed: vLLM's per-request generators cost a third of the generation time.
    assert "seed" not in first
    assert sampling_kwargs(SamplingParams(top_k=20))["top_k"] == 20
    unseeded = sampling_kwargs(SamplingParams())
    assert unseeded["stop"] is None
    # Rewards decode the tokens themselves: vLLM detokenizes only for stop strings.
    assert unseeded["detokenize"] is False


def test_single_token_stop_strings_become_stop_token_ids_so_vllm_need_not_detokenize():
    from tokenizers import AddedToken

    from grpo_rollout.tiny import build_tokenizer
    tok = build_tokenizer()
    tok.add_tokens([AddedToken("</tool_call>", special=False, normalized=False)])
    close = tok.convert_tokens_to_ids("</tool_call>")
    # Qwen3's </tool_call> is one token: checked on the sampled id, no detokenizing.
    kw = sampling_kwargs(SamplingParams(stop=("</tool_call>",)), tok)
    assert (kw["stop"], kw["stop_token_ids"], kw["detokenize"]) == (None, [close], False)
    # A stop that takes several tokens ("copy the") stays a string, and vLLM detokenizes for it.
    kw = sampling_kwargs(SamplingParams(stop=("</tool_call>", "copy the")), tok)
    assert (kw["stop"], kw["stop_token_ids"], kw["detokenize"]) == (["copy the"], [close], True)
    # Without a tokenizer every stop is a string.
    assert sampling_kwargs(SamplingParams(stop=("</tool_call>",)))["stop"] == ["</tool_call>"]


def test_outputs_become_samples_in_index_order():
    output = SimpleNamespace(outputs=[completion(1, [7, 8], [-0.1, -0.2], "length"),
                                      completion(0, [5, 2], [-1.0, -0.5], "stop")])
    samples = samples_from_output(output)
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in samples] == [
        ([5, 2], [-1.0, -0.5], "stop"), ([7, 8], [-0.1, -0.2], "length")]


def test_a_request_without_logprobs_asks_vllm_for_none_and_its_samples_carry_none():
    # vLLM's per-token logprobs cost ~0.6 s of a 4.4 s generation (issue 47): an on-policy step skips them.
    assert sampling_kwargs(SamplingParams(logprobs=False))["logprobs"] is None
    output = SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=[5, 2], logprobs=None, finish_reason="stop")])
    assert [(s.token_ids, s.logprobs) for s in samples_from_output(output, logprobs=False)] == [([5, 2], None)]


def test_unexpected_outputs_are_errors():
    with pytest.raises(RuntimeError, match="'abort'"):
        samples_from_output(SimpleNamespace(outputs=[completion(0, [1], [-1.0], "abort")]))
    missing = completion(0, [1, 2], [-1.0], "length")
    with pytest.raises(RuntimeError, match="no logprob"):
        samples_from_output(SimpleNamespace(outputs=[missing]))


def test_weights_survive_packing_for_the_worker_processes():
    weights = [("model.embed_tokens.weight", torch.randn(7, 5, dtype=torch.bfloat16)),
               ("model.norm.weight", torch.randn(5)),
               ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 5, dtype=torch.float16).t()),  # non-contiguous
               ("step", torch.tensor([3], dtype=torch.int64))]
    data, entries = pack_tensors(weights)
    unpacked = unpack_tensors(data, entries, "cpu")
    assert [n for n, _ in unpacked] == [n for n, _ in weights]
    for (_, original), (_, restored) in zip(weights, unpacked):
        assert restored.dtype == original.dtype and torch.equal(restored, original)


def test_weights_survive_the_shared_buffer_layout():
    """What the worker extension reads out of a CUDA IPC buffer: the same tensors, at aligned
    offsets (on CPU here; the mapping itself needs a GPU and ran in bench/vllm_check.py)."""
    weights = [("model.embed_tokens.weight", torch.randn(7, 5, dtype=torch.bfloat16)),
               ("model.norm.weight", torch.randn(5)),
               ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 5, dtype=torch.float16).t()),
               ("step", torch.tensor([3], dtype=torch.int64))]
    buffer, entries = pack_on_device(weights, torch.device("cpu"))
    assert all(offset % 64 == 0 for *_, offset in entries)
    restored = cuda_ipc.views(buffer, entries)
    assert [n for n, _ in restored] == [n for n, _ in weights]
    for (_, original), (_, view) in zip(weights, restored):
        assert view.dtype == original.dtype and torch.equal(view, original)


def test_a_buffer_from_another_gpu_is_refused():
    ipc = cuda_ipc.IpcBuffer(b"h", 8, 0, b"r", 0, b"e", False, device_uuid="GPU-elsewhere")
    with pytest.raises(ValueError, match="GPU-elsewhere"):
        cuda_ipc.open_buffer(ipc, torch.device("cpu"))


def test_adapters_are_written_as_a_peft_folder_that_peft_loads_onto_the_base(tmp_path):
    """What vLLM's LoRA loader reads is PEFT's layout: PEFT itself loads the folder, and its merged
    weights are W + scaling x B @ A (float64 reference) for every adapted module."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_rollout.engine import LoraAdapter
    from grpo_rollout.tiny import build_tiny_model
    from grpo_rollout.vllm_engine import vllm_max_lora_rank, write_peft_adapter

    base_dir = build_tiny_model(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    g = torch.Generator().manual_seed(0)
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.v_proj"]
    adapters = {}
    for m in modules:
        out_f, in_f = weights[f"{m}.weight"].shape
        adapters[m] = LoraAdapter(torch.randn(4, in_f, generator=g), torch.randn(out_f, 4, generator=g), 0.5)
    write_peft_adapter(adapters, tmp_path / "adapter")
    merged = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    got = dict(merged.named_parameters())
    for m, a in adapters.items():
        want = weights[f"{m}.weight"].double() + 0.5 * (a.b.double() @ a.a.double())
        torch.testing.assert_close(got[f"{m}.weight"].double(), want, rtol=1e-5, atol=1e-5)
    untouched = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(got[untouched], weights[untouched])
    # One rank and one scaling per adapter (a PEFT config has one), and vLLM's allowed ranks.
    with pytest.raises(ValueError, match="one rank and one scaling"):
        write_peft_adapter({**adapters, modules[0]: LoraAdapter(adapters[modules[0]].a, adapters[modules[0]].b, 2.0)},
                           tmp_path / "bad")
    assert (vllm_max_lora_rank(4), vllm_max_lora_rank(64), vllm_max_lora_rank(100)) == (8, 64, 128)
    with pytest.raises(ValueError, match="spec.model.lora.rank 1024"):
        vllm_max_lora_rank(1024)


# vLLM's Qwen3 with LoRA on: the fused layers' parameters as vLLM names them, wrapped or not.
_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
_STACKED = [("qkv_proj", "q_proj"), ("qkv_proj", "k_proj"), ("qkv_proj", "v_proj"),
            ("gate_up_proj", "gate_proj"), ("gate_up_proj", "up_proj")]     # vLLM's Qwen2/3 stacked_params_mapping


def _vllm_params(layers: int, lora: bool) -> list[str]:
    wrap = ".base_layer" if lora else ""
    out = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [f"{p}.self_attn.qkv_proj{wrap}.weight", f"{p}.self_attn.o_proj{wrap}.weight",
                f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight",
                f"{p}.mlp.gate_up_proj{wrap}.weight", f"{p}.mlp.down_proj{wrap}.weight",
                f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
    return out


def _hf_names(layers: int) -> list[str]:
    out = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [f"{p}.self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        out += [f"{p}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        out += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
    return out


def _as_vllm_loads(name: str) -> str:
    """The parameter vLLM's load_weights puts a weight of this name into (its substring mapping)."""
    for fused, part in _STACKED:
        if part in name:
            return name.replace(part, fused)
    return name


def test_merged_weights_reach_the_base_layers_of_a_lora_enabled_vllm_model():
    hf, params = _hf_names(2), _vllm_params(2, lora=True)
    renamed = lora_base_names(hf, params, _PACKED)
    # every adapted layer's weight is renamed, nothing else is
    assert renamed["model.layers.1.self_attn.q_proj.weight"] == "model.layers.1.self_attn.q_proj.base_layer.weight"
    assert renamed["model.layers.0.mlp.down_proj.weight"] == "model.layers.0.mlp.down_proj.base_layer.weight"
    assert not {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_norm.weight"} & set(renamed)
    assert len(renamed) == 2 * 7
    # and each lands on a parameter the LoRA model has, as vLLM's loader maps it
    assert {_as_vllm_loads(renamed.get(n, n)) for n in hf} == set(params)
    # without LoRA, nothing changes
    assert lora_base_names(hf, _vllm_params(2, lora=False), _PACKED) == {}


def test_image_runs_are_narrowed_to_the_one_placeholder_per_image_that_vllm_widens():
    """vLLM widens one image placeholder per image itself; a prompt's ids hold the runs the
    trainer widened (grpo_trainer.vision.expand_image_tokens), so narrowing must invert that."""
    from grpo_trainer.vision import expand_image_tokens
    pad, start, end = 9, 7, 8
    rendered = [1, start, pad, end, 2, 3, start, pad, end, 4]            # two images, as the chat template renders
    grids = torch.tensor([[1, 4, 4], [1, 2, 6]])                         # 16 / 4 = 4 and 12 / 4 = 3 tokens
    widened = expand_image_tokens(rendered, pad, grids, merge_size=2)
    assert widened == [1, start, pad, pad, pad, pad, end, 2, 3, start, pad, pad, pad, end, 4]
    assert narrow_image_runs(widened, pad) == rendered
    assert narrow_image_runs([pad, pad, 5], pad) == [pad, 5]
    assert narrow_image_runs([5, 6], pad) == [5, 6]
