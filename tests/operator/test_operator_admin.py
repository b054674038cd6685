"""The operator under an admin's hands (issue 36), against the real API server and controllers
with the operator under the chart's RBAC: a changed chart default (`helm upgrade` of jobDefaults)
reaches new jobs only. The tests play the kubelet, as in test_operator_controlplane.py."""

from __future__ import annotations

import json
import signal

import pytest

from operator_helpers import eventually
from test_operator_controlplane import Cluster

pytestmark = pytest.mark.controlplane


@pytest.fixture
def k(admin_client, namespace, storage_root, operator) -> Cluster:
    return Cluster(admin_client, namespace, storage_root)


def images(pod_spec) -> dict[str, str]:
    return {c.name: c.image for c in pod_spec.containers}


def test_a_chart_upgrade_of_job_defaults_reaches_new_jobs_only(k, operator):
    """Issue 36, bug 1: `helm upgrade --set jobDefaults.rollout.image.tag=does-not-exist` put
    the running jobs' rollout Deployments on that image. The chart passes jobDefaults to the
    operator as its environment, so an upgrade is a new operator process with new settings: a
    running job keeps the defaults pinned at its first reconcile (its ConfigMap says which), even
    for its next trainer attempt; a job created after the upgrade gets the new ones."""
    k.create("running")
    k.run_all("running")
    k.wait_phase("Running", "running")
    before = k.deployment("running")
    trainer_before = images(k.trainer_job("running").spec.template.spec)
    pinned = json.loads(k.core.read_namespaced_config_map("running-spec", k.ns).data["operator-defaults.json"])
    assert pinned["rollout_image"] == before.spec.template.spec.containers[0].image
    created = k.condition("Created", "running")["message"]
    assert f"rollout image {pinned['rollout_image']}" in created and "running-spec" in created

    saved = dict(operator.env)
    operator.kill(signal.SIGTERM)                        # the chart's Deployment rolls the operator
    operator.env.update({"GRPO_OPERATOR_ROLLOUT_IMAGE": "reg.example/rollout:does-not-exist",
                         "GRPO_OPERATOR_TRAINER_IMAGE": "reg.example/trainer:new",
                         "GRPO_OPERATOR_ROLLOUT_RESOURCES": '{"requests": {"cpu": "1", "memory": "1Gi"}}'})
    try:
        operator.start()
        k.create("fresh")
        fresh = eventually(lambda: k.deployment("fresh"), what="the new job's rollout Deployment")
        assert images(fresh.spec.template.spec) == {"rollout": "reg.example/rollout:does-not-exist"}
        assert fresh.spec.template.spec.containers[0].resources.requests == {"cpu": "1", "memory": "1Gi"}
        fresh_trainer = eventually(lambda: k.trainer_job("fresh"), what="the new job's trainer Job")
        assert images(fresh_trainer.spec.template.spec) == {"trainer": "reg.example/trainer:new"}
        fresh_pin = json.loads(k.core.read_namespaced_config_map("fresh-spec", k.ns).data["operator-defaults.json"])
        assert fresh_pin["rollout_image"] == "reg.example/rollout:does-not-exist"

        operator.wait_for_resyncs()                      # the new process reconciled the running job
        after = k.deployment("running")
        assert after.metadata.generation == before.metadata.generation      # not even re-rolled
        assert after.spec.template == before.spec.template
        rs = k.apps.list_namespaced_replica_set(k.ns, label_selector="grpo.dev/job=running").items
        assert len(rs) == 1
        assert json.loads(k.core.read_namespaced_config_map("running-spec", k.ns).data["operator-defaults.json"]) \
            == pinned
        assert k.status("running")["phase"] == "Running"

        # A restart of the running job (a new trainer Job) is built with its pinned defaults too.
        rank0 = next(p for p in k.trainer_pods("running", attempt=0) if p.spec.hostname == "running-trainer-0")
        k.kubelet(rank0, "Failed", exit_code=1, message="boom")
        retry = eventually(lambda: (j := k.trainer_job("running")) and j.metadata.labels["grpo.dev/attempt"] == "1"
                           and j, what="attempt 1 of the running job")
        assert images(retry.spec.template.spec) == trainer_before
    finally:
        operator.kill(signal.SIGTERM)
        operator.env.clear()
        operator.env.update(saved)
        operator.start()
