"""A GRPOJob with multi-turn tool rollouts and a reward model (issues 31 and 32) on the real node,
from the images the Dockerfiles build: the rollout pods run the agent loop (the lookup task's
`lookup` tool, grpo_rollout.tool_task, and the built-in `python`, whose programs run in the job's
sandbox pod: its own Deployment, Service and deny-all-egress NetworkPolicy), the operator serves
the reward model (a tiny classifier) as its own Deployment and Service, the rollout pods score
every trajectory with it over gRPC, and its score is added to the rule's (combine: sum). One job
for all: a job each would double the suite's slowest kind of test.

The node's network plugin (CNI bridge) does not enforce NetworkPolicy: the test checks the policy
the operator writes, not that the sandbox pod is cut off."""

from __future__ import annotations

import json
import re
import subprocess

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from .conftest import OPERATOR_NAMESPACE
from .e2e_helpers import (MODELS_MOUNT, S3_BUCKET, apply, describe, make_assets, metrics, new_namespace,
                          quickstart_job, run_path, status, wait_for, wait_phase)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STEPS = 4
LOOKUP_DATA = f"{S3_BUCKET}/datasets/lookup"
RM_WEIGHT = 0.5


def _lookup_assets(cluster, models):
    """The lookup task's model and the tiny reward model in the mounted folder, its data in S3."""
    from grpo_rollout import tiny, tool_task
    if not (models / "lookup-python" / "config.json").exists():
        tool_task.build_model(models / "lookup-python", calls=(tool_task.CALL_TOKEN, tool_task.PYTHON_CALL_TOKEN))
        data = cluster.node.dir / "lookup-data"
        tool_task.write_dataset(data, n_train=256, n_val=16)
        fs = cluster.s3()
        for f in ("train.parquet", "test.parquet"):
            with fs.open_output_stream(f"{LOOKUP_DATA}/{f}") as out:
                out.write((data / f).read_bytes())
    if not (models / "tiny-rm" / "config.json").exists():
        tiny.build_tiny_reward_model(models / "tiny-rm")
        for f in (models / "tiny-rm").rglob("*"):
            f.chmod(f.stat().st_mode | 0o044)


def _accepted_rollouts(fs, run: str, step: int) -> pa.Table:
    """Step `step`'s rollout shards (every attempt's file; a job without faults has one each)."""
    infos = fs.get_file_info(pafs.FileSelector(f"{run}/rollouts/step-{step}"))
    tables = [pq.read_table(fs.open_input_file(i.path)) for i in infos if i.path.endswith(".parquet")
              and "/train-" in i.path]
    return pa.concat_tables(tables)


def test_a_job_with_tools_and_a_reward_model_runs_both_in_its_pods(cluster, operator):
    models = make_assets(cluster)
    _lookup_assets(cluster, models)
    ns, name = new_namespace(cluster), "agent-rm"
    job = quickstart_job(name, cluster, models, steps=STEPS, saveFreq=10)
    spec = job["spec"]
    spec["model"]["path"] = f"{MODELS_MOUNT}/lookup-python"
    spec["data"].update({"trainFiles": [f"s3://{LOOKUP_DATA}/train.parquet"],
                         "valFiles": [f"s3://{LOOKUP_DATA}/test.parquet"],
                         "trainBatchSize": 16, "maxPromptLength": 24, "maxResponseLength": 14})
    spec["trainer"].update({"miniBatchSize": 16, "microBatchSizePerGPU": 128, "valBeforeTrain": False})
    spec["rollout"]["multiTurn"] = {"enable": True, "tools": ["grpo_rollout.tool_task:lookup", "python"],
                                    "maxAssistantTurns": 3}
    spec["reward"] = {
        "function": "grpo_rollout.tool_task:compute_score", "combine": "sum",
        "rewardModels": [{"name": "rm", "kind": "classifier", "path": f"{MODELS_MOUNT}/tiny-rm", "dtype": "float32",
                          "gpus": 0, "weight": RM_WEIGHT, "template": spec["rollout"]["template"]}]}
    apply(cluster, ns, job)

    # The reward model is its own Deployment and Service, ready before the job trains on it.
    wait_for("the reward model's ready pod", lambda: (cluster.get("deployment", f"{name}-rm-rm", "-n", ns)
                                                      .get("status") or {}).get("readyReplicas"),
             timeout=600, interval=3, diagnose=describe(cluster, ns, name))
    assert cluster.get("service", f"{name}-rm-rm", "-n", ns)["spec"]["clusterIP"] == "None"   # headless
    # So is the python tool's sandbox (one replica by default on Kubernetes), cut off by its policy.
    wait_for("the sandbox's ready pod", lambda: (cluster.get("deployment", f"{name}-sandbox", "-n", ns)
                                                 .get("status") or {}).get("readyReplicas"),
             timeout=600, interval=3, diagnose=describe(cluster, ns, name))
    policy = cluster.get("networkpolicy", f"{name}-sandbox", "-n", ns)["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and not policy.get("egress"), policy
    # The rollout pods' python programs run there (its log goes with the pod, which has no storage
    # credentials to keep it: read it while the job trains).
    wait_for("a program run in the sandbox pod", lambda: ": ok in " in cluster.kubectl(
        "logs", "-n", ns, f"deployment/{name}-sandbox", check=False).stdout,
             timeout=900, interval=3, diagnose=describe(cluster, ns, name))
    # While it runs, `helm uninstall` is refused by the chart's pre-delete hook (issue 36): the
    # release stays, and the hook's log names the job.
    refused = subprocess.run([cluster.helm_bin, "--kubeconfig", str(cluster.kubeconfig), "uninstall", "grpo",
                              "-n", OPERATOR_NAMESPACE, "--timeout", "180s"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "uninstall-check failed" in refused.stderr, refused.stdout + refused.stderr
    hook_log = cluster.kubectl("logs", "-n", OPERATOR_NAMESPACE, "job/grpo-grpo-operator-uninstall-check").stdout
    assert f"{ns}/{name} (" in hook_log and "refusing to uninstall" in hook_log, hook_log
    # Helm marks a release whose pre-delete hook failed `uninstalling` (its objects are all there);
    # `helm rollback` to its revision makes it `deployed` again, so `helm upgrade` works (NOTES.txt).
    release = cluster.helm("status", "grpo", "-n", OPERATOR_NAMESPACE).stdout
    revision = re.search(r"^REVISION: (\d+)$", release, re.M).group(1)
    cluster.helm("rollback", "grpo", revision, "-n", OPERATOR_NAMESPACE, "--wait", "--timeout", "180s")
    assert "STATUS: deployed" in cluster.helm("status", "grpo", "-n", OPERATOR_NAMESPACE).stdout
    wait_for("the job to finish", lambda: status(cluster, ns, name).get("phase") in ("Succeeded", "Failed"),
             timeout=1200, interval=3, diagnose=describe(cluster, ns, name))
    assert wait_phase(cluster, ns, name, {"Succeeded"}, timeout=60)["progress"]["step"] == STEPS
    rows = [r for r in metrics(cluster, ns, name) if "training/step" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    fs, run = cluster.s3(), run_path(cluster, ns, name)
    samples = _accepted_rollouts(fs, run, STEPS).to_pylist()
    assert len(samples) == 16 * 8
    # the agent loop ran in the rollout pods: trajectories with the tool's turn, masked out
    called = [s for s in samples if s["num_turns"] > 1]
    assert called, "no trajectory called the tool"
    for s in called:
        calls = json.loads(s["agent"])["tool_calls"]
        assert calls and all(c["name"] in ("lookup", "python") and not c["error"] for c in calls), calls
        assert 0 in s["response_mask"] and len(s["response_mask"]) == len(s["response_ids"])
    assert any(c["name"] == "python" for step in range(1, STEPS + 1) for s in _accepted_rollouts(fs, run, step)
               .to_pylist() for c in json.loads(s["agent"])["tool_calls"]), "no trajectory called python"
    # every sample was scored by the reward model's pod and its score added to the rule's
    for s in samples:
        extra = json.loads(s["reward_extra"])
        assert "rm/rm" in extra, extra
        assert s["reward"] == pytest.approx(extra["rule_score"] + RM_WEIGHT * extra["rm/rm"], abs=1e-5), extra
    assert len({round(json.loads(s["reward_extra"])["rm/rm"], 6) for s in samples}) > 1   # a model, not a constant

    # the rollout pod is gone (scaled to zero), its log is kept in the run (issue 36)
    def kept_logs():
        infos = fs.get_file_info(pafs.FileSelector(f"{run}/logs", allow_not_found=True))
        texts = [fs.open_input_stream(i.path).read().decode() for i in infos if i.base_name.startswith(f"{name}-rollout-")]
        return [t for t in texts if "stopping: letting running calls finish" in t]
    logs = wait_for("the rollout pod's kept log", kept_logs, timeout=120, interval=3)
    assert any("rollout server" in t and "agent loop: tools ['lookup', 'python']" in t
               and f"python runs on sandbox servers dns:///{name}-sandbox.{ns}.svc:50051" in t for t in logs), logs[0][-3000:]
