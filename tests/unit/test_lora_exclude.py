"""spec.model.lora.excludeModules (verl: exclude_modules): the modules it matches get no adapter;
every base weight still reaches the rollout servers and the merged export, the excluded ones as
loaded. A tiny Llama built in process."""

import re

import pytest
import torch
from peft.tuners.lora import LoraLayer
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_api.from_verl import _exclude_modules
from grpo_api.jobfile import JobError, parse_job
from grpo_api.spec import ModelSpec
from grpo_trainer.lora import (add_adapters, config_from_dict, config_to_dict, lora_config, merged_from_checkpoint,
                               rollout_entries)


def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2))


def adapted(model) -> set[str]:
    return {name.removeprefix("base_model.model.") for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def lora_spec(exclude):
    return ModelSpec(path="tiny", lora={"rank": 4, "excludeModules": exclude})


def test_an_excluded_module_gets_no_adapter_and_its_weight_syncs_as_loaded():
    base = tiny()
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    model = add_adapters(base, lora_spec(r".*layers\.0\.mlp\..*"))
    names = adapted(model)
    assert not any(n.startswith("model.layers.0.mlp.") for n in names)
    assert {"model.layers.1.mlp.up_proj", "model.layers.0.self_attn.q_proj"} <= names
    entries = {name: adapter for name, _, adapter in rollout_entries(model)}
    assert set(entries) == set(plain)          # every base tensor, under its own name, once
    assert entries["model.layers.0.mlp.up_proj.weight"] is None
    assert entries["model.layers.1.mlp.up_proj.weight"] is not None


def test_the_merged_export_covers_excluded_modules_with_their_base_weights():
    base = tiny()
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    config = config_to_dict(lora_config(lora_spec(r".*\.0\.mlp\..*")))       # as a checkpoint keeps it
    assert config_from_dict(config).exclude_modules == r".*\.0\.mlp\..*"
    model = add_adapters(tiny(), lora_spec(r".*\.0\.mlp\..*"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)                   # adapters that moved: merged weights differ from the base
    adapters = {n: t for n, t in model.state_dict().items() if ".lora_" in n}       # a checkpoint's names
    merged = merged_from_checkpoint(base, adapters, config)
    assert set(merged) == set(plain)
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], plain["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(merged["model.layers.1.mlp.up_proj.weight"], plain["model.layers.1.mlp.up_proj.weight"])


def test_a_verl_list_of_names_excludes_what_peft_excludes_for_that_list():
    """from-verl writes a list as one regular expression: the same modules as PEFT's own list rule."""
    names = ["down_proj", "layers.1.self_attn.q_proj"]
    from peft import LoraConfig, get_peft_model
    by_peft = adapted(get_peft_model(tiny(), LoraConfig(r=4, target_modules="all-linear", exclude_modules=names)))
    ours = adapted(add_adapters(tiny(), lora_spec(_exclude_modules(names, None))))
    assert ours == by_peft and "model.layers.0.self_attn.q_proj" in ours
    assert not any(n.endswith("down_proj") or n == "model.layers.1.self_attn.q_proj" for n in ours)


def test_a_bad_regular_expression_is_an_error_naming_the_field():
    doc = {"spec": {"model": {"path": "Qwen/Qwen3-8B", "lora": {"rank": 8, "excludeModules": ".*visual(.*"}},
                    "data": {"trainFiles": ["t.parquet"], "trainBatchSize": 16}, "trainer": {"miniBatchSize": 8}}}
    with pytest.raises(JobError) as info:
        parse_job(doc)
    assert any(e.startswith("spec.model.lora.excludeModules:") and "not a regular expression" in e
               for e in info.value.errors), info.value.errors
    assert re.fullmatch(_exclude_modules(["q_proj"], None), "model.layers.0.self_attn.q_proj")
