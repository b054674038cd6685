"""The GRPOJob state machine (grpo_operator.lifecycle.decide), with no cluster: every transition
of the lifecycle the control-plane tests then check for real."""

from datetime import datetime, timedelta, timezone

import pytest

from grpo_api.contracts import STOPPED_EXIT_CODE
from grpo_api.spec import GRPOJobStatus, Phase, Progress
from grpo_operator import lifecycle, pods
from grpo_operator.conditions import find, fmt_time
from grpo_operator.lifecycle import Observed, TrainerJob, decide
from grpo_operator.pods import PodExit, PodProblem, PodsView
from operator_helpers import job

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
RUNNING = PodsView(trainer_running=2, rollout_running=2)


def status(**kw) -> GRPOJobStatus:
    return GRPOJobStatus(**kw)


def step(j, st, now=T0, **obs):
    obs.setdefault("generation", 1)
    obs.setdefault("children_applied", True)
    return decide(j, [], st, Observed(**obs), now)


def reasons(d):
    return [e.reason for e in d.events]


def test_new_job_creates_everything():
    d = decide(job(), [], status(), Observed(generation=1), T0)
    assert d.apply_children and d.create_trainer == 0 and d.rollout_replicas == 2
    assert d.status.phase == Phase.Pending and d.status.start_time == fmt_time(T0)
    assert d.status.observed_generation == 1
    assert find(d.status.conditions, "Created").status == "True"
    assert not d.delete_trainer and not d.delete_job


def test_restarted_operator_reapplies_children_but_creates_nothing_twice():
    st = status(phase=Phase.Running, observed_generation=1, start_time=fmt_time(T0))
    d = step(job(), st, trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2, children_applied=False)
    assert d.apply_children and d.create_trainer is None and d.status.phase == Phase.Running


def test_running_when_every_trainer_pod_runs():
    st = status(phase=Phase.Pending, observed_generation=1, start_time=fmt_time(T0))
    d = step(job(), st, trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2)
    assert d.status.phase == Phase.Running and "Running" in reasons(d)
    assert find(d.status.conditions, "Running").status == "True"
    half = step(job(), st, trainer=TrainerJob(0), pods=PodsView(trainer_running=1, rollout_running=2),
                rollout_replicas=2)
    assert half.status.phase == Phase.Pending


def test_steady_state_changes_nothing():
    st = step(job(), status(phase=Phase.Pending, observed_generation=1, start_time=fmt_time(T0)),
              trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2).status
    again = step(job(), st, now=T0 + timedelta(seconds=30), trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2)
    assert again.status == st and again.events == []
    assert again.rollout_replicas is None and again.create_trainer is None and not again.apply_children


def test_replicas_change_scales_the_deployment():
    st = status(phase=Phase.Running, observed_generation=1, start_time=fmt_time(T0))
    d = step(job(**{"rollout.replicas": 5}), st, generation=2, trainer=TrainerJob(0), pods=RUNNING,
             rollout_replicas=2)
    assert d.rollout_replicas == 5 and d.apply_children and d.status.observed_generation == 2


def test_trainer_failure_restarts_until_the_backoff_limit():
    j = job(**{"runPolicy.backoffLimit": 2})
    failed = TrainerJob(0, "failed", reason="BackoffLimitExceeded", message="Job has reached the specified backoff limit")
    d = step(j, status(phase=Phase.Running, observed_generation=1), trainer=failed, rollout_replicas=2)
    assert d.delete_trainer and d.create_trainer is None
    assert d.status.restarts == 1 and d.status.phase == Phase.Restarting and "TrainerFailed" in reasons(d)
    # The old Job is on its way out: wait; then a new one with attempt 1.
    d = step(j, d.status, trainer=TrainerJob(0, "failed", deleting=True), rollout_replicas=2)
    assert not d.delete_trainer and d.create_trainer is None and d.status.phase == Phase.Restarting
    d = step(j, d.status, trainer=None, rollout_replicas=2)
    assert d.create_trainer == 1
    d = step(j, d.status, trainer=TrainerJob(1, "failed", reason="BackoffLimitExceeded"), rollout_replicas=2)
    assert d.status.restarts == 2 and d.delete_trainer
    d = step(j, d.status, trainer=TrainerJob(2, "failed", reason="BackoffLimitExceeded"), rollout_replicas=2)
    assert d.status.phase == Phase.Failed and d.status.restarts == 2
    assert not d.delete_trainer              # the failed Job's pods stay for `kubectl logs`
    assert d.rollout_replicas == 0 and d.status.completion_time == fmt_time(T0)
    failed_cond = find(d.status.conditions, "Failed")
    assert failed_cond.reason == "BackoffLimitExceeded" and "runPolicy.backoffLimit=2" in failed_cond.message


def test_a_failure_is_counted_once_across_operator_restarts():
    # Status already says restart 1 (written before the operator died), the failed Job is attempt 0.
    st = status(phase=Phase.Restarting, restarts=1, observed_generation=1)
    d = step(job(), st, trainer=TrainerJob(0, "failed"), rollout_replicas=2)
    assert d.status.restarts == 1 and d.delete_trainer and d.events == []


def test_backoff_limit_zero_fails_on_the_first_failure():
    d = step(job(**{"runPolicy.backoffLimit": 0}), status(phase=Phase.Running, observed_generation=1),
             trainer=TrainerJob(0, "failed"), rollout_replicas=2)
    assert d.status.phase == Phase.Failed and d.status.restarts == 0


def test_success_scales_rollout_to_zero():
    d = step(job(), status(phase=Phase.Running, observed_generation=1), trainer=TrainerJob(0, "succeeded"),
             rollout_replicas=2)
    assert d.status.phase == Phase.Succeeded and d.rollout_replicas == 0 and not d.delete_trainer
    assert find(d.status.conditions, "Succeeded").status == "True"
    assert find(d.status.conditions, "Running").status == "False"
    again = step(job(), d.status, trainer=TrainerJob(0, "succeeded"), rollout_replicas=0)
    assert again.rollout_replicas is None and again.create_trainer is None and again.events == []


def test_finished_job_is_deleted_after_its_ttl():
    j = job(**{"runPolicy.ttlSecondsAfterFinished": 60})
    done = status(phase=Phase.Succeeded, completion_time=fmt_time(T0), observed_generation=1)
    assert not step(j, done, now=T0 + timedelta(seconds=59)).delete_job
    d = step(j, done, now=T0 + timedelta(seconds=60))
    assert d.delete_job and "TTLExpired" in reasons(d)
    assert not step(job(), done, now=T0 + timedelta(days=365)).delete_job      # no TTL: kept


def test_pending_reason_surfaces_and_the_deadline_fails_the_job():
    j = job(**{"runPolicy.pendingDeadlineSeconds": 120})
    stuck = PodsView(problems=(PodProblem("demo-trainer-0-abc", "ErrImagePull", "pull access denied"),))
    st = status(phase=Phase.Pending, observed_generation=1, start_time=fmt_time(T0))
    d = step(j, st, trainer=TrainerJob(0), pods=stuck, rollout_replicas=2)
    pending = find(d.status.conditions, "PodsPending")
    assert pending.status == "True" and pending.reason == "ErrImagePull"
    assert "demo-trainer-0-abc" in pending.message and "pull access denied" in pending.message
    assert reasons(d) == ["ErrImagePull"]                       # one event per new reason
    d2 = step(j, d.status, now=T0 + timedelta(seconds=60), trainer=TrainerJob(0), pods=stuck, rollout_replicas=2)
    assert d2.status.phase == Phase.Pending and d2.events == []
    d3 = step(j, d2.status, now=T0 + timedelta(seconds=121), trainer=TrainerJob(0), pods=stuck, rollout_replicas=2)
    assert d3.status.phase == Phase.Failed
    failed = find(d3.status.conditions, "Failed")
    assert failed.reason == "PendingDeadlineExceeded" and "ErrImagePull" in failed.message
    assert d3.delete_trainer and d3.rollout_replicas == 0


def test_pending_clock_restarts_once_pods_run():
    j = job(**{"runPolicy.pendingDeadlineSeconds": 120})
    st = status(phase=Phase.Pending, observed_generation=1, start_time=fmt_time(T0))
    d = step(j, st, trainer=TrainerJob(0), pods=PodsView(), rollout_replicas=2)
    d = step(j, d.status, now=T0 + timedelta(seconds=100), trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2)
    assert find(d.status.conditions, "PodsPending").status == "False"
    d = step(j, d.status, now=T0 + timedelta(seconds=200), trainer=TrainerJob(0), pods=PodsView(trainer_running=2),
             rollout_replicas=2)   # the rollout pods went away: pending again, a fresh clock
    assert d.status.phase == Phase.Running
    d = step(j, d.status, now=T0 + timedelta(seconds=250), trainer=TrainerJob(0), pods=PodsView(trainer_running=2),
             rollout_replicas=2)
    assert d.status.phase == Phase.Running


def test_active_deadline_fails_a_running_job():
    j = job(**{"runPolicy.activeDeadlineSeconds": 3600})
    st = status(phase=Phase.Running, observed_generation=1, start_time=fmt_time(T0))
    assert step(j, st, now=T0 + timedelta(seconds=3599), trainer=TrainerJob(0), pods=RUNNING,
                rollout_replicas=2).status.phase == Phase.Running
    d = step(j, st, now=T0 + timedelta(seconds=3600), trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2)
    assert d.status.phase == Phase.Failed and find(d.status.conditions, "Failed").reason == "DeadlineExceeded"
    assert d.delete_trainer and d.rollout_replicas == 0


def test_suspend_stops_trainer_first_then_rollout_and_resume_recreates():
    j = job(**{"runPolicy.suspend": True})
    st = status(phase=Phase.Running, observed_generation=1, start_time=fmt_time(T0), restarts=1)
    d = step(j, st, trainer=TrainerJob(1), pods=RUNNING, rollout_replicas=2)
    assert d.delete_trainer and not d.delete_rollout and d.status.phase == Phase.Suspended
    assert find(d.status.conditions, "Suspended").reason == "Suspending"
    d = step(j, d.status, trainer=TrainerJob(1, deleting=True), rollout_replicas=2)
    assert not d.delete_trainer and not d.delete_rollout                # the trainer is checkpointing
    d = step(j, d.status, trainer=None, rollout_replicas=2)
    assert d.delete_rollout and find(d.status.conditions, "Suspended").reason == "Suspended"
    d = step(j, d.status, trainer=None, rollout_replicas=None)
    assert not d.delete_rollout and d.create_trainer is None and d.status.phase == Phase.Suspended
    # Resume: fresh pods, same restart count, the active deadline counts from now.
    resumed = step(job(), d.status, now=T0 + timedelta(hours=5), generation=2, children_applied=False)
    assert resumed.create_trainer == 1 and resumed.rollout_replicas == 2
    assert resumed.status.phase == Phase.Restarting and resumed.status.restarts == 1
    assert resumed.status.start_time == fmt_time(T0 + timedelta(hours=5))
    assert find(resumed.status.conditions, "Suspended").status == "False" and "Resumed" in reasons(resumed)


def test_invalid_spec_fails_without_children():
    d = decide(None, ["spec.storage.uri: required on Kubernetes"], status(), Observed(generation=1), T0)
    assert d.status.phase == Phase.Failed
    assert find(d.status.conditions, "Invalid").message == "spec.storage.uri: required on Kubernetes"
    assert not d.apply_children and d.create_trainer is None and d.rollout_replicas is None
    assert reasons(d) == ["InvalidSpec"]
    again = decide(None, ["spec.storage.uri: required on Kubernetes"], d.status, Observed(generation=1), T0)
    assert again.events == [] and again.status == d.status


def test_progress_is_copied_and_kept():
    p = Progress(step=3, total_steps=10, reward_mean=0.5, reward_error_fraction=0.25, tool_error_fraction=0.5)
    st = status(phase=Phase.Running, observed_generation=1)
    d = step(job(), st, trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2, progress=p)
    assert d.status.progress == p
    assert step(job(), d.status, trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2).status.progress == p


@pytest.mark.parametrize("conditions, outcome, reason", [
    ([], "active", ""),
    ([{"type": "Complete", "status": "True"}], "succeeded", ""),
    ([{"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": "m"}], "failed", "PodFailurePolicy"),
    ([{"type": "Failed", "status": "False"}], "active", ""),
])
def test_trainer_job_state_reads_the_attempt_and_outcome(conditions, outcome, reason):
    t = lifecycle.trainer_job_state({"metadata": {"labels": {"grpo.dev/attempt": "3"}},
                                     "status": {"conditions": conditions}})
    assert (t.attempt, t.outcome, t.reason, t.deleting) == (3, outcome, reason, False)


def _pod(name, role, phase="Pending", attempt="0", waiting=None, unschedulable=None):
    status = {"phase": phase}
    if waiting:
        status["containerStatuses"] = [{"name": "c", "state": {"waiting": {"reason": waiting, "message": "m"}}}]
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": unschedulable}]
    return {"metadata": {"name": name, "labels": {"grpo.dev/role": role, "grpo.dev/attempt": attempt}},
            "status": status}


def test_pods_view_counts_running_pods_and_lists_plain_pending_last():
    v = pods.view([
        _pod("t-old", "trainer", phase="Failed", attempt="0"),
        _pod("t-0", "trainer", phase="Running", attempt="1"),
        _pod("t-1", "trainer", attempt="1", unschedulable="0/3 nodes have enough nvidia.com/gpu"),
        _pod("r-a", "rollout", phase="Running"),
        _pod("r-b", "rollout", waiting="ImagePullBackOff"),
        _pod("r-c", "rollout"),
    ], attempt=1)
    assert (v.trainer_running, v.rollout_running) == (1, 1)
    assert [(p.pod, p.reason) for p in v.problems] == [
        ("r-b", "ImagePullBackOff"), ("t-1", "Unschedulable"), ("r-c", "Pending")]
    assert "nvidia.com/gpu" in v.problems[1].describe()
    assert v.old_trainer == ("t-old",) and v.trainer_finished == () and v.trainer_exits == ()


def test_a_failed_attempt_is_explained_and_its_pods_kept_until_the_next_one_runs():
    crashed = PodExit("t-0", 1, "Error", "Traceback ...\nRuntimeError: CUDA out of memory")
    failed_pods = PodsView(trainer_finished=("t-0",), trainer_exits=(crashed,))
    d = step(job(), status(phase=Phase.Running, observed_generation=1), rollout_replicas=2, pods=failed_pods,
             trainer=TrainerJob(0, "failed", reason="BackoffLimitExceeded", message="Job has reached the limit"))
    assert d.delete_trainer and d.keep_pods == ("t-0",)
    (event,) = d.events
    # The trainer's own words, not the Job's boilerplate (its backoffLimit is 0: issue 36).
    assert event.message.startswith("trainer failed (pod t-0 exited with code 1 (Error): Traceback ...\n"
                                    "RuntimeError: CUDA out of memory)")
    assert "Job has reached the limit" not in event.message
    failed = find(d.status.conditions, "TrainerFailed")
    assert failed.status == "True" and failed.reason == "BackoffLimitExceeded"
    assert failed.message.startswith("attempt 0: pod t-0 exited with code 1 (Error): Traceback")
    # The next attempt: the old pod stays while it is pending, goes once it runs.
    pending = step(job(), d.status, trainer=TrainerJob(1), rollout_replicas=2, pods=PodsView(old_trainer=("t-0",)))
    assert pending.delete_pods == ()
    running = step(job(), d.status, trainer=TrainerJob(1), rollout_replicas=2,
                   pods=PodsView(trainer_running=2, rollout_running=2, old_trainer=("t-0",)))
    assert running.delete_pods == ("t-0",)
    recovered = find(running.status.conditions, "TrainerFailed")
    assert recovered.status == "False" and "the last failure: attempt 0: " in recovered.message


def test_bad_input_fails_the_job_at_once_with_the_trainers_words():
    """Exit 2 (issue 36, bug 2): the pod failure policy failed the Job; retrying can't help."""
    said = "error: spec.model.path: '/models/nope' does not exist"
    pods = PodsView(trainer_finished=("t-0",), trainer_exits=(PodExit("t-0", 2, "Error", said),))
    d = step(job(), status(phase=Phase.Running, observed_generation=1), rollout_replicas=2, pods=pods,
             trainer=TrainerJob(0, "failed", reason="PodFailurePolicy", message="Container trainer for pod x failed "
                                "with exit code 2 matching FailJob rule at index 1"))
    assert d.status.phase == Phase.Failed and d.status.restarts == 0 and d.create_trainer is None
    assert d.rollout_replicas == 0 and not d.delete_trainer          # the failed Job stays, for its pods
    failed = find(d.status.conditions, "Failed")
    assert failed.reason == "BadInput" and failed.message.endswith(f"pod t-0 exited with code 2 (Error): {said}")
    assert "matching FailJob rule" not in failed.message
    assert find(d.status.conditions, "TrainerFailed").reason == "BadInput"
    assert [e.reason for e in d.events] == ["BadInput"] and said in d.events[0].message


def test_a_killed_trainer_says_its_signal_and_reason():
    oom = PodsView(trainer_finished=("t-0",), trainer_exits=(PodExit("t-0", 137, "OOMKilled", "step 3"),))
    d = step(job(), status(phase=Phase.Running, observed_generation=1), rollout_replicas=2, pods=oom,
             trainer=TrainerJob(0, "failed", reason="BackoffLimitExceeded", message="Job has reached the limit"))
    failed = find(d.status.conditions, "TrainerFailed")
    assert failed.reason == "OOMKilled"
    assert failed.message == "attempt 0: pod t-0 exited with code 137 (SIGKILL, OOMKilled): step 3"
    assert d.status.phase == Phase.Restarting and d.status.restarts == 1


def test_a_trainer_pod_stopped_on_sigterm_is_no_failure_to_report():
    """Issue 48: `kubectl delete pod` stops the trainer, which checkpoints and exits
    STOPPED_EXIT_CODE; the Job replaces the pod (its pod failure policy ignores that code). When the
    replacement then crashes, the failure reported is the crash's, not the stop's, and the stop
    used no restart."""
    def exited(name, code, message):
        return {"metadata": {"name": name, "labels": {"grpo.dev/role": "trainer", "grpo.dev/attempt": "0"},
                             "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
                "status": {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {"terminated": {
                    "exitCode": code, "reason": "Error", "message": message}}}]}}
    # the stopped pod sorts first (same index, its name first)
    v = pods.view([exited("t-0-a", STOPPED_EXIT_CODE, "trainer stopped by SIGTERM"),
                   exited("t-0-b", 137, "step 3")], attempt=0)
    assert [e.pod for e in v.trainer_exits] == ["t-0-b"] and v.trainer_finished == ("t-0-a", "t-0-b")
    d = step(job(), status(phase=Phase.Running, observed_generation=1), rollout_replicas=2, pods=v,
             trainer=TrainerJob(0, "failed", reason="BackoffLimitExceeded", message="Job has reached the limit"))
    failed = find(d.status.conditions, "TrainerFailed")
    assert failed.message == "attempt 0: pod t-0-b exited with code 137 (SIGKILL, Error): step 3"
    assert d.status.restarts == 1


def test_a_missing_secret_is_named_then_fails_the_job_after_the_grace():
    from datetime import timedelta

    from grpo_operator.pods import PodProblem
    missing = PodsView(problems=(PodProblem("t-0", "CreateContainerConfigError", 'secret "trk" not found'),))
    j = job(**{"trainer.trackerSecretRef": "trk"})
    d = step(j, status(phase=Phase.Pending, observed_generation=1), trainer=TrainerJob(0), rollout_replicas=2,
             pods=missing, missing_secret_grace_seconds=30)
    c = find(d.status.conditions, "SecretMissing")
    assert (c.status, c.reason, c.message) == ("True", "SecretNotFound",
                                                'secret "trk" not found (spec.trainer.trackerSecretRef)')
    assert d.status.phase == Phase.Pending and "SecretNotFound" in reasons(d)
    later = step(j, d.status, trainer=TrainerJob(0), rollout_replicas=2, pods=missing, missing_secret_grace_seconds=30,
                 now=T0 + timedelta(seconds=31))
    assert later.status.phase == Phase.Failed and find(later.status.conditions, "Failed").reason == "SecretNotFound"
    assert later.delete_trainer and later.rollout_replicas == 0
    # Created meanwhile: the condition goes False, nothing fails.
    found = step(j, d.status, trainer=TrainerJob(0), rollout_replicas=2, pods=RUNNING, missing_secret_grace_seconds=30,
                 now=T0 + timedelta(seconds=31))
    assert found.status.phase == Phase.Running and find(found.status.conditions, "SecretMissing").status == "False"


def test_unreadable_progress_is_a_condition_with_one_event():
    st = status(phase=Phase.Running, observed_generation=1)
    denied = "s3:// storage needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment"
    d = step(job(), st, trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2, progress_read=True,
             progress_error=denied)
    c = find(d.status.conditions, "ProgressUnreadable")
    assert (c.status, c.reason) == ("True", "StorageUnreadable") and denied in c.message
    assert "operator.storageCredentialsSecret" in c.message and reasons(d) == ["ProgressUnreadable"]
    again = step(job(), d.status, trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2, progress_read=True,
                 progress_error=denied)
    assert again.events == [] and again.status == d.status
    fixed = step(job(), d.status, trainer=TrainerJob(0), pods=RUNNING, rollout_replicas=2, progress_read=True)
    assert find(fixed.status.conditions, "ProgressUnreadable").status == "False"


def test_the_total_column_shows_the_specs_steps_before_the_trainer_reports():
    d = decide(job(**{"trainer.totalSteps": 7}), [], status(), Observed(generation=1), T0)
    assert d.status.progress == Progress(step=0, total_steps=7)
    by_epochs = decide(job(**{"trainer.totalSteps": None, "trainer.totalEpochs": 2}), [], status(),
                       Observed(generation=1), T0)
    assert by_epochs.status.progress is None       # known once the trainer has read the dataset


def test_a_trainer_start_that_resumed_is_an_event_once():
    """After a restart Step goes back (425 -> 423): the Resumed event says why, once per start."""
    st = status(phase=Phase.Running, observed_generation=1, progress=Progress(step=425, total_steps=900))
    resumed = Progress(step=423, total_steps=900, resumed_from_step=423, resumed_at="2026-01-01T00:05:00Z",
                       last_checkpoint="s3://b/team-a/demo/uid/checkpoints/step-423")
    d = step(job(), st, trainer=TrainerJob(1), pods=RUNNING, rollout_replicas=2, progress=resumed, progress_read=True)
    [event] = [e for e in d.events if e.reason == "Resumed"]
    assert event.message == "the trainer resumed from step 423 (s3://b/team-a/demo/uid/checkpoints/step-423)"
    assert d.status.progress.resumed_from_step == 423
    later = resumed.model_copy(update={"step": 430})
    d = step(job(), d.status, trainer=TrainerJob(1), pods=RUNNING, rollout_replicas=2, progress=later, progress_read=True)
    assert "Resumed" not in reasons(d)
    again = later.model_copy(update={"resumed_from_step": 430, "resumed_at": "2026-01-01T01:00:00Z"})
    d = step(job(), d.status, trainer=TrainerJob(2), pods=RUNNING, rollout_replicas=2, progress=again, progress_read=True)
    assert "Resumed" in reasons(d)


def test_the_status_names_the_run_the_ready_servers_and_the_reason():
    d = step(job(), status(phase=Phase.Running, observed_generation=1), trainer=TrainerJob(0), pods=RUNNING,
             rollout_replicas=2, rollout_ready=1, run_uri="s3://b/team-a/demo/uid")
    assert (d.status.run_uri, d.status.rollout_replicas, d.status.reason) == ("s3://b/team-a/demo/uid", 1, None)
    suspended = step(job(**{"runPolicy.suspend": True}), d.status, trainer=TrainerJob(0), pods=RUNNING,
                     rollout_replicas=2)
    assert suspended.status.reason == find(suspended.status.conditions, "Suspended").reason
