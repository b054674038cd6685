"""Jobs for the operator's tests (unit and control plane)."""

from __future__ import annotations

import copy
from typing import Any

from grpo_api.jobfile import parse_job
from grpo_api.spec import GRPOJob

GROUP, VERSION, PLURAL = "grpo.dev", "v1alpha1", "grpojobs"
UID = "0b1c2d3e-0000-4000-8000-000000000001"

SPEC: dict[str, Any] = {
    "model": {"path": "Qwen/Qwen3-8B"},
    "data": {"trainFiles": ["s3://datasets/gsm8k/train.parquet"], "trainBatchSize": 128},
    "rollout": {"engine": "vllm", "n": 5, "replicas": 2, "tensorParallelSize": 2},
    "trainer": {"nnodes": 2, "nprocPerNode": 4, "miniBatchSize": 32, "microBatchSizePerGPU": 4},
    "storage": {"uri": "s3://grpo-runs/team-a", "secretRef": "s3-credentials"},
}


def body(name: str = "demo", namespace: str = "team-a", **spec_changes: Any) -> dict[str, Any]:
    """A GRPOJob API object; spec_changes are dotted paths, e.g. **{"trainer.nnodes": 1}."""
    spec = copy.deepcopy(SPEC)
    for path, value in spec_changes.items():
        node = spec
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GRPOJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def job(name: str = "demo", namespace: str = "team-a", **spec_changes: Any) -> GRPOJob:
    """The parsed job, with a uid as if it came from the API server."""
    doc = body(name, namespace, **spec_changes)
    doc["metadata"]["uid"] = UID
    return parse_job(doc)
