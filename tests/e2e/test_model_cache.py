"""spec.model.cache on a real node: a model that lives in S3, a PersistentVolumeClaim as the cache.
Every trainer and rollout pod runs the `model` init container (`grpo model fetch`) from the
images the Dockerfiles build; the model lands in the volume once; the pods load it from there,
read-only, and the job trains to the end."""

from __future__ import annotations

import json
import os

import pytest

from .e2e_helpers import (S3_BUCKET, apply, describe, make_assets, new_namespace, pods, quickstart_job, wait_for,
                          wait_phase)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

MODEL_PREFIX = f"{S3_BUCKET}/models/tiny-qwen3"


def _upload_model(cluster, folder) -> str:
    fs = cluster.s3()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            with fs.open_output_stream(f"{MODEL_PREFIX}/{f.relative_to(folder)}") as out:
                out.write(f.read_bytes())
    return f"s3://{MODEL_PREFIX}"


def _cache_volume(cluster, ns: str, folder) -> None:
    """A statically provisioned volume (a host folder: the node has no provisioner) bound to the
    claim `models`, as an admin sets up shared storage. Pods run as uid 1000, which a hostPath
    volume does not chown for them."""
    folder.mkdir()
    os.chmod(folder, 0o777)
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"models-{ns}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                   "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "Directory"},
                   "claimRef": {"namespace": ns, "name": "models"}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": ns},
           "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"models-{ns}",
                    "resources": {"requests": {"storage": "1Gi"}}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]}))


def _init_logs(cluster, ns: str, pod: dict) -> str | None:
    """The `model` init container's log once it finished with exit 0."""
    for s in pod["status"].get("initContainerStatuses", []):
        done = s["state"].get("terminated") or (s.get("lastState") or {}).get("terminated")
        if s["name"] == "model" and done and done["exitCode"] == 0:
            return cluster.kubectl("logs", "-n", ns, pod["metadata"]["name"], "-c", "model").stdout
    return None


STEPS = 4


def test_a_model_in_s3_is_fetched_once_into_the_claim_and_trains(cluster, operator):
    models = make_assets(cluster)
    source = _upload_model(cluster, models / "tiny-qwen3")
    ns = new_namespace(cluster)
    cache = cluster.node.dir / f"model-cache-{ns}"
    _cache_volume(cluster, ns, cache)
    name = "cached"
    # Steps enough that the rollout pod (scaled away at the end) is seen with its init log.
    job = quickstart_job(name, cluster, models, steps=STEPS)
    job["spec"]["model"].update(path=source, cache={"claimName": "models"})
    for role in ("trainer", "rollout"):
        job["spec"][role].pop("template")          # no host folder of models: only the claim
    apply(cluster, ns, job)
    fetch_logs: dict[str, str] = {}

    def done():
        for role in ("trainer", "rollout"):
            for pod in pods(cluster, ns, name, role):
                if role not in fetch_logs and (log := _init_logs(cluster, ns, pod)):
                    fetch_logs[role] = log
        phase = (cluster.get("gj", name, "-n", ns).get("status") or {}).get("phase")
        return phase in ("Succeeded", "Failed")
    wait_for("the job to finish", done, timeout=1200, interval=2, diagnose=describe(cluster, ns, name))
    status = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=60)
    assert status["progress"]["step"] == STEPS

    # both kinds of pod ran the fetch; between them it copied the model once
    assert set(fetch_logs) == {"trainer", "rollout"}, fetch_logs
    logs = "".join(fetch_logs.values())
    assert logs.count(f"{source}: copied ") == 1 and f"{source}: cached in /model-cache/" in logs, fetch_logs
    # the volume holds the model, byte for byte, and nothing half-written
    (folder,) = [p for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert folder.name.startswith("tiny-qwen3-")
    source_files = {str(f.relative_to(models / "tiny-qwen3")): f.read_bytes()
                    for f in (models / "tiny-qwen3").rglob("*") if f.is_file()}
    assert {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()} == source_files
