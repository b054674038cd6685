"""Queueing (Kueue) and gang scheduling (scheduler-plugins' PodGroup), with no cluster: what the
operator builds and decides. tests/operator/test_operator_queueing.py checks the same against the
real API server."""

from datetime import datetime, timedelta, timezone

import pytest

from grpo_api.jobfile import JobError, parse_job
from grpo_api.spec import GRPOJobStatus, Phase
from grpo_operator import manifests
from grpo_operator.conditions import find, fmt_time
from grpo_operator.lifecycle import Observed, TrainerJob, decide, trainer_job_state
from grpo_operator.pods import PodsView
from grpo_operator.settings import OperatorSettings
from grpo_operator.validation import parse_grpojob
from operator_helpers import UID, body

S = OperatorSettings()
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
QUEUE = {"kueue.x-k8s.io/queue-name": "team-a-gpus", "kueue.x-k8s.io/priority-class": "high",
         "team": "a"}


def api_job(labels=None, **changes):
    """A GRPOJob as the operator reads it from the API server (its labels included)."""
    doc = body(**changes)
    doc["metadata"].update(uid=UID, labels=labels or {})
    job, errors = parse_grpojob(doc, S)
    assert not errors, errors
    return job


# --- Kueue ------------------------------------------------------------------------------------

def test_queued_job_gets_a_suspended_trainer_job_carrying_kueues_labels():
    trainer = manifests.build_trainer_job(api_job(QUEUE), S)
    assert trainer["spec"]["suspend"] is True
    labels = trainer["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    assert labels["kueue.x-k8s.io/priority-class"] == "high"
    assert "team" not in labels                       # only Kueue's labels are passed on
    # Without the label nothing is suspended: the operator doesn't need Kueue.
    assert "suspend" not in manifests.build_trainer_job(api_job(), S)["spec"]


def status(**kw):
    return GRPOJobStatus(**kw)


def step(job, st, now=T0, **obs):
    obs.setdefault("generation", 1)
    obs.setdefault("children_applied", True)
    return decide(job, [], st, Observed(**obs), now)


def test_queued_job_waits_for_admission_holding_nothing():
    job = api_job(QUEUE)
    d = decide(job, [], status(), Observed(generation=1), T0)
    assert d.create_trainer == 0 and d.rollout_replicas == 0          # no rollout GPUs while queued
    assert d.status.phase == Phase.Pending and d.status.start_time is None
    queued = find(d.status.conditions, "Queued")
    assert (queued.status, queued.reason) == ("True", "WaitingForAdmission")
    assert "team-a-gpus" in queued.message and find(d.status.conditions, "PodsPending") is None
    # An hour in the queue is no pending deadline (900 s by default) and no active deadline.
    later = step(job, d.status, now=T0 + timedelta(hours=1), trainer=TrainerJob(0, suspended=True),
                 rollout_replicas=0)
    assert later.status.phase == Phase.Pending and not later.delete_trainer
    assert later.rollout_replicas is None and [e.reason for e in later.events] == []


def test_kueues_reason_is_in_the_queued_condition():
    job = api_job(QUEUE)
    st = decide(job, [], status(), Observed(generation=1), T0).status
    d = step(job, st, trainer=TrainerJob(0, suspended=True), rollout_replicas=0,
             kueue_message="LocalQueue team-a-gpus doesn't exist")
    assert find(d.status.conditions, "Queued").message.endswith("Kueue: LocalQueue team-a-gpus doesn't exist")


def test_admitted_trainer_starts_the_rollout_and_the_clock():
    job = api_job(QUEUE, **{"runPolicy.activeDeadlineSeconds": 600})
    queued = decide(job, [], status(), Observed(generation=1), T0).status
    admitted_at = T0 + timedelta(hours=2)
    d = step(job, queued, now=admitted_at, trainer=TrainerJob(0), rollout_replicas=0)
    assert d.rollout_replicas == 2 and d.status.start_time == fmt_time(admitted_at)
    assert find(d.status.conditions, "Queued").reason == "Admitted" and "Admitted" in [e.reason for e in d.events]
    running = step(job, d.status, now=admitted_at + timedelta(seconds=60), trainer=TrainerJob(0),
                   pods=PodsView(trainer_running=2, rollout_running=2), rollout_replicas=2)
    assert running.status.phase == Phase.Running
    # Preempted (Kueue suspends the Job again): back in the queue, the rollout servers stop too.
    preempted = step(job, running.status, now=admitted_at + timedelta(seconds=120),
                     trainer=TrainerJob(0, suspended=True), rollout_replicas=2)
    assert preempted.status.phase == Phase.Pending and preempted.rollout_replicas == 0
    assert find(preempted.status.conditions, "Queued").status == "True"
    assert find(preempted.status.conditions, "Running").status == "False"


def test_suspending_a_queued_job_removes_its_trainer_job():
    job = api_job(QUEUE, **{"runPolicy.suspend": True})
    st = status(phase=Phase.Pending, observed_generation=1)
    d = step(job, st, trainer=TrainerJob(0, suspended=True), rollout_replicas=0)
    assert d.delete_trainer and d.status.phase == Phase.Suspended


def test_trainer_job_state_reads_suspend():
    assert trainer_job_state({"metadata": {}, "spec": {"suspend": True}}).suspended
    assert not trainer_job_state({"metadata": {}, "spec": {}}).suspended


# --- gang scheduling --------------------------------------------------------------------------

GANG = {"runPolicy.schedulingPolicy": {"scheduleTimeoutSeconds": 120, "priorityClass": "gpu-training"}}


def test_pod_group_gathers_every_trainer_node():
    job = api_job(**GANG)
    group = next(c for c in manifests.build_children(job, S, pod_monitor=False) if c["kind"] == "PodGroup")
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["metadata"]["name"] == "demo-trainer"
    assert group["metadata"]["ownerReferences"][0]["uid"] == UID
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 120}
    pod = manifests.build_trainer_job(job, S)["spec"]["template"]
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "demo-trainer"
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert pod["spec"]["priorityClassName"] == "gpu-training"
    # The rollout servers are no gang: a Deployment's pods come and go one by one.
    rollout = manifests.build_rollout_deployment(job, S)["spec"]["template"]
    assert "scheduling.x-k8s.io/pod-group" not in rollout["metadata"]["labels"]
    assert "schedulerName" not in rollout["spec"]


def test_gang_scheduler_is_the_operators_setting_and_a_template_overrides_it():
    job = api_job(**{"runPolicy.schedulingPolicy": {}})
    settings = OperatorSettings(gang_scheduler_name="volcano-coscheduler")
    pod = manifests.build_trainer_job(job, settings)["spec"]["template"]["spec"]
    assert pod["schedulerName"] == "volcano-coscheduler" and "priorityClassName" not in pod
    group = manifests.build_pod_group(job, settings)
    assert group["spec"] == {"minMember": 2}                      # the scheduler's default timeout
    mine = api_job(**{"runPolicy.schedulingPolicy": {}, "trainer.template": {"spec": {"schedulerName": "mine"}}})
    assert manifests.build_trainer_job(mine, S)["spec"]["template"]["spec"]["schedulerName"] == "mine"


def test_no_pod_group_without_a_scheduling_policy():
    kinds = [c["kind"] for c in manifests.build_children(api_job(), S, pod_monitor=False)]
    assert "PodGroup" not in kinds
    pod = manifests.build_trainer_job(api_job(), S)["spec"]["template"]
    assert "scheduling.x-k8s.io/pod-group" not in pod["metadata"]["labels"] and "schedulerName" not in pod["spec"]


@pytest.mark.parametrize("policy, field", [
    ({"scheduleTimeoutSeconds": 0}, "spec.runPolicy.schedulingPolicy.scheduleTimeoutSeconds"),
    ({"priorityClass": ""}, "spec.runPolicy.schedulingPolicy.priorityClass"),
    ({"minAvailable": 1}, "spec.runPolicy.schedulingPolicy.minAvailable"),
])
def test_invalid_scheduling_policy_is_refused_naming_the_field(policy, field):
    with pytest.raises(JobError) as exc:
        parse_job(body(**{"runPolicy.schedulingPolicy": policy}))
    assert any(e.startswith(field) for e in exc.value.errors), exc.value.errors
