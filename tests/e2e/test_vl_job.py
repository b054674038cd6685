"""A vision-language GRPOJob on the real node (issue 45): the tiny random Qwen2.5-VL from a mounted
folder, the colours dataset (each prompt's image in verl's `images` column) in S3, trained by the
trainer pod and generated for by the rollout pod's hf engine, from the images the Dockerfiles
build, with verl's geo3k LoRA settings (adapters on every linear layer but the vision tower's,
the KL loss against the model with its adapters off; the rollout pod's hf engine takes the adapters
at each sync). Its CPU runs (learning against lr=0, full-parameter and LoRA, the float64 log-prob
checks) are tests/integration and tests/unit; here what a user on Kubernetes sees: the job
succeeds, each distinct image is stored once in the run's S3 folder and every prompt and rollout
record names it there, and the export is a VL model with its image processor and its PEFT adapter."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from .e2e_helpers import (MODELS_MOUNT, S3_BUCKET, apply, describe, grpo_cli, make_assets, metrics, new_namespace,
                          quickstart_job, run_path, status, wait_for, wait_phase)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STEPS = 3
DATA = f"{S3_BUCKET}/datasets/colours"


def _vl_assets(cluster, models) -> None:
    """The tiny VL model beside the quickstart's (hostPath), the colours data in S3."""
    model = models / "tiny-qwen2.5-vl"
    if (model / "config.json").exists():
        return
    subprocess.run([*grpo_cli(), "model", "tiny", "--arch", "qwen2.5-vl", "--out", str(model)], check=True,
                   capture_output=True, timeout=600)
    data = cluster.node.dir / "colours-data"
    subprocess.run([*grpo_cli(), "data", "colours", "--out", str(data)], check=True, capture_output=True,
                   timeout=600)
    fs = cluster.s3()
    with fs.open_output_stream(f"{DATA}/train.parquet") as out:
        out.write((data / "train.parquet").read_bytes())


def _records(fs, root: str, kind: str) -> list[list[str]]:
    """The `images` column of every `kind` (prompts, rollouts) shard of the run."""
    found = []
    for f in fs.get_file_info(pafs.FileSelector(f"{root}/{kind}", recursive=True)):
        if f.path.endswith(".parquet"):
            found += pq.read_table(f.path, filesystem=fs, columns=["images"])["images"].to_pylist()
    return found


def test_a_vision_language_job_trains_on_images_stored_once_in_s3(cluster, operator):
    models = make_assets(cluster)
    _vl_assets(cluster, models)
    ns, name = new_namespace(cluster), "vl"
    job = quickstart_job(name, cluster, models, steps=STEPS, testFreq=-1, valBeforeTrain=False, saveFreq=STEPS,
                         miniBatchSize=32, microBatchSizePerGPU=256, lr=1e-2)
    spec = job["spec"]
    spec["model"].update({"path": f"{MODELS_MOUNT}/tiny-qwen2.5-vl", "dtype": "float32",
                          "gradientCheckpointing": False,
                          "lora": {"rank": 8, "alpha": 16, "excludeModules": ".*visual.*"}})
    spec["data"] = {"trainFiles": [f"s3://{DATA}/train.parquet"], "imageKey": "images", "trainBatchSize": 32,
                    "maxPromptLength": 32, "maxResponseLength": 2}
    spec["algorithm"] = {"advEstimator": "grpo", "useKLLoss": True, "klLossCoef": 0.001}
    spec["rollout"].update({"engine": "hf", "n": 8, "replicas": 1, "temperature": 1.0})
    apply(cluster, ns, job)
    wait_for("the VL job to finish", lambda: status(cluster, ns, name).get("phase") in ("Succeeded", "Failed"),
             timeout=1200, interval=3, diagnose=describe(cluster, ns, name))
    assert wait_phase(cluster, ns, name, {"Succeeded"}, timeout=60)["progress"]["step"] == STEPS
    assert [r["step"] for r in metrics(cluster, ns, name) if "critic/score/mean" in r] == list(range(1, STEPS + 1))

    fs, root = cluster.s3(), run_path(cluster, ns, name)
    stored = {}
    for f in fs.get_file_info(pafs.FileSelector(f"{root}/images")):
        with fs.open_input_stream(f.path) as data:
            stored[f.base_name] = data.read()
    assert len(stored) == 4                   # the four colours' PNGs, whatever the rows: stored once each
    assert all(hashlib.sha256(png).hexdigest() == digest for digest, png in stored.items())
    for kind in ("prompts", "rollouts"):
        named = _records(fs, root, kind)
        assert named and all(len(images) == 1 for images in named), kind
        assert {uri.rsplit("/", 1)[1] for images in named for uri in images} <= set(stored)
        assert all(uri.startswith(f"s3://{root}/images/") for images in named for uri in images), named[:2]

    export = f"{root}/hf/step-{STEPS}"
    with fs.open_input_stream(f"{export}/config.json") as f:
        assert json.loads(f.read())["model_type"] == "qwen2_5_vl"
    for name in ("preprocessor_config.json", "lora_adapter/adapter_config.json", "lora_adapter/adapter_model.safetensors"):
        assert fs.get_file_info(f"{export}/{name}").type == pafs.FileType.File, name
    with fs.open_input_stream(f"{export}/lora_adapter/adapter_config.json") as f:
        assert json.loads(f.read())["exclude_modules"] == ".*visual.*"
