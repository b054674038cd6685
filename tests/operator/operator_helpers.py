"""Jobs and polling helpers for the operator's tests (unit and control plane)."""

from __future__ import annotations

import copy
import json
import secrets
import subprocess
from typing import Any

from grpo_api.jobfile import parse_job
from grpo_api.spec import GRPOJob
from polling import wait_until
from ports import free_port

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


def kubectl(kubectl_bin, cp, *args, stdin: str | None = None, check=True):
    return subprocess.run([kubectl_bin, "--kubeconfig", str(cp.kubeconfig), *args], input=stdin,
                          capture_output=True, text=True, check=check, timeout=120)


def eventually(check, timeout=30.0, interval=0.2, what="condition"):
    """Polls check() until it returns something truthy (polling.wait_until)."""
    return wait_until(check, timeout, interval, what)


def wait_for_garbage_collector(cp, kubectl_bin) -> None:
    """The garbage collector learns about a new CRD at its next discovery sync (every 30 s in
    kube-controller-manager); until then children of a deleted GRPOJob stay. A real cluster has
    had the CRD for long; here, delete a probe owner until its dependent goes."""
    ns = f"gc-probe-{secrets.token_hex(3)}"
    kubectl(kubectl_bin, cp, "create", "namespace", ns)
    owner = json.loads(kubectl(kubectl_bin, cp, "-n", ns, "create", "-o", "json", "-f", "-", stdin=json.dumps({
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "probe"},
        "spec": {"model": {"path": "m"}, "data": {"trainFiles": ["t"]}, "storage": {"uri": "s3://b/p"}}})).stdout)
    kubectl(kubectl_bin, cp, "-n", ns, "create", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dependent", "ownerReferences": [{
            "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "name": "probe", "uid": owner["metadata"]["uid"]}]}}))
    kubectl(kubectl_bin, cp, "-n", ns, "delete", "grpojob", "probe")
    eventually(lambda: kubectl(kubectl_bin, cp, "-n", ns, "get", "configmap", "dependent", check=False).returncode,
               timeout=90, interval=1, what="the garbage collector to know GRPOJobs")
    kubectl(kubectl_bin, cp, "delete", "namespace", ns, "--wait=false")
