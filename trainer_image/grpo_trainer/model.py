"""Policy and reference models: transformers models sharded with FSDP2 (`fully_shard`).

The model code stays plain transformers; parallelism is applied by `apply_fsdp` (as
torchtitan's parallelize functions). On GPU, parameters are kept in float32 and computed in
the spec's dtype (FSDP2 mixed precision); on CPU everything is float32.

Loading (`_load_sharded`), as torchtitan and verl do it: every rank builds the model on the meta
device and shards it; only rank 0 reads the checkpoint, in its own dtype, and each rank receives
its shards from it. Host memory stays near one checkpoint copy per job, not one float32 copy per
rank (Qwen3-8B on 4 ranks: ~16 GB instead of ~130 GB).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from grpo_api.spec import CriticSpec, ModelSpec, TrainerSpec
from grpo_api.storage import check_local_model_path
from grpo_trainer.attention import attn_implementation, vision_attn_implementation
from grpo_trainer.lm_head import install_fused_head
from grpo_trainer.vision import (auto_model_class, decoder_layers, freeze_vision_tower, is_vision_language,
                                 set_vision_attention, vision_blocks)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_config(spec: ModelSpec, *, value_head: bool = False, field: str = "spec.model.path"):
    """The model's config; with `value_head`, PPO's critic: one value per token (verl's
    token-classification critic) and no dropout (transformers' head defaults to 0.1)."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    except OSError as exc:
        raise FileNotFoundError(f"{field}: can't load a model config from {spec.path!r}: {exc}") from None
    if value_head:
        config.num_labels, config.classifier_dropout = 1, 0.0
    return config


def load_hf_model(spec: ModelSpec, *, dtype: torch.dtype | str = torch.float32, value_head: bool = False,
                  field: str = "spec.model.path"):
    """The Hugging Face model at spec.path: a causal LM, or with `value_head` the same backbone
    with a scalar head on every token (a new head, initialized from torch's RNG, unless the
    checkpoint is a one-label token classifier)."""
    from transformers import AutoModelForTokenClassification
    check_local_model_path(spec.path, field)
    config = model_config(spec, value_head=value_head, field=field)
    auto = AutoModelForTokenClassification if value_head else auto_model_class(config)
    extra = {"config": config} if value_head else {}
    try:
        return auto.from_pretrained(spec.path, dtype=dtype, trust_remote_code=spec.trust_remote_code,
                                    attn_implementation="sdpa", **extra)
    except OSError as exc:
        raise FileNotFoundError(f"{field}: can't load a model from {spec.path!r}: {exc}") from None


def training_device(want: str) -> torch.device:
    """trainer.device: this rank's GPU (LOCAL_RANK, made current) under cuda or auto with a GPU; else the CPU."""
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


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
    if hasattr(model, "get_base_model"):   # a PEFT (LoRA) wrapper
        model = model.get_base_model()
    vl_layers = decoder_layers(model)
    if vl_layers is not None:
        return vl_layers
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
    # A vision block's rotary cos/sin come in float32. FSDP2 casts a layer's inputs to the compute
    # dtype in the forward but not in gradient checkpointing's recompute (its pre-forward hook
    # returns early in backward): the two would differ (a CheckpointError on the H200). The blocks
    # take their inputs as they come (hidden states already in the compute dtype), their rotary
    # math in float32 as transformers' own.
    vision = {id(b) for b in vision_blocks(model)}
    as_given = {**kwargs, "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                                            cast_forward_inputs=False)} if on_gpu else kwargs
    for layer in _decoder_layers(model):
        fully_shard(layer, **(as_given if id(layer) in vision else kwargs))
    fully_shard(model, **kwargs)
    return model


def compile_layers(model) -> None:
    """Regional compilation, as torchtitan does: each decoder layer's forward is compiled
    inside its FSDP2 hooks and checkpoint wrapper, and the layers share one graph (compiling
    the whole model would trace FSDP's collectives and recompile per layer)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    for layer in _decoder_layers(model):
        layer.forward = torch.compile(layer.forward)


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters are created on the meta device (no memory, no init); buffers stay real, so
    those computed at construction (rotary frequencies) keep their values. A parameter that is
    already on meta is registered as is, so tied weights stay one parameter. (accelerate's
    init_empty_weights works the same way.)"""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)
    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _load_sharded(spec: ModelSpec, device: torch.device, *, dtype: torch.dtype, prepare, shard,
                  value_head: bool = False, field: str = "spec.model.path", wrap=None):
    """The model in `dtype` on `device`, sharded by `shard(model)`, with the checkpoint's
    weights: read by rank 0 alone, each rank receiving its shards (module docstring).
    `prepare(model)` runs before sharding (gradient checkpointing, freezing); `wrap(model)`
    after it returns the model to shard (the LoRA wrapper), on rank 0's loaded copy too, whose
    state (new adapters included) every rank then receives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForTokenClassification
    check_local_model_path(spec.path, field)
    config = model_config(spec, value_head=value_head, field=field)
    auto = AutoModelForTokenClassification if value_head else auto_model_class(config)
    # A VL model's micro-batches are never packed (grpo_trainer.vision): plain sdpa.
    vl = is_vision_language(config)
    packed, shared = spec.use_remove_padding and not vl, spec.share_prompts and not vl
    with _parameters_on_meta():
        model = auto.from_config(config, dtype=dtype, trust_remote_code=spec.trust_remote_code,
                                 attn_implementation=attn_implementation(device, packed, _DTYPES[spec.dtype.value],
                                                                         shared))
    vision_attention = vision_attn_implementation(device, _DTYPES[spec.dtype.value])
    if is_vision_language(config) and vision_attention is not None:
        set_vision_attention(model, vision_attention)     # one kernel call per layer, not one per window
    prepare(model)
    if wrap is not None:
        model = wrap(model)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model = shard(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in buffers.items():
            model.get_buffer(name).copy_(b)
    # The checkpoint's own dtype (bf16 for real models) loses nothing and halves rank 0's copy.
    full = {}
    if dist.get_rank() == 0:
        loaded = load_hf_model(spec, dtype="auto", value_head=value_head, field=field)
        full = (wrap(loaded) if wrap is not None else loaded).state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def build_policy(spec: ModelSpec, device: torch.device, *, compile: bool = False, wrap=None,
                 freeze_vision: bool = False):
    """The policy, sharded. With spec.model.lora, `wrap` puts the adapters on the frozen model
    (grpo_trainer.lora.wrapper: passed in, since lora.py reads this module's config loader).
    `freeze_vision` (trainer.freezeVisionTower): a VL model's vision tower does not train."""
    if spec.lora is not None and wrap is None:
        raise ValueError("spec.model.lora: build_policy needs the LoRA wrap (grpo_trainer.lora.wrapper)")
    on_gpu = device.type == "cuda"

    def prepare(model):
        model.config.use_cache = False
        if spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.use_fused_kernels:
            install_fused_head(model)
        if freeze_vision and is_vision_language(model.config):
            freeze_vision_tower(model)
    dtype = torch.float32
    if spec.lora is not None:
        # The frozen base needs no float32 master copy: on GPU it stays in the compute dtype
        # (half the memory); the adapters are float32 (PEFT upcasts them), FSDP2 needs only the
        # trainable parameters to share a dtype.
        dtype = _DTYPES[spec.dtype.value] if on_gpu else torch.float32
    model = _load_sharded(spec, device, dtype=dtype, prepare=prepare, wrap=wrap,
                          shard=lambda m: apply_fsdp(m, compute_dtype=_DTYPES[spec.dtype.value], on_gpu=on_gpu))
    if compile and on_gpu:
        compile_layers(model)
    return model


def build_critic(spec: ModelSpec, critic: CriticSpec, device: torch.device):
    """PPO's value model: critic.modelPath (default: the policy's model) with a scalar head on
    every token, trained in float32 master weights like the policy."""
    on_gpu = device.type == "cuda"
    spec = spec.model_copy(update={"path": critic.model_path or spec.path,
                                   "gradient_checkpointing": critic.gradient_checkpointing})

    def prepare(model):
        model.config.use_cache = False
        if spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _load_sharded(spec, device, dtype=torch.float32, prepare=prepare, value_head=True,
                         field="spec.critic.modelPath" if critic.model_path else "spec.model.path",
                         shard=lambda m: apply_fsdp(m, compute_dtype=_DTYPES[spec.dtype.value], on_gpu=on_gpu))


def build_reference(spec: ModelSpec, device: torch.device, *, cpu_offload: bool, compile: bool = False):
    """A frozen copy of the initial policy for the KL loss."""
    on_gpu = device.type == "cuda"
    dtype = _DTYPES[spec.dtype.value] if on_gpu else torch.float32

    def prepare(model):
        model.config.use_cache = False
        model.requires_grad_(False).eval()
        if spec.use_fused_kernels:
            install_fused_head(model)

    def shard(model):
        return apply_fsdp(model, compute_dtype=_DTYPES[spec.dtype.value], on_gpu=on_gpu, cpu_offload=cpu_offload)
    if on_gpu and cpu_offload:
        # Offloaded shards live in host memory, where the NCCL broadcast of the loader can't
        # reach: each rank reads the checkpoint itself (one copy per rank while loading).
        model = load_hf_model(spec, dtype=dtype)
        prepare(model)
        model = shard(model)
    else:
        model = _load_sharded(spec, device, dtype=dtype, prepare=prepare, shard=shard)
    if compile and on_gpu:
        compile_layers(model)
    return model


def warmup_steps(trainer: TrainerSpec | CriticSpec, total_steps: int) -> int:
    """verl's rule (FSDP engine's _build_lr_scheduler): lrWarmupSteps when set, else
    int(lrWarmupStepsRatio x the run's total steps), truncated as verl does."""
    return trainer.lr_warmup_steps or int(trainer.lr_warmup_steps_ratio * total_steps)


def build_optimizer(model, trainer: TrainerSpec | CriticSpec, total_steps: int):
    # Only what trains (with LoRA: the adapters; the frozen base has no optimizer state).
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=trainer.lr, weight_decay=trainer.weight_decay, betas=(0.9, 0.999))
    warmup = warmup_steps(trainer, total_steps)

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
