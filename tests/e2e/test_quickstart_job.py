"""`kubectl apply` of the quickstart GRPOJob (its task and tiny model, run files in S3) on a
real node, from the images the Dockerfiles build: what a user sees with kubectl, and what the
job leaves in S3."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from .e2e_helpers import (run_path, apply, describe, gj_row, make_assets, metrics, new_namespace, pods,
                          quickstart_job, reward_ends, status, wait_for, wait_phase)

# The first test to use the cluster also pays for starting it, which includes importing new
# images into containerd (~12 min for the two torch images) when the sources changed.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

STEPS = 30          # enough for the reward to rise clearly above chance (bench/RESULTS.md)


@pytest.fixture(scope="module")
def quickstart(cluster, operator):
    """One quickstart run; the tests below check what it showed and left behind."""
    models = make_assets(cluster)
    ns = new_namespace(cluster)
    name = "quickstart"
    apply(cluster, ns, quickstart_job(name, cluster, models, steps=STEPS))
    seen = {"rows": [], "running_pods": set(), "logs": ""}

    def progressed():
        # While it runs: both kinds of pod Running, and `kubectl get gj` filling in.
        for role in ("trainer", "rollout"):
            if any(p["status"].get("phase") == "Running" for p in pods(cluster, ns, name, role)):
                seen["running_pods"].add(role)
        row = gj_row(cluster, ns, name)
        seen["rows"].append(row)
        if row.get("VAL", "<none>") != "<none>" and "trainer" in seen["running_pods"]:
            seen["logs"] = cluster.kubectl("logs", "-n", ns, f"job/{name}-trainer", check=False).stdout
        return row.get("PHASE") in ("Succeeded", "Failed")
    wait_for("the quickstart to finish", progressed, timeout=1200, interval=2, diagnose=describe(cluster, ns, name))
    final = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=60)
    logs = cluster.kubectl("logs", "-n", ns, f"job/{name}-trainer", check=False)
    if logs.returncode == 0 and len(logs.stdout) > len(seen["logs"]):    # the pod is kept: all of it
        seen["logs"] = logs.stdout
    return {"ns": ns, "name": name, "status": final, **seen}


def test_pods_run_and_kubectl_get_gj_shows_progress(quickstart):
    assert quickstart["running_pods"] == {"trainer", "rollout"}
    filled = [r for r in quickstart["rows"] if r.get("STEP", "<none>") != "<none>"]
    assert filled, quickstart["rows"]
    assert any(r.get("REWARD", "<none>") != "<none>" for r in filled)
    assert any(r.get("VAL", "<none>") != "<none>" for r in quickstart["rows"])
    steps = [int(r["STEP"]) for r in filled]
    assert steps == sorted(steps) and steps[-1] == STEPS


def test_job_succeeds_and_the_rollout_deployment_scales_to_zero(cluster, quickstart):
    ns, name = quickstart["ns"], quickstart["name"]
    assert quickstart["status"]["progress"]["step"] == STEPS

    def scaled_down():
        d = cluster.get("deployment", f"{name}-rollout", "-n", ns)
        return d["spec"]["replicas"] == 0 and not pods(cluster, ns, name, "rollout")
    wait_for("the rollout Deployment at 0 replicas", scaled_down, timeout=180)


def test_reward_rises_from_the_first_steps(cluster, quickstart):
    first, last = reward_ends(metrics(cluster, quickstart["ns"], quickstart["name"]))
    assert last > first + 0.02, f"reward: first steps {first:.3f}, last steps {last:.3f}"


def test_exported_model_in_s3_loads_and_generates(cluster, quickstart):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fs = cluster.s3()
    prefix = f"{run_path(cluster, quickstart['ns'], quickstart['name'])}/hf/step-{STEPS}"
    import pyarrow.fs as pafs
    files = [f for f in fs.get_file_info(pafs.FileSelector(prefix, recursive=True)) if f.type == pafs.FileType.File]
    assert any(f.path.endswith(".safetensors") for f in files), [f.path for f in files]
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            target = Path(tmp) / f.path.removeprefix(prefix + "/")
            target.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(f.path) as src:
                target.write_bytes(src.read())
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "copy the digit 7 then answer #### and the digit"}], add_generation_prompt=True,
                                            return_tensors="pt")
        if not isinstance(ids, torch.Tensor):
            ids = ids["input_ids"]
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_trainer_logs_show_verl_style_console_lines(quickstart):
    logs = quickstart["logs"]
    for line in ("Generating rollouts for", "responses", "Validation accuracy"):
        assert line in logs, logs[-3000:]
    assert "Got " in logs
