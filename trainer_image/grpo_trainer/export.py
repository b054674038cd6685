"""Hugging Face export: safetensors + config + tokenizer that `from_pretrained` loads.

Used at the end of every run (the final policy) and by `grpo export CHECKPOINT --out DIR`. A
LoRA policy is exported merged, with its PEFT adapter folder beside (`lora_adapter/`).
"""

from __future__ import annotations

import os
import tempfile

import torch

from grpo_api.spec import ModelSpec
from grpo_api.storage import Storage


def save_hf(weights: dict[str, torch.Tensor], model_spec: ModelSpec, uri: str, storage: Storage) -> None:
    from transformers import AutoConfig
    from grpo_trainer.model import load_tokenizer
    from grpo_trainer.vision import auto_model_class, is_vision_language
    config = AutoConfig.from_pretrained(model_spec.path, trust_remote_code=model_spec.trust_remote_code)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, trust_remote_code=model_spec.trust_remote_code)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    local = uri.removeprefix("file://") if uri.startswith("file://") else tempfile.mkdtemp(prefix="grpo-hf-")
    model.to(getattr(torch, model_spec.dtype.value)).save_pretrained(local, safe_serialization=True)
    load_tokenizer(model_spec).save_pretrained(local)
    if is_vision_language(config):     # the image processor: the export is a VL model folder too
        from transformers import AutoImageProcessor
        AutoImageProcessor.from_pretrained(model_spec.path).save_pretrained(local)
    if not uri.startswith("file://"):
        for name in os.listdir(local):
            with open(os.path.join(local, name), "rb") as f:
                storage.write_bytes(f"{uri}/{name}", f.read())


def save_adapter(tensors: dict[str, torch.Tensor], lora_config: dict, model_spec: ModelSpec, uri: str,
                 storage: Storage) -> None:
    """A LoRA policy's PEFT adapter folder at `uri`/lora_adapter (verl's name):
    adapter_config.json and adapter_model.safetensors, for `PeftModel.from_pretrained(base, it)`."""
    from grpo_trainer.lora import ADAPTER_FOLDER
    from grpo_trainer.lora import save_adapter as write
    folder = f"{uri}/{ADAPTER_FOLDER}"
    local = folder.removeprefix("file://") if folder.startswith("file://") else tempfile.mkdtemp(prefix="grpo-lora-")
    write(tensors, lora_config, model_spec.path, local)
    if not folder.startswith("file://"):
        for name in os.listdir(local):
            with open(os.path.join(local, name), "rb") as f:
                storage.write_bytes(f"{folder}/{name}", f.read())
