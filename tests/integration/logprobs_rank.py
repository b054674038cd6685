"""One rank (gloo, CPU) of tests/integration/test_trainer.py's log-prob check: the trainer's own
`forward_logprobs` through FSDP2-sharded models as `build_policy`/`build_reference` make them
(gradient checkpointing on), the fused LM head (model.useFusedKernels) against the logits path,
and both against an unsharded float64 copy of the model. Prints one JSON line of the largest
differences: of log-probs and entropies on the responses' tokens, and of every gradient."""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from grpo_api.spec import CriticSpec, ModelSpec
from grpo_trainer import lora
from grpo_trainer import model as M
from grpo_trainer.actor import forward_logprobs
from grpo_trainer.batch import Sample, collate
from grpo_trainer.critic import forward_values
from grpo_trainer.lm_head import fused_head

T = 0.7
CPU = torch.device("cpu")


def samples(vocab: int) -> list[Sample]:
    """Mixed prompt and response lengths (padding, a longer prompt than the shortest), and a
    multi-turn sample whose tool tokens the response mask drops."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate([(5, 9), (8, 3), (3, 12), (6, 6)]):
        ids = torch.randint(1, vocab, (p + r,), generator=gen).tolist()
        mask = [1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1] if r == 12 else None
        out.append(Sample(f"u{i}", i, 0, ids[:p], ids[p:], [0.0] * r, 0.0, "stop", loss_mask=mask))
    return out


def grouped_samples(vocab: int) -> list[Sample]:
    """GRPO's layout for model.sharePrompts: prompt A's three responses (one with a tool turn) and
    prompt B's two, of mixed lengths, interleaved as the micro-batches may hold them."""
    gen = torch.Generator().manual_seed(2)
    prompts = {"a": torch.randint(1, vocab, (7,), generator=gen).tolist(),
               "b": torch.randint(1, vocab, (4,), generator=gen).tolist()}
    out = []
    for i, (uid, r) in enumerate([("a", 9), ("b", 5), ("a", 12), ("a", 3), ("b", 8)]):
        mask = [1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1] if r == 12 else None
        out.append(Sample(uid, "ab".index(uid), i, prompts[uid], torch.randint(1, vocab, (r,), generator=gen).tolist(), [0.0] * r,
                          0.0, "stop", loss_mask=mask))
    return out


def loss_weights(mb):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(mb.targets.shape, generator=gen, dtype=torch.float64) * mb.response_mask,
            torch.randn(mb.targets.shape, generator=gen, dtype=torch.float64) * mb.response_mask)


def trainer_pass(model, mb, *, backward: bool = True):
    """Log-probs and entropies on the responses' tokens, and the gradients of a loss with both."""
    model.zero_grad(set_to_none=True)
    logp, entropy = forward_logprobs(model, mb, T, with_entropy=True, entropy_grad=backward)
    if backward:
        a, b = loss_weights(mb)
        ((logp.double() * a).sum() + (entropy.double() * b).sum()).backward()
    grads = {n: p.grad.full_tensor().double() for n, p in model.named_parameters() if p.grad is not None}
    keep = mb.response_mask.bool()
    return logp.detach()[keep].double(), entropy.detach()[keep].double(), grads


def critic_pass(model, mb):
    """The critic's values on the responses' tokens and the gradients of a loss on them."""
    model.zero_grad(set_to_none=True)
    values = forward_values(model, mb)
    a, _ = loss_weights(mb)
    (values.double() * a).sum().backward()
    keep = mb.response_mask.bool()
    return (values.detach()[keep].double(), values.detach()[keep].double(),
            {n: p.grad.full_tensor().double() for n, p in model.named_parameters() if p.grad is not None})


def float64_pass(path: str, mb):
    """The same loss on an unsharded float64 copy, from the full logits (log_softmax)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1] / T
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    a, b = loss_weights(mb)
    ((logp * a).sum() + (entropy * b).sum()).backward()
    keep = mb.response_mask.bool()
    return logp.detach()[keep], entropy.detach()[keep], {n: p.grad for n, p in model.named_parameters()}


def diff(x, y) -> float:
    """The largest difference relative to the reference's largest magnitude."""
    if isinstance(x, dict):
        assert x.keys() == y.keys() and x, (sorted(x), sorted(y))
        return max(diff(x[k], y[k]) for k in x)
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))


def compare(a, b) -> dict[str, float]:
    return {"logp": diff(a[0], b[0]), "entropy": diff(a[1], b[1]), "grads": diff(a[2], b[2]) if b[2] else 0.0}


def main() -> None:
    tied, untied = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    report = {}
    for name, path in (("tied", tied), ("untied", untied)):
        fused = M.build_policy(ModelSpec(path=path), CPU)
        plain = M.build_policy(ModelSpec.model_validate({"path": path, "useFusedKernels": False}), CPU)
        assert type(fused.lm_head).__name__ == "FusedLMHead" and type(plain.lm_head) is torch.nn.Linear
        mb = collate(list(range(4)), samples(fused.config.vocab_size), None, 0, CPU)
        got, want = trainer_pass(fused, mb), trainer_pass(plain, mb)
        report[f"{name}/fused-vs-logits"] = compare(got, want)
        report[f"{name}/fused-vs-float64"] = compare(got, float64_pass(path, mb))
        report[f"{name}/logits-vs-float64"] = compare(want, float64_pass(path, mb))
        # model.useRemovePadding: one row, each sample with its own positions, no attention mask
        packed = collate(list(range(4)), samples(fused.config.vocab_size), None, 0, CPU, pack=True)
        report[f"{name}/packed-vs-padded"] = compare(trainer_pass(fused, packed), got)
        report[f"{name}/packed-logits-vs-padded"] = compare(trainer_pass(plain, packed), want)
        if name == "untied":   # the check can fail: positions that run on across samples mix them
            run_on = torch.arange(packed.packed.input_ids.shape[1]).unsqueeze(0)
            mixed = dataclasses.replace(packed, packed=dataclasses.replace(packed.packed, position_ids=run_on))
            report["untied/run-on-positions-differ"] = compare(trainer_pass(fused, mixed), got)["logp"]
        if name == "tied":
            report["tied/head-is-embedding"] = fused.lm_head.weight is fused.model.embed_tokens.weight
    spec = ModelSpec.model_validate({"path": untied, "lora": {"rank": 4, "alpha": 8}})
    torch.manual_seed(0)      # the same new adapters (A from torch's RNG) in both
    lora_fused = M.build_policy(spec, CPU, wrap=lora.wrapper(spec))
    assert fused_head(lora_fused) is not None       # PEFT's all-linear leaves the LM head alone
    torch.manual_seed(0)
    plain_spec = spec.model_copy(update={"use_fused_kernels": False})
    lora_plain = M.build_policy(plain_spec, CPU, wrap=lora.wrapper(plain_spec))
    # B starts at 0: move it so that the adapters change the log-probs and every gradient shows.
    for model in (lora_fused, lora_plain):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.full_like(p, 0.05))
    report["lora/fused-vs-logits"] = compare(trainer_pass(lora_fused, mb), trainer_pass(lora_plain, mb))
    report["lora/packed-vs-padded"] = compare(trainer_pass(lora_fused, packed), trainer_pass(lora_fused, mb))
    critic = M.build_critic(ModelSpec(path=untied), CriticSpec(), CPU)
    report["critic/packed-vs-padded"] = compare(critic_pass(critic, packed), critic_pass(critic, mb))
    # model.sharePrompts: each prompt once in the row, its responses attending to it
    spec = ModelSpec.model_validate({"path": untied, "sharePrompts": True})
    shared_model, grouped = M.build_policy(spec, CPU), grouped_samples(fused.config.vocab_size)
    padded_rows = collate(list(range(5)), grouped, None, 0, CPU)
    shared = collate(list(range(5)), grouped, None, 0, CPU, share_prompts=True)
    report["shared/row-tokens"] = [shared.packed.input_ids.shape[1], len(shared.packed.expand)]
    report["shared/shared-vs-padded"] = compare(trainer_pass(shared_model, shared), trainer_pass(shared_model, padded_rows))
    report["shared/shared-vs-float64"] = compare(trainer_pass(shared_model, shared), float64_pass(untied, padded_rows))
    # the check can fail: positions that run on through the row, not each response's after its prompt
    run_on = torch.arange(shared.packed.input_ids.shape[1]).unsqueeze(0)
    wrong = dataclasses.replace(shared, packed=dataclasses.replace(shared.packed, position_ids=run_on))
    report["shared/run-on-positions-differ"] = compare(trainer_pass(shared_model, wrong),
                                                          trainer_pass(shared_model, padded_rows))["logp"]
    shared_critic = M.build_critic(spec, CriticSpec(), CPU)
    report["shared/critic-shared-vs-padded"] = compare(critic_pass(shared_critic, shared),
                                                       critic_pass(shared_critic, padded_rows))
    with torch.no_grad():
        shared_ref = M.build_reference(spec, CPU, cpu_offload=False)
        report["shared/reference-shared-vs-padded"] = compare(trainer_pass(shared_ref, shared, backward=False),
                                                              trainer_pass(shared_ref, padded_rows, backward=False))
    with torch.no_grad():
        ref = [trainer_pass(M.build_reference(ModelSpec.model_validate({"path": untied, "useFusedKernels": fused}), CPU,
                                              cpu_offload=False), mb, backward=False) for fused in (True, False)]
    report["reference/fused-vs-logits"] = compare(*ref)
    # The GPU set-up on CPU: float32 master weights, bf16 compute (FSDP2 mixed precision).
    bf16 = []
    for fused in (True, False):
        model = M._load_sharded(ModelSpec(path=untied), CPU, dtype=torch.float32,
                                prepare=M.install_fused_head if fused else lambda m: None,
                                shard=lambda m: M.apply_fsdp(m, compute_dtype=torch.bfloat16, on_gpu=True))
        bf16.append(trainer_pass(model, mb))
    exact = float64_pass(untied, mb)
    report["bf16/fused-vs-float64"], report["bf16/logits-vs-float64"] = (compare(bf16[0], exact),
                                                                         compare(bf16[1], exact))
    print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
