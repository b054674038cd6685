"""Issue 33, LoRA (spec.model.lora) end to end on CPU: torchrun with 2 ranks (gloo), real `grpo
rollout` servers over gRPC, file:// storage, the tiny Qwen3 model.

- the reference model is the base with the adapters off: the KL loss is exactly 0 at step 1
  (B starts at zero: the policy is the base) and positive once the adapters moved;
- only the adapters train: every exported base weight the adapters don't touch is the base
  model's, bit for bit; the checkpoint holds the adapters alone;
- the rollout servers follow the policy: one takes adapters (the hf engine) and gets only them,
  its engine merging them into the base; the other, started with --no-lora-adapters as a vLLM
  server would be, gets the merged weights (W + alpha/r x B @ A, under the base model's names).
  Both end at the exported policy, and the merge is PEFT's own (merge_and_unload, an
  independent implementation);
- both exports load, the PEFT adapter on the base model and the merged model alone, at the end
  of the run and from `grpo export` of a checkpoint, and generate what the trained policy
  generates (greedy).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration_helpers import (RolloutServer, child_env, grpo_cli, load_safetensors, read_metrics, run_root,
                                 run_trainer, write_job)

pytestmark = pytest.mark.integration

STEPS = 3
LORA = {"rank": 8, "alpha": 16}
PROMPT = "copy the digit 7 then answer #### and the digit"


@dataclass
class Run:
    root: Path
    output: str
    servers: list[RolloutServer]     # [takes adapters, takes merged weights only], still serving
    token: str


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model, quickstart_data, dense_reward):
    tmp = tmp_path_factory.mktemp("lora")
    token = secrets.token_hex(16)
    job = write_job(tmp / "job.yaml", name="lora", model=tiny_model, train=quickstart_data[0],
                    storage=tmp / "store", reward={"function": dense_reward},
                    lora=LORA, algorithm={"klLossCoef": 0.01},
                    trainer={"totalSteps": STEPS, "saveFreq": 2, "lr": 2e-2},
                    weightSync={"backend": "nccl"})   # the collective path (gloo on CPU)
    metrics = ("--metrics-port", "0")
    servers = [RolloutServer(job, tmp / "rollout-0.log", token, "rollout-0", args=metrics, wait=False)]
    try:
        servers.append(RolloutServer(job, tmp / "rollout-1.log", token, "rollout-1",
                                     args=(*metrics, "--no-lora-adapters"), wait=False))
        for s in servers:      # started side by side
            s.wait_ready()
        result = run_trainer(job, rollout=",".join(s.address for s in servers), token=token)
        assert result.returncode == 0, result.output[-8000:]
        yield Run(run_root(tmp / "store", "lora"), result.output, servers, token)
    finally:
        for s in servers:
            s.stop()


def test_the_reference_is_the_base_model_with_the_adapters_off(lora_run):
    rows = read_metrics(lora_run.root)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    kl = [r["actor/kl_loss"] for r in rows]
    assert kl[0] == 0.0, kl                  # B = 0: the policy is the base, its KL to it nothing
    assert all(k > 0 for k in kl[1:]), kl    # a reference that moved with the policy would stay 0
    assert all(r["actor/grad_norm"] > 0 for r in rows)


def test_only_the_adapters_train(lora_run, tiny_model):
    import torch
    base = load_safetensors(tiny_model)
    final = load_safetensors(lora_run.root / "hf" / f"step-{STEPS}")
    adapted = {n for n in final if n.endswith("_proj.weight")}   # all-linear: attention and MLP projections
    assert adapted and set(final) <= set(base) | {"lm_head.weight"}
    for name in final:
        if name in adapted:
            assert not torch.equal(final[name], base[name]), name
        elif name in base:
            assert torch.equal(final[name], base[name]), name        # embeddings, norms: frozen
    # The checkpoint: adapters (and their optimizer state) only, no base weight.
    ckpt = lora_run.root / "checkpoints" / "step-2"
    names = json.loads((ckpt / "trainer_state.json").read_text())["trainer"]["lora_config"]
    assert names["r"] == 8 and names["lora_alpha"] == 16
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata   # our own file: its pickle is ours
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    optimizer_params = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
    assert optimizer_params == {k.removeprefix("model.") for k in model_keys}, sorted(optimizer_params)[:5]


def _metric(server: RolloutServer, name: str, **labels) -> float:
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.info['metrics_port']}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def _greedy_on_server(server: RolloutServer, prompt_ids: list[int], tmp_path: Path) -> tuple[list[int], list[float]]:
    import pyarrow as pa

    from grpo_api.proto import rollout_pb2 as pb
    from grpo_api.records import PROMPT_SCHEMA
    from grpo_api.storage import Storage
    storage, tag = Storage(), server.worker_id
    row = {"uid": "0-0", "prompt_index": 0, "prompt_ids": prompt_ids, "data_source": "openai/gsm8k",
           "ground_truth": "7", "extra_info": "{}", "raw_prompt": None}
    storage.write_table(f"file://{tmp_path}/p-{tag}.parquet",
                        pa.Table.from_pylist([row], schema=PROMPT_SCHEMA))
    reply = server.stub().Generate(pb.GenerateRequest(
        prompt_uri=f"file://{tmp_path}/p-{tag}.parquet", output_uri=f"file://{tmp_path}/r-{tag}.parquet",
        expected_policy_version=STEPS, sampling=pb.SamplingParams(n=1, max_tokens=6, temperature=0.0)), timeout=60)
    table = storage.read_table(reply.rollout_uri)
    return table.column("response_ids").to_pylist()[0], table.column("response_logprobs").to_pylist()[0]


def test_an_adapter_server_gets_only_the_adapters_a_merged_server_the_weights_and_both_hold_the_policy(
        lora_run, tiny_model, tmp_path):
    """Server 0 (hf) takes adapters: each of its syncs is the adapters' bytes (the tensors of
    the exported PEFT adapter, float32), and its engine merges them into the base. Server 1
    (--no-lora-adapters, what vLLM reports) gets the merged model every sync. Both generate what
    the exported policy generates, with its log-probs; the base model's differ."""
    from safetensors import safe_open

    from grpo_rollout.engine import SamplingParams
    from grpo_rollout.hf_engine import HFEngine
    adapter_server, merged_server = lora_run.servers
    assert [s.rpc_info().accepts_lora_adapters for s in lora_run.servers] == [True, False]
    final = lora_run.root / "hf" / f"step-{STEPS}"
    with safe_open(final / "lora_adapter" / "adapter_model.safetensors", "pt") as f:
        adapter = [f.get_slice(k).get_shape() for k in f.keys()]
    adapter_bytes = sum(4 * a * b for a, b in adapter)
    exported = load_safetensors(final)
    model_bytes = sum(t.numel() * 4 for t in exported.values())
    syncs = STEPS   # one per update; the servers started at the initial weights, version 0
    for server, nbytes, tensors in ((adapter_server, adapter_bytes, len(adapter)),
                                    (merged_server, model_bytes, len(exported))):
        assert _metric(server, "grpo_rollout_weight_sync_seconds_count", backend="collective") == syncs
        per_sync = _metric(server, "grpo_rollout_weight_sync_bytes_total", backend="collective") / syncs
        assert nbytes <= per_sync < nbytes + 64 * tensors, (server.worker_id, per_sync, nbytes)   # + alignment
    assert adapter_bytes < model_bytes / 3

    policy = HFEngine(final)
    prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                  tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    [[expected]] = policy.generate([prompt], SamplingParams(n=1, max_tokens=6, temperature=0.0))
    [[base]] = HFEngine(tiny_model).generate([prompt], SamplingParams(n=1, max_tokens=6, temperature=0.0))
    for server in lora_run.servers:
        assert server.health().policy_version == STEPS
        tokens, logprobs = _greedy_on_server(server, prompt, tmp_path)
        assert tokens == expected.token_ids, server.worker_id
        assert logprobs == pytest.approx(expected.logprobs, abs=1e-6), server.worker_id
    assert base.token_ids != expected.token_ids or base.logprobs != pytest.approx(expected.logprobs, abs=1e-4)


def _generate(model) -> list[int]:
    import torch
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.eval().generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def _merged_and_adapter(folder: Path, tiny_model: Path):
    """(the merged model alone, PEFT's adapter on the base model) of one export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(folder)
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder / "lora_adapter")
    on_base.name_or_path = str(folder)   # the tokenizer (the same) from the export
    return merged, on_base


def _check_export(folder: Path, tiny_model: Path, trained: dict) -> list[int]:
    import torch
    merged, on_base = _merged_and_adapter(folder, tiny_model)
    config = json.loads((folder / "lora_adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    # PEFT's own merge of the adapter == the trainer's (what the rollout servers received)
    peft_merged = on_base.merge_and_unload().state_dict()
    for name, weight in merged.state_dict().items():
        torch.testing.assert_close(peft_merged[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(trained[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    merged2, on_base2 = _merged_and_adapter(folder, tiny_model)
    tokens = _generate(merged2)
    assert 1 <= len(tokens) <= 6 and _generate(on_base2) == tokens
    return tokens


def test_both_exports_load_and_generate_what_the_trained_policy_generates(lora_run, tiny_model, tmp_path):
    """The run's final export; and `grpo export` of the last checkpoint (step 3, the final one:
    the same policy, merged from the checkpoint's adapters onto the base here)."""
    from transformers import AutoModelForCausalLM
    final = lora_run.root / "hf" / f"step-{STEPS}"
    trained = load_safetensors(final)        # the publisher's merged weights, as the servers have them
    trained.setdefault("lm_head.weight", trained["model.embed_tokens.weight"])
    tokens = _check_export(final, tiny_model, trained)
    out = tmp_path / "exported"
    proc = subprocess.run([*grpo_cli(), "export", str(lora_run.root / "checkpoints" / f"step-{STEPS}"), "--out",
                           str(out)], capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _check_export(out, tiny_model, trained) == tokens
    # and the policy moved: the base model generates something else or scores it otherwise
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any(not (a == b).all() for a, b in zip(base.state_dict().values(),
                                                 AutoModelForCausalLM.from_pretrained(out).state_dict().values()))


MIXED_PRECISION_CHECK = r"""
import sys, torch, torch.distributed as dist
from grpo_api.spec import ModelSpec
from grpo_trainer import model as M
from grpo_trainer.lora import adapters_off, add_adapters
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
spec = ModelSpec.model_validate({"path": sys.argv[1], "lora": {"rank": 4, "alpha": 8}})
model = M._load_sharded(spec, torch.device("cpu"), dtype=torch.bfloat16, prepare=lambda m: None,
                        wrap=lambda m: add_adapters(m, spec),
                        shard=lambda m: M.apply_fsdp(m, compute_dtype=torch.bfloat16, on_gpu=True))
ids = torch.randint(0, 20, (2, 12))
with torch.no_grad(), adapters_off(model):
    frozen = [n for n, p in model.named_parameters() if ".lora_" in n and not p.requires_grad]
    model(input_ids=ids)
torch.log_softmax(model(input_ids=ids).logits.float(), -1).mean().backward()
grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
adapters = [n for n, p in model.named_parameters() if ".lora_" in n]
b_moved = [n for n, g in grads.items() if ".lora_B." in n and g.full_tensor().abs().sum() > 0]  # A's are 0 while B is
print("frozen-in-reference", len(frozen), "grads", len(grads), "of", len(adapters),
      sorted({str(g.dtype) for g in grads.values()}), "B-moved", len(b_moved))
"""


def test_under_mixed_precision_the_reference_first_leaves_the_adapters_training(tiny_model):
    """The GPU set-up on CPU: bf16 base, float32 adapters, FSDP2 mixed precision (bf16 compute,
    float32 reduce), and the reference's forward first, as in an on-policy step. The adapters
    stay trainable inside the reference (PEFT's disable_adapter() froze them there, and torch
    2.11's FSDP2, which reads that at its first forward, then failed the backward: bench/
    lora_fsdp_check.py reproduces it), and every adapter gets a float32 gradient."""
    out = subprocess.run([sys.executable, "-c", MIXED_PRECISION_CHECK, str(tiny_model)], capture_output=True, text=True,
                         env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    line = out.stdout.strip().splitlines()[-1].split()
    assert line[:2] == ["frozen-in-reference", "0"], out.stdout
    grads, adapters, dtypes, b_moved = int(line[3]), int(line[5]), line[6], int(line[-1])
    assert grads == adapters > 0 and dtypes == "['torch.float32']" and b_moved == adapters // 2, out.stdout
