"""LoRA (spec.model.lora): PEFT adapters on the frozen policy, as verl's FSDP workers train them.

- The policy is the model wrapped by PEFT (`add_adapters`) before FSDP2 shards it; only the
  adapters' A and B require gradients, so the optimizer holds them alone.
- The reference model is the same model with its adapters switched off (`adapters_off`): no
  second copy of the weights.
- The rollout servers get the adapters alone where their engine applies them (the hf engine:
  `full_adapter_tensors`, each module's lora_A and lora_B under the engine's module name, and
  `adapter_scaling`), else plain Hugging Face weights: `rollout_entries` names every base tensor
  as the engines know it (no PEFT prefix) with the adapter to merge into it, and the publisher
  sends W + scaling x B @ A (`merge`). spec.model.lora.merge sends merged weights to all.
- Checkpoints hold the adapters (and their optimizer state) only; the base is spec.model.path.
- Exports: the merged model, and the PEFT adapter folder (`lora_adapter/`, verl's name) that
  `PeftModel.from_pretrained(base, folder)` loads.

PEFT is imported inside the functions: a full-parameter run never imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import torch

from grpo_api.spec import LoRASpec, ModelSpec
from grpo_api.weights import LORA_A, LORA_B, lora_tensor_name
from grpo_trainer.collectives import SetupError

ADAPTER = "default"              # PEFT's name of the one adapter
PEFT_PREFIX = "base_model.model."
ADAPTER_FOLDER = "lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def lora_config(model_spec: ModelSpec):
    """The PEFT LoraConfig of spec.model.lora: the adapter's own config with adapterPath."""
    from peft import LoraConfig
    lora = model_spec.lora
    if lora.adapter_path:
        config_file = os.path.join(lora.adapter_path, ADAPTER_CONFIG)
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"spec.model.lora.adapterPath: {config_file} not found (a PEFT adapter folder "
                                    f"has {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
        config = LoraConfig.from_pretrained(lora.adapter_path)
        config.inference_mode = False
        return config
    targets = lora.target_modules
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                      task_type="CAUSAL_LM",
                      target_modules="all-linear" if targets == ["all-linear"] else list(targets),
                      exclude_modules=lora.exclude_modules)


def config_from_dict(d: dict):
    from peft import LoraConfig
    fields = {k: v for k, v in d.items() if k in LoraConfig.__dataclass_fields__}
    return LoraConfig(**fields)


def config_to_dict(config) -> dict:
    """JSON-able (PEFT keeps target_modules as a set)."""
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def check_targets(model, lora: LoRASpec) -> None:
    """spec.model.lora.targetModules must each name a linear layer (PEFT's rule: the module's
    name or a dotted suffix of it); said before anything starts, with the names there are."""
    if lora.adapter_path or lora.target_modules == ["all-linear"]:
        return
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in lora.target_modules
               if not any(name == t or name.endswith("." + t) for name in linear)]
    if missing:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise SetupError(f"spec.model.lora.targetModules: {', '.join(map(repr, missing))} "
                         f"{'names' if len(missing) == 1 else 'name'} no linear layer of {type(model).__name__} "
                         f"(its linear layers: {', '.join(leaves)}; or all-linear)")


def add_adapters(model, model_spec: ModelSpec):
    """`model` wrapped by PEFT with new adapters (A random, B zero: the policy starts as the
    model) or, with adapterPath, that adapter's weights; the base frozen."""
    from peft import PeftModel, get_peft_model
    check_targets(model, model_spec.lora)
    config = lora_config(model_spec)
    if model_spec.lora.adapter_path and not _on_meta(model):
        return PeftModel.from_pretrained(model, model_spec.lora.adapter_path, is_trainable=True)
    return get_peft_model(model, config)


def wrapper(model_spec: ModelSpec):
    """model.build_policy's `wrap`: the adapters of spec.model.lora on the model (None without)."""
    if model_spec.lora is None:
        return None
    return lambda model: add_adapters(model, model_spec)


@contextlib.contextmanager
def adapters_off(model):
    """The model with every LoRA layer computing only its base layer: the base model, exactly.

    PEFT's own `disable_adapter()` also sets requires_grad False on the adapters, and FSDP2 reads
    requires_grad when it first runs (its lazy init, and the unsharded copy of each parameter made
    at the first all-gather). An on-policy step's first forward is the reference's, so torch
    2.11's FSDP2 then took the adapters for frozen and reduced their gradients in bf16 ("assign
    a gradient with dtype BFloat16 to a tensor with grad_dtype Float", bench/RESULTS.md). Here
    only the switch that the layers' forward reads is flipped."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m, off in zip(layers, before):
            m._disable_adapters = off


def _on_meta(model) -> bool:
    return next(model.parameters()).device.type == "meta"


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def base_model(model):
    """The transformers model under the PEFT wrapper (the model itself without LoRA)."""
    return model.get_base_model() if is_lora(model) else model


@dataclass
class Adapter:
    """One layer's adapter: its weight becomes W + scaling x B @ A."""
    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def rollout_entries(model) -> list[tuple[str, torch.Tensor, Adapter | None]]:
    """(name as the rollout engines load it, tensor, the adapter to merge into it) for every
    tensor of the base model once (a tied LM head is the embedding). Parameters may be DTensors."""
    from peft.tuners.lora import LoraLayer
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    out, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if ".lora_" in name or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        module, _, leaf = name.rpartition(".")
        adapter = None
        if module.endswith(".base_layer"):
            module = module.removesuffix(".base_layer")
            layer = layers[module]
            if leaf == "weight":
                adapter = Adapter(layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER])
        out.append((f"{module}.{leaf}".removeprefix(PEFT_PREFIX), tensor, adapter))
    return out


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling x B @ A (PEFT's merge of a Linear), in float32, in W's dtype."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_rollout_tensors(model):
    """Collective (every rank, same order): (name, full merged tensor) of `rollout_entries`."""
    for name, tensor, adapter in rollout_entries(model):
        full = _full(tensor)
        if adapter is not None:
            full = merge(full, _full(adapter.a), _full(adapter.b), adapter.scaling)
        yield name, full


def adapter_modules(model) -> list[tuple[str, Adapter]]:
    """(module name as the rollout engines know it, its adapter) for every weight that
    `rollout_entries` merges an adapter into: what an adapter-only sync carries."""
    return [(name.removesuffix(".weight"), adapter) for name, _, adapter in rollout_entries(model)
            if adapter is not None]


def adapter_scaling(model) -> dict[str, float]:
    return {module: float(adapter.scaling) for module, adapter in adapter_modules(model)}


def full_adapter_tensors(model):
    """Collective (every rank, same order): (name on the wire, full tensor) of every adapter's A
    and B, `<module>.lora_A.weight` and `<module>.lora_B.weight` (grpo_api.weights)."""
    for module, adapter in adapter_modules(model):
        yield lora_tensor_name(module, LORA_A), _full(adapter.a)
        yield lora_tensor_name(module, LORA_B), _full(adapter.b)


def adapter_file_name(state_name: str) -> str:
    """A state-dict name of an adapter weight as PEFT's adapter file has it (no adapter name)."""
    return state_name.replace(f".{ADAPTER}.", ".")


def adapter_tensors(model, *, rank: int) -> dict[str, torch.Tensor] | None:
    """Collective: the adapters' full tensors on the CPU of rank 0 (None elsewhere), named as
    PEFT's adapter file names them."""
    out = {}
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if ".lora_" in name:
                full = _full(tensor)
                if rank == 0:
                    out[adapter_file_name(name)] = full.detach().to("cpu", copy=True)
    return out if rank == 0 else None


def save_adapter(tensors: dict[str, torch.Tensor], config: dict, base_path: str, folder: str) -> None:
    """A PEFT adapter folder: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    cfg = config_from_dict(config)
    cfg.base_model_name_or_path = base_path
    cfg.inference_mode = True
    cfg.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def merged_from_checkpoint(base_model_, adapters: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The merged weights (Hugging Face names) of a checkpoint's adapters (state-dict names,
    PEFT's) on `base_model_` (the transformers model of spec.model.path): PEFT's own merge."""
    from peft import get_peft_model
    peft_model = get_peft_model(base_model_, config_from_dict(config))
    missing = set(adapters) - set(peft_model.state_dict())
    if missing:
        raise ValueError(f"the checkpoint's adapters don't fit the model: {sorted(missing)[:3]}")
    peft_model.load_state_dict(adapters, strict=False)
    return peft_model.merge_and_unload().state_dict()


def check_spec(model_spec: ModelSpec) -> dict:
    """spec.model.lora against the model, on its config alone (no weights read): the targets
    exist, an adapterPath is an adapter. The PEFT config, JSON-able (checkpoints keep it)."""
    from grpo_trainer.model import model_config
    from grpo_trainer.vision import auto_model_class
    config = model_config(model_spec)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, trust_remote_code=model_spec.trust_remote_code)
    check_targets(model, model_spec.lora)
    return config_to_dict(lora_config(model_spec))
