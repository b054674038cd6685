"""Queueing and gang scheduling against the real API server, with the operator under the
chart's RBAC: a GRPOJob queued in Kueue waits, holding nothing, until its trainer Job is admitted
(unsuspended); a gang-scheduled one gets a PodGroup that the API server accepts under
scheduler-plugins' schema, and trainer pods that name it.

The tests play Kueue's controller as its batch/Job integration acts (a Workload for the suspended
Job, its QuotaReserved condition, unsuspending the Job to admit it, suspending it to preempt):
Kueue's own binary takes too long to build for CI on these machines (`go install
sigs.k8s.io/kueue/cmd/kueue@v0.17.0`: 27 minutes on 2 busy cores). Checked once by hand against
that binary (ClusterQueue with 8 GPUs, two such GRPOJobs of 8 GPUs each): Kueue admitted one, and
the other's Queued condition quoted it word for word as NO_QUOTA below."""

from __future__ import annotations

import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from operator_helpers import GROUP, PLURAL, VERSION, body, eventually
from test_operator_controlplane import Cluster

pytestmark = pytest.mark.controlplane
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


@pytest.fixture
def k(admin_client, namespace, storage_root, operator) -> Cluster:
    return Cluster(admin_client, namespace, storage_root)


def create(k: Cluster, name="demo", labels=None, **changes) -> dict:
    changes = {"storage.uri": f"file://{k.storage_root}", "storage.secretRef": None, **changes}
    doc = body(name, k.ns, **changes)
    doc["metadata"]["labels"] = labels or {}
    return k.custom.create_namespaced_custom_object(GROUP, VERSION, k.ns, PLURAL, doc)


NO_QUOTA = "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor " \
           "default-flavor, 8 more needed"


def kueue_workload(k: Cluster, trainer, message: str) -> None:
    """What Kueue's batch/Job integration makes for a suspended Job with a queue-name label, and
    what its scheduler writes when the Workload doesn't fit the ClusterQueue."""
    custom = k.custom
    workload = custom.create_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", k.ns, "workloads", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": f"job-{trainer.metadata.name}-1a2b3", "labels": {
            "kueue.x-k8s.io/job-uid": trainer.metadata.uid}, "ownerReferences": [{
                "apiVersion": "batch/v1", "kind": "Job", "name": trainer.metadata.name,
                "uid": trainer.metadata.uid, "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"queueName": trainer.metadata.labels[QUEUE_LABEL],
                 "podSets": [{"name": "main", "count": trainer.spec.parallelism}]}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    custom.patch_namespaced_custom_object_status(
        "kueue.x-k8s.io", "v1beta2", k.ns, "workloads", workload["metadata"]["name"], {"status": {"conditions": [{
            "type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message,
            "lastTransitionTime": now}]}})


def admit(k: Cluster, name="demo") -> None:
    """What Kueue's batch/Job integration does once the Workload fits its ClusterQueue."""
    k.batch.patch_namespaced_job(f"{name}-trainer", k.ns, {"spec": {"suspend": False}})


def wait_condition(k: Cluster, type_, status, reason, name="demo") -> dict:
    def matches():
        c = k.condition(type_, name)
        return c if c and (c["status"], c["reason"]) == (status, reason) else None
    return eventually(matches, what=f"{type_}={status} ({reason}) on {name} (now {k.status(name)})")


def test_queued_job_waits_for_admission_then_runs(k):
    create(k, labels={QUEUE_LABEL: "team-a-gpus", "kueue.x-k8s.io/priority-class": "high"})
    trainer = eventually(k.trainer_job, what="the trainer Job")
    assert trainer.spec.suspend is True
    assert trainer.metadata.labels[QUEUE_LABEL] == "team-a-gpus"
    assert trainer.metadata.labels["kueue.x-k8s.io/priority-class"] == "high"
    queued = wait_condition(k, "Queued", "True", "WaitingForAdmission")
    assert "team-a-gpus" in queued["message"]
    assert k.status()["phase"] == "Pending" and "startTime" not in k.status()
    assert k.wait_event("WaitingForAdmission").type == "Normal"
    # Nothing holds GPUs meanwhile: the Job controller made no trainer pod, the rollout is at zero.
    assert eventually(k.deployment, what="the rollout Deployment").spec.replicas == 0
    assert k.pods() == []
    assert (k.condition("PodsPending") or {}).get("status") != "True"
    # Why it waits is Kueue's to say: its Workload's condition, quoted in the job's status.
    kueue_workload(k, trainer, NO_QUOTA)
    eventually(lambda: NO_QUOTA in k.condition("Queued")["message"], what="Kueue's reason in the Queued condition")

    admit(k)
    k.run_all()
    k.wait_phase("Running")
    assert wait_condition(k, "Queued", "False", "Admitted")
    assert k.deployment().spec.replicas == 2 and k.status()["startTime"]
    assert k.wait_event("Admitted").type == "Normal"


def test_preempted_trainer_returns_to_the_queue(k):
    create(k, labels={QUEUE_LABEL: "team-a-gpus"})
    eventually(k.trainer_job, what="the trainer Job")
    admit(k)
    k.run_all()
    k.wait_phase("Running")
    # Kueue preempts a workload by suspending its Job again: the Job controller removes the pods.
    k.batch.patch_namespaced_job("demo-trainer", k.ns, {"spec": {"suspend": True}})
    wait_condition(k, "Queued", "True", "WaitingForAdmission")
    assert k.status()["phase"] == "Pending"
    eventually(lambda: k.deployment().spec.replicas == 0, what="the rollout scaled to zero")
    eventually(lambda: not k.pods("demo", "trainer"), what="the trainer pods gone")


def test_suspend_still_works_for_a_queued_job(k):
    create(k, labels={QUEUE_LABEL: "team-a-gpus"})
    wait_condition(k, "Queued", "True", "WaitingForAdmission")
    k.patch_spec("demo", {"runPolicy": {"suspend": True}})
    k.wait_phase("Suspended", timeout=60)
    eventually(lambda: k.trainer_job() is None and k.deployment() is None, timeout=60,
               what="the trainer Job and rollout Deployment removed")
    k.patch_spec("demo", {"runPolicy": {"suspend": False}})
    # Resumed: a new trainer Job, queued again, which Kueue must admit before anything runs.
    eventually(lambda: (t := k.trainer_job()) and t.spec.suspend is True, timeout=60,
               what="a new suspended trainer Job")
    wait_condition(k, "Queued", "True", "WaitingForAdmission")
    assert k.status()["phase"] == "Pending"


# --- gang scheduling --------------------------------------------------------------------------

@pytest.fixture
def priority_class(admin_client) -> str:
    """The pods' PriorityClass must exist: the Priority admission plugin refuses them otherwise."""
    api = client.SchedulingV1Api(admin_client)
    try:
        api.create_priority_class({"metadata": {"name": "grpo-test-training"}, "value": 1000})
    except ApiException as e:
        if e.status != 409:
            raise
    return "grpo-test-training"


def test_gang_scheduled_trainer_gets_a_pod_group(k, priority_class):
    gj = create(k, **{"runPolicy.schedulingPolicy": {"scheduleTimeoutSeconds": 120, "priorityClass": priority_class}})
    group = eventually(lambda: _pod_group(k), what="the PodGroup")
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 120}
    (owner,) = group["metadata"]["ownerReferences"]
    assert owner["uid"] == gj["metadata"]["uid"] and owner["controller"] is True
    pods = k.trainer_pods()
    for p in pods:
        assert p.metadata.labels["scheduling.x-k8s.io/pod-group"] == "demo-trainer"
        assert p.spec.scheduler_name == "scheduler-plugins-scheduler"
        assert p.spec.priority_class_name == priority_class and p.spec.priority == 1000
    # The rollout servers are scheduled one by one, by the default scheduler.
    rollout = eventually(lambda: k.pods("demo", "rollout"), what="rollout pods")[0]
    assert rollout.spec.scheduler_name == "default-scheduler"


def test_invalid_scheduling_policy_is_refused_at_apply(k):
    with pytest.raises(ApiException) as exc:
        create(k, **{"runPolicy.schedulingPolicy": {"scheduleTimeoutSeconds": 0}})
    assert exc.value.status == 422
    assert "spec.runPolicy.schedulingPolicy.scheduleTimeoutSeconds" in exc.value.body


def _pod_group(k: Cluster) -> dict | None:
    try:
        return k.custom.get_namespaced_custom_object("scheduling.x-k8s.io", "v1alpha1", k.ns, "podgroups",
                                                     "demo-trainer")
    except ApiException as e:
        if e.status == 404:
            return None
        raise
