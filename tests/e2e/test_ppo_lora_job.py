"""A PPO GRPOJob (advEstimator gae: a critic trained beside the policy) whose policy trains LoRA
adapters (spec.model.lora), with trainer.saveBest, on the real node, from the images the
Dockerfiles build: what kubectl shows and what the run leaves in S3. One job for both families
(each costs minutes of the suite here; their CPU runs are tests/integration). Cheap: the
quickstart's task, a few steps.

- PPO: the critic trains (its loss, lr, values in every step) and is part of the checkpoint; the
  best validation step is the status' bestStep and `kubectl get gj -o wide`'s BEST-STEP, and its
  checkpoint outlives keepCheckpoints, exported as hf/best.
- LoRA: the adapters train (the KL to the adapters-off reference starts at 0 and grows), the
  checkpoints are the adapters alone, and the final export is the merged model with its PEFT
  adapter folder.
- model.sharePrompts: the policy, the reference and the critic run on rows that hold each
  prompt once, from the trainer image."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from .e2e_helpers import (run_path, apply, describe, make_assets, metrics, new_namespace, quickstart_job, status,
                          wait_for, wait_phase)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STEPS = 8


def test_a_ppo_job_with_lora_trains_critic_and_adapters_and_keeps_the_best_checkpoint(cluster, operator):
    models = make_assets(cluster)
    ns, name = new_namespace(cluster), "ppo-lora"
    job = quickstart_job(name, cluster, models, steps=STEPS, testFreq=2, saveFreq=4, keepCheckpoints=1,
                         saveBest={"metric": "val/score"}, lr=2e-2)
    job["spec"]["algorithm"].update({"advEstimator": "gae", "lam": 0.95, "useKLLoss": True, "klLossCoef": 0.001})
    job["spec"]["critic"] = {"lr": 2e-3}
    job["spec"]["model"]["lora"] = {"rank": 16, "alpha": 32}
    job["spec"]["model"]["sharePrompts"] = True     # the policy, reference and critic on shared-prompt rows
    apply(cluster, ns, job)
    wait_for("the PPO + LoRA job to finish", lambda: status(cluster, ns, name).get("phase") in ("Succeeded", "Failed"),
             timeout=1200, interval=3, diagnose=describe(cluster, ns, name))
    progress = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=60)["progress"]
    assert progress["step"] == STEPS

    rows = [r for r in metrics(cluster, ns, name) if "training/step" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["critic/vf_loss"] >= 0 and r["critic/lr"] == 2e-3 and "critic/values/mean" in r for r in rows)
    assert all(r["perf/layer_tokens"] < r["perf/total_num_tokens"] for r in rows)     # sharePrompts ran
    kl = [r["actor/kl_loss"] for r in rows]
    assert kl[0] == 0.0 and kl[-1] > 0, kl          # the reference: the base, adapters off
    # the best validation step so far, as the status and `kubectl get gj -o wide` show it
    scores = {r["step"]: r["val/score"] for r in rows if r.get("val/score") is not None}
    best = min(s for s, v in scores.items() if v == max(scores.values()))
    # (the status rounds scores to 4 significant digits: grpo_operator.progress.SCORE_DIGITS)
    assert (progress["bestStep"], progress["bestScore"]) == (best, pytest.approx(scores[best], rel=1e-3))
    wide = cluster.kubectl("get", "gj", name, "-n", ns, "-o", "wide").stdout.splitlines()
    header, row = wide[0].split(), wide[1].split()
    assert row[header.index("BEST-STEP")] == str(best)

    # in S3: the last checkpoint and the best one (whatever keepCheckpoints says), and hf/best
    fs, run = cluster.s3(), run_path(cluster, ns, name)
    kept = {info.base_name for info in fs.get_file_info(pafs.FileSelector(f"{run}/checkpoints"))}
    assert kept == {f"step-{best}", f"step-{STEPS}"}, kept
    assert fs.get_file_info(f"{run}/hf/best/config.json").type == pafs.FileType.File
    state = fs.open_input_stream(f"{run}/checkpoints/step-{STEPS}/trainer_state.json").read().decode()
    assert "critic" in json.loads(state)["checkpointer"]["schedulers"]     # the critic is part of the checkpoint
    assert json.loads(state)["trainer"]["lora_config"]["r"] == 16
    final = f"{run}/hf/step-{STEPS}"
    for f in ("config.json", "model.safetensors", "lora_adapter/adapter_config.json",
              "lora_adapter/adapter_model.safetensors"):
        assert fs.get_file_info(f"{final}/{f}").type == pafs.FileType.File, f
    adapter = json.loads(fs.open_input_stream(f"{final}/lora_adapter/adapter_config.json").read())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 16 and adapter["lora_alpha"] == 32
