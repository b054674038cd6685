"""Policy and reference models: transformers models sharded with FSDP2 (`fully_shard`).

The model code stays plain transformers; parallelism is applied by `apply_fsdp` (as
torchtitan's parallelize functions). On GPU, parameters are kept in float32 and computed in
the spec's dtype (FSDP2 mixed precision); on CPU everything is float32.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from grpo_api.spec import ModelSpec, TrainerSpec
from grpo_api.storage import check_local_model_path

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_hf_model(spec: ModelSpec, *, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    check_local_model_path(spec.path, "spec.model.path")
    try:
        return AutoModelForCausalLM.from_pretrained(
            spec.path, dtype=dtype, trust_remote_code=spec.trust_remote_code, attn_implementation="sdpa")
    except OSError as exc:
        raise FileNotFoundError(f"spec.model.path: can't load a model from {spec.path!r}: {exc}") from None


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer
    path = spec.tokenizer_path or spec.path
    check_local_model_path(path, "spec.model.tokenizerPath" if spec.tokenizer_path else "spec.model.path")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
    except OSError as exc:
        raise FileNotFoundError(f"spec.model.path: can't load a tokenizer from {path!r}: {exc}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"spec.model.path: don't know where the decoder layers of {type(model).__name__} are")
    return list(layers)


def apply_fsdp(model, *, compute_dtype: torch.dtype, on_gpu: bool, cpu_offload: bool = False,
               reshard_after_forward: bool = True):
    """Shard each decoder layer, then the root (embeddings, norm, head)."""
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if on_gpu:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def build_policy(spec: ModelSpec, device: torch.device):
    model = load_hf_model(spec, dtype=torch.float32)
    model.config.use_cache = False
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    on_gpu = device.type == "cuda"
    return apply_fsdp(model, compute_dtype=_DTYPES[spec.dtype.value], on_gpu=on_gpu)


def build_reference(spec: ModelSpec, device: torch.device, *, cpu_offload: bool):
    """A frozen copy of the initial policy for the KL loss."""
    on_gpu = device.type == "cuda"
    model = load_hf_model(spec, dtype=_DTYPES[spec.dtype.value] if on_gpu else torch.float32)
    model.config.use_cache = False
    model.requires_grad_(False).eval()
    if not (on_gpu and cpu_offload):
        model.to(device)
    return apply_fsdp(model, compute_dtype=_DTYPES[spec.dtype.value], on_gpu=on_gpu, cpu_offload=cpu_offload)


def build_optimizer(model, trainer: TrainerSpec, total_steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=trainer.lr, weight_decay=trainer.weight_decay,
                            betas=(0.9, 0.999))
    warmup = trainer.lr_warmup_steps

    def lr_factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if trainer.lr_scheduler == "cosine":
            progress = (step - warmup) / max(1, total_steps - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(config, seq_len: int) -> float:
    """Forward+backward FLOPs per trained token (6N plus attention), for the MFU estimate."""
    n = config.num_hidden_layers
    d = config.hidden_size
    params = 12 * n * d * d + config.vocab_size * d
    return 6 * params + 12 * n * d * seq_len
