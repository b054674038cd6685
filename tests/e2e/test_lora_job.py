"""A LoRA GRPOJob (spec.model.lora) on the real node, from the images the Dockerfiles build: the
adapters train (the KL to the adapters-off reference starts at 0 and grows), the checkpoints in
S3 are the adapters alone, and the final export is the merged model with its PEFT adapter folder.
Cheap: the quickstart's task, a few steps."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from .e2e_helpers import (run_path, apply, describe, make_assets, metrics, new_namespace, quickstart_job, status,
                          wait_for, wait_phase)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STEPS = 6


def test_a_lora_job_trains_its_adapters_and_exports_them(cluster, operator):
    models = make_assets(cluster)
    ns, name = new_namespace(cluster), "lora"
    job = quickstart_job(name, cluster, models, steps=STEPS, saveFreq=3, lr=2e-2)
    job["spec"]["model"]["lora"] = {"rank": 16, "alpha": 32}
    job["spec"]["algorithm"].update({"useKLLoss": True, "klLossCoef": 0.001})
    apply(cluster, ns, job)
    wait_for("the LoRA job to finish", lambda: status(cluster, ns, name).get("phase") in ("Succeeded", "Failed"),
             timeout=1200, interval=3, diagnose=describe(cluster, ns, name))
    assert wait_phase(cluster, ns, name, {"Succeeded"}, timeout=60)["progress"]["step"] == STEPS

    rows = [r for r in metrics(cluster, ns, name) if "training/step" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    kl = [r["actor/kl_loss"] for r in rows]
    assert kl[0] == 0.0 and kl[-1] > 0, kl          # the reference: the base, adapters off

    fs, run = cluster.s3(), run_path(cluster, ns, name)
    state = json.loads(fs.open_input_stream(f"{run}/checkpoints/step-{STEPS}/trainer_state.json").read())
    assert state["lora_config"]["r"] == 16
    final = f"{run}/hf/step-{STEPS}"
    for f in ("config.json", "model.safetensors", "lora_adapter/adapter_config.json",
              "lora_adapter/adapter_model.safetensors"):
        assert fs.get_file_info(f"{final}/{f}").type == pafs.FileType.File, f
    adapter = json.loads(fs.open_input_stream(f"{final}/lora_adapter/adapter_config.json").read())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 16 and adapter["lora_alpha"] == 32
