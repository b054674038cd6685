"""Two trainer nodes (`trainer.nnodes: 2`, one process each, gloo): the two trainer pods find
each other through the headless Service's DNS (`<job>-trainer-0.<job>-trainer`), as on a
multi-node GPU cluster, train together and finish with the same weights: the final checkpoint,
half of every tensor written by each rank, is the model rank 0 exported."""

from __future__ import annotations

import base64

import pytest

from .e2e_helpers import (run_path, S3_KEY, S3_SECRET, apply, make_assets, metrics, new_namespace, pods,
                          quickstart_job, wait_phase)

# The first test to use the cluster also pays for starting it, which includes importing new
# images into containerd (~12 min for the two torch images) when the sources changed.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

STEPS = 4


def test_two_trainer_pods_rendezvous_through_the_headless_service(cluster, operator):
    models = make_assets(cluster)
    ns = new_namespace(cluster)
    name = "twonodes"
    job = quickstart_job(name, cluster, models, steps=STEPS, nnodes=2, testFreq=-1, valBeforeTrain=False)
    apply(cluster, ns, job)
    final = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=900)
    assert final["progress"]["step"] == STEPS
    trainers = pods(cluster, ns, name, "trainer")
    ranks = sorted(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in trainers)
    assert ranks == ["0", "1"], ranks
    assert all(p["status"]["phase"] == "Succeeded" for p in trainers), [p["status"] for p in trainers]
    # The rendezvous went through DNS: rank 0's stable name is what both pods were told.
    for p in trainers:
        env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env", [])}
        assert env.get("PET_MASTER_ADDR") == f"{name}-trainer-0.{name}-trainer", env
    # Rank 0 logs for both (rank 1 prints only library noise): a world of 2 means both joined.
    (rank0,) = [p for p in trainers
                if p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == "0"]
    logs = cluster.kubectl("logs", "-n", ns, rank0["metadata"]["name"]).stdout
    assert "world size 2" in logs, logs[-3000:]
    assert sorted({r["step"] for r in metrics(cluster, ns, name) if "step" in r}) == list(range(1, STEPS + 1))

    # Both ranks hold the same final model: each wrote its shards of every tensor into the
    # checkpoint, rank 0 exported what it gathered from both; read back here, they are equal.
    checkpoint, exported = _final_checkpoint(cluster, ns, name), _exported(cluster, ns, name)
    assert exported and set(exported) <= set(checkpoint), (sorted(exported), sorted(checkpoint))
    for tensor_name, tensor in exported.items():
        assert tensor.equal(checkpoint[tensor_name].to(tensor.dtype)), tensor_name


def _final_checkpoint(cluster, ns: str, name: str) -> dict:
    """The model weights of checkpoints/step-STEPS, verified with the job's key (as `grpo export`)."""
    from grpo_api import signing
    from grpo_api.spec import StorageSpec
    from grpo_api.storage import Storage
    from grpo_trainer.checkpoint import load_full_state_dict

    secret = cluster.get("secret", f"{name}-rpc", "-n", ns)
    key = signing.parse_key(base64.b64decode(secret["data"]["checkpoint-key"]).decode(), "checkpoint-key")
    storage = Storage(StorageSpec(endpoint=cluster.s3_endpoint, region="us-east-1"),
                      env={"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET})
    weights, state = load_full_state_dict(f"s3://{run_path(cluster, ns, name)}/checkpoints/step-{STEPS}", storage, key)
    assert state.trainer.step == STEPS
    return weights


def _exported(cluster, ns: str, name: str) -> dict:
    import pyarrow.fs as pafs
    from safetensors.torch import load

    fs = cluster.s3()
    prefix = f"{run_path(cluster, ns, name)}/hf/step-{STEPS}"
    tensors = {}
    for f in fs.get_file_info(pafs.FileSelector(prefix)):
        if f.path.endswith(".safetensors"):
            with fs.open_input_stream(f.path) as src:
                tensors.update(load(src.read()))
    return tensors
