"""Which FSDP2 + PEFT LoRA set-ups run a backward on the device's torch (issue 33: the step
fails on the H200 in FSDP2's reduce with "assign a gradient with dtype BFloat16 to a tensor with
grad_dtype Float"; torch 2.15 on CPU does not). One process, one GPU, a small Qwen3 shape; each
variant builds its own model, runs forward + backward + clip + step, and prints ok or the error's
last frames. The plain variants need only torch, transformers and peft (no carry):

    python3 bench/lora_fsdp_check.py [VARIANT ...]     # default: the plain ones, until DEADLINE_S (100)

They all passed on the H200 (torch 2.11): the failure needs the trainer's own path, where the
first forward is the reference's with the adapters off. `trainer-path` builds the policy as the
trainer does (grpo_trainer.model._load_sharded, FSDP2 mixed precision bf16/fp32, a tiny Qwen3),
runs that reference forward first (grpo_trainer.lora.adapters_off), then a backward;
`trainer-path-peft-off` does the same with PEFT's disable_adapter() (the code before the fix).
Mixed precision runs on CPU too, so torch 2.11's failure reproduces here (bench/RESULTS.md):

    python3 -m venv /tmp/v211 && /tmp/v211/bin/pip install torch==2.11.0 transformers==5.17.0 peft==0.21.0 \
        'pydantic>=2.7,<3' pyyaml pyarrow grpcio protobuf prometheus-client safetensors cryptography
    PYTHONPATH=api:trainer_image:rollout_image /tmp/v211/bin/python bench/lora_fsdp_check.py trainer-path trainer-path-peft-off
"""
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

START = time.time()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # cpu: a check of this script only
DEADLINE_S = float(os.environ.get("DEADLINE_S", 100))
# name: (base dtype, compile, gradient checkpointing, reduce dtype)
VARIANTS = {
    "eager": (torch.bfloat16, False, True, torch.float32),
    "compiled": (torch.bfloat16, True, True, torch.float32),
    "compiled-fp32-base": (torch.float32, True, True, torch.float32),
    "compiled-no-gc": (torch.bfloat16, True, False, torch.float32),
    "compiled-reduce-none": (torch.bfloat16, True, True, None),
}


def run(name: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config
    base_dtype, compile_, gc, reduce_dtype = VARIANTS[name]
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=base_dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    layers = model.get_base_model().model.layers
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if compile_:
        for layer in layers:
            layer.forward = torch.compile(layer.forward)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 4096, (4, 128), device=DEVICE)
    for _ in range(2):      # two micro-batches: the second accumulates into the first's grads
        logits = model(input_ids=ids).logits
        torch.log_softmax(logits.float(), -1).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    print(f"{name}: ok (trainable {trainable}, grads {grads}, norm {float(norm.full_tensor() if hasattr(norm, 'full_tensor') else norm):.3g})", flush=True)


def run_trainer_path(peft_off: bool) -> None:
    import tempfile
    from grpo_api.spec import ModelSpec
    from grpo_rollout import tiny
    from grpo_trainer import model as M
    from grpo_trainer.lora import adapters_off, add_adapters
    path = tiny.build_tiny_model(tempfile.mkdtemp(prefix="lora-check-"))
    spec = ModelSpec.model_validate({"path": str(path), "lora": {"rank": 4, "alpha": 8}, "gradientCheckpointing": True})

    def prepare(m):
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = M._load_sharded(spec, torch.device(DEVICE), dtype=torch.bfloat16, prepare=prepare,
                            wrap=lambda m: add_adapters(m, spec),
                            shard=lambda m: M.apply_fsdp(m, compute_dtype=torch.bfloat16, on_gpu=True))
    ids = torch.randint(0, 20, (2, 12), device=DEVICE)
    with torch.no_grad(), (model.disable_adapter() if peft_off else adapters_off(model)):
        model(input_ids=ids)          # the reference's forward comes first, as in an on-policy step
    torch.log_softmax(model(input_ids=ids).logits.float(), -1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    print(f"trainer-path{'-peft-off' if peft_off else ''}: ok (grads {({g.dtype for g in grads})}, "
          f"{len(grads)} adapter tensors)", flush=True)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    import peft
    import transformers
    print(f"torch {torch.__version__} transformers {transformers.__version__} peft {peft.__version__}", flush=True)
    for name in sys.argv[1:] or list(VARIANTS):
        if time.time() - START > DEADLINE_S:
            print(f"{name}: not run (deadline)", flush=True)
            continue
        try:
            if name.startswith("trainer-path"):
                run_trainer_path(peft_off=name == "trainer-path-peft-off")
            else:
                run(name)
        except Exception as exc:
            tb = traceback.format_exc().strip().splitlines()
            print(f"{name}: FAILED {type(exc).__name__}: {exc}\n  " + "\n  ".join(tb[-14:]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
