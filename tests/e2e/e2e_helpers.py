"""The quickstart as a GRPOJob for a real cluster, and what the tests read back (with kubectl,
as a user would, and from the job's S3 prefix)."""

from __future__ import annotations

import copy
import json
import re
import secrets
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

import pytest

from polling import wait_until

from .node import Node

REPO = Path(__file__).resolve().parents[2]
S3_KEY, S3_SECRET, S3_BUCKET = "grpo-e2e", "grpo-e2e-secret-0123456789", "grpo-runs"

@dataclass
class Cluster:
    node: Node
    images: dict[str, str]
    kubectl_bin: str
    helm_bin: str
    s3_endpoint: str                        # as pods (and the host) reach it

    @property
    def kubeconfig(self) -> Path:
        return self.node.kubeconfig

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run([self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args], input=input,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode:
            raise AssertionError(f"kubectl {' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def helm(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        done = subprocess.run([self.helm_bin, "--kubeconfig", str(self.kubeconfig), *args],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise AssertionError(f"helm {' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def s3(self):
        import pyarrow.fs as pafs
        return pafs.S3FileSystem(access_key=S3_KEY, secret_key=S3_SECRET, region="us-east-1",
                                 endpoint_override=self.s3_endpoint.removeprefix("http://"), scheme="http")


def wait_for(what: str, check, timeout: float, interval: float = 2.0, diagnose=None):
    """Polls `check()` until it returns something truthy; fails with `what`, the last value and
    `diagnose()` (e.g. kubectl describe) after `timeout` seconds. The machine is loaded: every
    test waits for a state to converge, never asserts once on a race. An AssertionError from
    `check` (a kubectl that failed) counts as "not yet"; the last one is reported."""
    return wait_until(check, timeout, interval, what, retry_on=(AssertionError,), diagnose=diagnose)


MODELS_MOUNT = "/models"
MODEL = f"{MODELS_MOUNT}/tiny-qwen3"
DATA_PREFIX = f"{S3_BUCKET}/datasets/quickstart"
RUNS_URI = f"s3://{S3_BUCKET}/runs"
JOB_LABEL, ROLE_LABEL = "grpo.dev/job", "grpo.dev/role"


def grpo_cli() -> list[str]:
    return [str(Path(sys.executable).parent / "grpo")]


def make_assets(cluster: Cluster) -> Path:
    """The quickstart's tiny model in a host folder the pods mount (hostPath: what a model on a
    shared volume is on one node), and its dataset uploaded to S3."""
    models = cluster.node.dir / "models"
    model = models / "tiny-qwen3"
    if not (model / "config.json").exists():
        subprocess.run([*grpo_cli(), "model", "tiny", "--arch", "qwen3", "--out", str(model)], check=True,
                       capture_output=True, timeout=600)
        data = cluster.node.dir / "quickstart-data"
        subprocess.run([*grpo_cli(), "data", "quickstart", "--out", str(data)], check=True, capture_output=True,
                       timeout=600)
        fs = cluster.s3()
        for f in ("train.parquet", "test.parquet"):
            with fs.open_output_stream(f"{DATA_PREFIX}/{f}") as out:
                out.write((data / f).read_bytes())
    return models


def new_namespace(cluster: Cluster) -> str:
    """A namespace with the S3 credentials in a Secret, as a user sets them up."""
    ns = f"e2e-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("create", "secret", "generic", "s3-credentials", "-n", ns,
                    f"--from-literal=AWS_ACCESS_KEY_ID={S3_KEY}", f"--from-literal=AWS_SECRET_ACCESS_KEY={S3_SECRET}")
    return ns


def quickstart_job(name: str, cluster: Cluster, models: Path, *, steps: int, **trainer) -> dict:
    """examples/quickstart.yaml for the cluster: model from the mounted folder, data and run
    files in S3, `steps` steps (validation and checkpoints every 10)."""
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["metadata"] = {"name": name}
    spec = job["spec"]
    spec["model"]["path"] = MODEL
    spec["data"]["trainFiles"] = [f"s3://{DATA_PREFIX}/train.parquet"]
    spec["data"]["valFiles"] = [f"s3://{DATA_PREFIX}/test.parquet"]
    spec["trainer"].update({"totalSteps": steps, "testFreq": 10, "saveFreq": 10, **trainer})
    spec["storage"] = {"uri": RUNS_URI, "endpoint": cluster.s3_endpoint, "region": "us-east-1",
                       "secretRef": "s3-credentials"}
    template = {"spec": {
        "volumes": [{"name": "models", "hostPath": {"path": str(models), "type": "Directory"}}],
        "containers": [{"volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}]}]}}
    spec["trainer"]["template"] = copy.deepcopy(template)
    spec["rollout"]["template"] = copy.deepcopy(template)
    return job


def apply(cluster: Cluster, ns: str, job: dict) -> None:
    # JSON, not yaml.safe_dump: PyYAML writes the key `n` bare, which kubectl reads as false.
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(job))


def gj_row(cluster: Cluster, ns: str, name: str) -> dict[str, str]:
    """`kubectl get gj NAME` as a user reads it: {column: value}."""
    header, row = cluster.kubectl("get", "gj", name, "-n", ns).stdout.splitlines()[:2]
    # Columns are aligned; an unset one may print empty, so slice at the header's offsets.
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    bounds = zip(starts, [*starts[1:], None])
    return {header[a:b].strip(): (row[a:b].strip() if b else row[a:].strip()) or "<none>" for a, b in bounds}


def status(cluster: Cluster, ns: str, name: str) -> dict:
    return cluster.get("gj", name, "-n", ns).get("status") or {}


def run_path(cluster: Cluster, ns: str, name: str) -> str:
    """The job's run folder in the test bucket, `<bucket>/runs/<ns>/<name>/<uid>` (status.runUri:
    each object has its own run)."""
    obj = wait_for(f"{name}'s status.runUri", lambda: (o := cluster.get("gj", name, "-n", ns)).get("status", {})
                   .get("runUri") and o, timeout=120, interval=1)
    uri = obj["status"]["runUri"]
    assert uri == f"s3://{S3_BUCKET}/runs/{ns}/{name}/{obj['metadata']['uid']}", uri
    return uri[len("s3://"):]


def pods(cluster: Cluster, ns: str, name: str, role: str) -> list[dict]:
    return cluster.get("pods", "-n", ns, "-l", f"{JOB_LABEL}={name},{ROLE_LABEL}={role}")["items"]


def describe(cluster: Cluster, ns: str, name: str):
    def run() -> str:
        parts = [cluster.kubectl("get", "gj,jobs,deploy,pods", "-n", ns, "-o", "wide", check=False).stdout,
                 cluster.kubectl("describe", "gj", name, "-n", ns, check=False).stdout,
                 cluster.kubectl("describe", "pods", "-n", ns, check=False).stdout[-6000:]]
        for role in ("trainer", "rollout"):
            parts.append(cluster.kubectl("logs", "-n", ns, "-l", f"{JOB_LABEL}={name},{ROLE_LABEL}={role}",
                                         "--tail=40", "--prefix", check=False).stdout)
        return "\n".join(parts)
    return run


def wait_phase(cluster: Cluster, ns: str, name: str, phases: set[str], timeout: float) -> dict:
    def check():
        st = status(cluster, ns, name)
        if st.get("phase") == "Failed" and "Failed" not in phases:
            raise RuntimeError(f"{name} Failed: {json.dumps(st)[:2000]}")
        return st if st.get("phase") in phases else None
    try:
        return wait_for(f"{name} to be {phases}", check, timeout=timeout, diagnose=describe(cluster, ns, name))
    except RuntimeError as e:
        pytest.fail(f"{e}\n{describe(cluster, ns, name)()}", pytrace=False)


def metrics(cluster: Cluster, ns: str, name: str) -> list[dict]:
    fs = cluster.s3()
    with fs.open_input_stream(f"{run_path(cluster, ns, name)}/metrics.jsonl") as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]


def reward_ends(rows: list[dict], k: int = 5) -> tuple[float, float]:
    train = [r for r in rows if "critic/score/mean" in r]
    reward = [r["critic/score/mean"] for r in train]
    return statistics.fmean(reward[:k]), statistics.fmean(reward[-k:])
