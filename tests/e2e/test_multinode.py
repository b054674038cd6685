"""Two trainer nodes (`trainer.nnodes: 2`, one process each, gloo): the two trainer pods find
each other through the headless Service's DNS (`<job>-trainer-0.<job>-trainer`), as on a
multi-node GPU cluster, train together and finish."""

from __future__ import annotations

import pytest

from .e2e_helpers import apply, make_assets, metrics, new_namespace, pods, quickstart_job, wait_phase

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
