"""The GRPOJob state machine: from the job, its last status and what its children look like
now, decide the new status and what to change. Pure (no I/O, the clock is an argument);
reconciler.py observes, calls `decide` and carries the decision out.

    Pending ──► Running ──► Succeeded                (rollout scaled to zero)
       │  ▲        │
       │  └─ Restarting ◄─ trainer Job failed, restarts < runPolicy.backoffLimit
       │           │
       └───────────┴──► Failed   backoff limit, activeDeadlineSeconds, pendingDeadlineSeconds,
                                 or an invalid spec (no children at all)
    runPolicy.suspend: trainer Job deleted first (it checkpoints on SIGTERM), then the rollout
    Deployment ──► Suspended; unsuspended ──► Pending, resumed from the checkpoint.
    Kueue: while the trainer Job is suspended (created so, waiting for Kueue to admit it, or
    suspended again when Kueue preempts it) the job is Pending with condition Queued, the
    rollout Deployment is at zero and no deadline runs; admitted ──► as any trainer Job.

Restarts are counted once per failed trainer Job: the Job is labelled with the restart count
it was created at (`grpo.dev/attempt`), so a failure already counted (the operator died
before replacing the Job) is not counted again. The status is written before the children
are changed, for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from grpo_api.spec import Condition, GRPOJob, GRPOJobStatus, Phase, Progress

from grpo_operator import conditions as cond
from grpo_operator import names
from grpo_operator.pods import PodsView

TERMINAL = (Phase.Succeeded, Phase.Failed)


@dataclass(frozen=True)
class TrainerJob:
    """The trainer Job as far as the lifecycle cares."""

    attempt: int
    outcome: Literal["active", "succeeded", "failed"] = "active"
    deleting: bool = False
    reason: str = ""
    message: str = ""
    suspended: bool = False
    """spec.suspend: not admitted (by Kueue) yet, or preempted."""


def trainer_job_state(obj: dict[str, Any]) -> TrainerJob:
    """Read a batch/v1 Job: its attempt label and its Complete/Failed condition."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    try:
        attempt = int((meta.get("labels") or {}).get(names.ATTEMPT_LABEL, "0"))
    except ValueError:
        attempt = 0
    outcome, reason, message = "active", "", ""
    for c in status.get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            outcome = "succeeded"
        elif c.get("type") == "Failed":
            outcome, reason, message = "failed", c.get("reason", ""), c.get("message", "")
    return TrainerJob(attempt, outcome, bool(meta.get("deletionTimestamp")), reason, message,
                      suspended=bool((obj.get("spec") or {}).get("suspend")))


@dataclass(frozen=True)
class Observed:
    generation: int
    trainer: TrainerJob | None = None
    pods: PodsView = PodsView()
    rollout_replicas: int | None = None
    """spec.replicas of the rollout Deployment; None when there is none."""
    rollout_ready: int = 0
    """Ready rollout servers (the Deployment's readyReplicas): the scale subresource's status."""
    progress: Progress | None = None
    """progress.json as just read; None when not read this time (the status keeps the last)."""
    progress_read: bool = False
    """Whether progress.json was read this time."""
    progress_error: str | None = None
    """Why it couldn't be read (storage the operator has no access to); None when it could."""
    children_applied: bool = False
    """Whether this operator process applied the children at this generation already."""
    kueue_message: str | None = None
    """Why Kueue doesn't admit the suspended trainer Job (its Workload's QuotaReserved message)."""
    runs_with: str = ""
    """The pinned operator defaults the job's pods are built with, in words (its images)."""
    progress_hint: str = ""
    """What would let the operator read progress.json (said with progress_error)."""
    missing_secret_grace_seconds: float = 60.0
    """How long pods may wait for a Secret that doesn't exist before the job fails."""
    run_uri: str | None = None
    """Where the job's files are (grpo_api.storage.job_root): status.runUri."""


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Decision:
    status: GRPOJobStatus
    apply_children: bool = False
    create_trainer: int | None = None
    """Create the trainer Job with this attempt number."""
    delete_trainer: bool = False
    keep_pods: tuple[str, ...] = ()
    """A failed attempt's trainer pods, to keep (for `kubectl logs`) when the Job is deleted."""
    delete_pods: tuple[str, ...] = ()
    """Kept pods of earlier attempts, to delete now that the next attempt runs."""
    rollout_replicas: int | None = None
    """Apply the rollout Deployment with these replicas."""
    delete_rollout: bool = False
    delete_job: bool = False
    """The TTL after the job finished ran out: delete the GRPOJob itself."""
    events: list[Event] = field(default_factory=list)


class _Draft:
    """The status being decided, plus the actions; mutated by the steps below."""

    def __init__(self, status: GRPOJobStatus, now: datetime):
        self.now = now
        self.old = status
        self.phase: Phase = status.phase
        self.conditions: list[Condition] = list(status.conditions)
        self.progress = status.progress
        self.restarts = status.restarts
        self.start_time = status.start_time
        self.completion_time = status.completion_time
        self.d = Decision(status=status)

    def set(self, type_: str, status: bool, reason: str, message: str = "") -> None:
        self.conditions = cond.set_condition(self.conditions, type_, status, reason, message, self.now)

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.d.events.append(Event(type_, reason, message))

    def finish(self, phase: Phase, reason: str, message: str) -> None:
        self.phase = phase
        self.completion_time = self.completion_time or cond.fmt_time(self.now)
        ok = phase == Phase.Succeeded
        self.set(phase.value, True, reason, message)
        self.set("Running", False, phase.value, "")
        if cond.find(self.conditions, "PodsPending"):
            self.set("PodsPending", False, phase.value, "")
        if ok and cond.is_true(self.conditions, "ServersFailing"):   # a failure keeps it: it may be the cause
            self.set("ServersFailing", False, phase.value, "")
        self.event("Normal" if ok else "Warning", reason, message)

    def decision(self, obs: Observed) -> Decision:
        self.d.status = GRPOJobStatus(
            phase=self.phase, conditions=self.conditions, progress=self.progress, restarts=self.restarts,
            start_time=self.start_time, completion_time=self.completion_time, observed_generation=obs.generation,
            reason=_reason(self.conditions), rollout_replicas=obs.rollout_ready, run_uri=obs.run_uri)
        return self.d


# The conditions that say why a job isn't simply running, most telling first.
_REASON_CONDITIONS = ("Failed", "Invalid", "SecretMissing", "PodsPending", "ServersFailing", "Queued", "Suspended",
                      "TrainerFailed", "ProgressUnreadable")


def _reason(conditions: list[Condition]) -> str | None:
    """The Reason column: the reason of the first of _REASON_CONDITIONS that holds."""
    holding = {c.type: c.reason for c in conditions if c.status == "True"}
    return next((holding[t] for t in _REASON_CONDITIONS if holding.get(t)), None)


def decide(job: GRPOJob | None, errors: list[str], status: GRPOJobStatus, obs: Observed, now: datetime
           ) -> Decision:
    """The new status and the actions for one reconcile. `errors` non-empty means the spec is
    invalid (job may be None then)."""
    s = _Draft(status, now)
    if obs.progress is not None:
        _resumed(s, status.progress, obs.progress)
        s.progress = obs.progress
    total = job.spec.trainer.total_steps if job is not None else None
    if total is not None and (s.progress is None or s.progress.total_steps is None):
        # The Total column from the first second, before the trainer's first report.
        s.progress = (s.progress or Progress()).model_copy(update={"total_steps": total})
    if obs.progress_read:
        _progress_readable(s, obs.progress_error, obs.progress_hint or DEFAULT_PROGRESS_HINT)
    if errors:
        _invalid(s, errors, obs)
    elif s.phase in TERMINAL:
        _keep_down(s, obs)
    elif job.spec.run_policy.suspend and not _trainer_finished(obs):
        _suspend(s, obs)
    else:
        _run(s, job, obs, status)
    if s.phase in TERMINAL and job is not None:
        ttl = job.spec.run_policy.ttl_seconds_after_finished
        done = cond.parse_time(s.completion_time)
        if ttl is not None and done is not None and now >= done + timedelta(seconds=ttl):
            s.d.delete_job = True
            s.event("Normal", "TTLExpired", f"deleting the job {ttl}s after it finished (runPolicy.ttlSecondsAfterFinished)")
    return s.decision(obs)


def _resumed(s: _Draft, old: Progress | None, new: Progress) -> None:
    """Each start of the trainer that continued from a checkpoint (a restart, a suspend, a
    preemption) is an event: Step went back to that checkpoint's step."""
    if new.resumed_at is not None and (old is None or old.resumed_at != new.resumed_at):
        s.event("Normal", "Resumed", f"the trainer resumed from step {new.resumed_from_step} "
                                     f"({new.last_checkpoint or 'its latest checkpoint'})")


DEFAULT_PROGRESS_HINT = ("Give the operator read access to spec.storage (Helm values operator.storageCredentialsSecret, "
                         "or operator.readStorageSecrets=true to use spec.storage.secretRef)")


def _progress_readable(s: _Draft, error: str | None, hint: str = DEFAULT_PROGRESS_HINT) -> None:
    """Step, Reward and Val come from progress.json: say why they stay empty."""
    if error is None:
        if cond.find(s.conditions, "ProgressUnreadable"):
            s.set("ProgressUnreadable", False, "ProgressRead", "")
        return
    message = f"the operator can't read the job's progress.json, so Step, Reward and Val stay empty: {error}. {hint}"
    if not cond.is_true(s.conditions, "ProgressUnreadable"):
        s.event("Warning", "ProgressUnreadable", message)
    s.set("ProgressUnreadable", True, "StorageUnreadable", message)


def _trainer_finished(obs: Observed) -> bool:
    t = obs.trainer
    return t is not None and not t.deleting and t.outcome != "active"


def _keep_down(s: _Draft, obs: Observed) -> None:
    """A finished job holds no GPUs: no active trainer, rollout at zero."""
    if obs.trainer is not None and obs.trainer.outcome == "active" and not obs.trainer.deleting:
        s.d.delete_trainer = True
    if obs.rollout_replicas:
        s.d.rollout_replicas = 0


def _invalid(s: _Draft, errors: list[str], obs: Observed) -> None:
    if not cond.is_true(s.conditions, "Invalid"):
        message = "; ".join(errors)
        s.set("Invalid", True, "InvalidSpec", message)
        s.finish(Phase.Failed, "InvalidSpec", message)
    _keep_down(s, obs)


def _suspend(s: _Draft, obs: Observed) -> None:
    """Trainer first (it checkpoints on SIGTERM and needs the rollout servers until then), then
    the rollout Deployment."""
    t = obs.trainer
    if t is not None:
        if not t.deleting:
            s.d.delete_trainer = True
        reason, message = "Suspending", "waiting for the trainer to checkpoint and stop"
    else:
        if obs.rollout_replicas is not None:
            s.d.delete_rollout = True
        reason, message = "Suspended", "runPolicy.suspend is true; set it to false to resume from the checkpoint"
    if s.phase != Phase.Suspended:
        s.event("Normal", "Suspended", "runPolicy.suspend is true: stopping the trainer (it checkpoints), then the rollout servers")
    s.phase = Phase.Suspended
    s.set("Suspended", True, reason, message)
    s.set("Running", False, "Suspended", "")
    for type_ in ("PodsPending", "ServersFailing"):
        if cond.find(s.conditions, type_):
            s.set(type_, False, "Suspended", "")


def _run(s: _Draft, job: GRPOJob, obs: Observed, old: GRPOJobStatus) -> None:
    if s.phase == Phase.Suspended:
        s.event("Normal", "Resumed", "runPolicy.suspend is false: recreating the pods, resuming from the checkpoint")
        s.set("Suspended", False, "Resumed", "")
        s.start_time = None  # as a Kubernetes Job's: the active deadline counts from the resume
        s.phase = Phase.Pending
    t = obs.trainer
    queued = names.queue_name(job) is not None
    waiting = (t is None and queued) or (t is not None and not t.deleting and t.suspended)
    # The rollout servers start once the trainer is admitted: a queued job holds no GPUs.
    replicas = 0 if waiting else job.spec.rollout.replicas
    if obs.generation != old.observed_generation or not obs.children_applied:
        s.d.apply_children = True
        s.d.rollout_replicas = replicas
        runs_with = (f"; the pods run with the operator's defaults as of the job's first reconcile "
                     f"({obs.runs_with}; all in ConfigMap {names.config_map_name(job.metadata.name)}, "
                     f"key {names.DEFAULTS_KEY})") if obs.runs_with else ""
        s.set("Created", True, "ChildrenApplied", "ConfigMap, Secret, Services and policies are in place" + runs_with)
    if obs.rollout_replicas != replicas:
        s.d.rollout_replicas = replicas

    waiting_phase = Phase.Restarting if s.restarts else Phase.Pending
    if t is None or t.deleting:
        if t is None:
            s.d.create_trainer = s.restarts
            s.start_time = None if queued else s.start_time or cond.fmt_time(s.now)
        s.phase = waiting_phase
        if waiting:
            _wait_for_admission(s, job, obs)
        else:
            s.set("Running", False, s.phase.value, "waiting for the trainer Job")
            _pods_pending(s, True, obs)
            _missing_secret(s, job, obs, True)
    elif t.outcome == "succeeded":
        s.d.rollout_replicas = 0
        s.finish(Phase.Succeeded, "TrainerSucceeded", "the trainer finished")
        return
    elif t.outcome == "failed":
        _trainer_failed(s, job, t, obs)
        if s.phase in TERMINAL:
            if obs.rollout_replicas:
                s.d.rollout_replicas = 0
            return
    elif t.suspended:
        s.phase = waiting_phase
        _wait_for_admission(s, job, obs)
    else:
        if cond.is_true(s.conditions, "Queued"):
            s.set("Queued", False, "Admitted", "the trainer Job was admitted")
            s.event("Normal", "Admitted", "the trainer Job was admitted: starting the trainer and rollout pods")
        s.start_time = s.start_time or cond.fmt_time(s.now)
        running = obs.pods.trainer_running >= job.spec.trainer.nnodes
        rollout_ok = replicas == 0 or obs.pods.rollout_running > 0
        if running and s.phase != Phase.Running:
            s.event("Normal", "Running", f"all {job.spec.trainer.nnodes} trainer pod(s) run")
        if running:
            s.d.delete_pods = obs.pods.old_trainer
            last = cond.find(s.conditions, "TrainerFailed")
            if last is not None and last.status == "True":
                s.set("TrainerFailed", False, "TrainerRunning", f"attempt {s.restarts} runs; the last failure: "
                      f"{last.message}")
        s.phase = Phase.Running if running else waiting_phase
        s.set("Running", running, "TrainerRunning" if running else "PodsNotRunning",
              "" if running else "waiting for the trainer pods to run")
        _pods_pending(s, not (running and rollout_ok), obs)
        _missing_secret(s, job, obs, not (running and rollout_ok))
    if _servers_failing(s, obs, serving=replicas > 0):
        return
    _deadlines(s, job, obs)


def _wait_for_admission(s: _Draft, job: GRPOJob, obs: Observed) -> None:
    """The trainer Job is suspended until Kueue admits it: no pods, so nothing is pending and no
    deadline runs; as a Kubernetes Job's, the active deadline counts from the admission."""
    queue = names.queue_name(job)
    by = f"Kueue LocalQueue {queue!r}" if queue else "the admission controller that suspended it (Kueue?)"
    message = f"the trainer Job waits for {by} to admit it; the rollout servers start then"
    if obs.kueue_message:
        message += f". Kueue: {obs.kueue_message}"
    if not cond.is_true(s.conditions, "Queued"):
        s.event("Normal", "WaitingForAdmission", message)
    s.start_time = None
    s.set("Queued", True, "WaitingForAdmission", message)
    s.set("Running", False, "WaitingForAdmission", message)
    if cond.find(s.conditions, "PodsPending"):
        s.set("PodsPending", False, "WaitingForAdmission", "")


def _trainer_failed(s: _Draft, job: GRPOJob, t: TrainerJob, obs: Observed) -> None:
    limit = job.spec.run_policy.backoff_limit
    exits = obs.pods.trainer_exits
    bad = next((e for e in exits if e.exit_code == BAD_INPUT_EXIT_CODE), None)
    if bad is not None or t.reason == "PodFailurePolicy":
        # The trainer refused its input (exit 2: the spec, the data, the model, a checkpoint):
        # the pod failure policy failed the Job at once, and no restart can help either.
        cause = bad.describe() if bad is not None else (f"{t.reason}: {t.message}" if t.message else t.reason)
        s.set("TrainerFailed", True, "BadInput", f"attempt {t.attempt}: {cause}")
        s.finish(Phase.Failed, "BadInput", f"the trainer refused its input (exit code {BAD_INPUT_EXIT_CODE}; "
                                           f"not retried: fix the spec and create the job again): {cause}")
        return
    # What the trainer said last (the end of its log) says more than the Job's own "reached the
    # specified backoff limit" (its backoffLimit is 0: the restarts are the operator's).
    exit_ = exits[0] if exits else None
    if exit_ is not None:
        detail = exit_.describe()
        reason = exit_.reason if exit_.reason not in ("", "Error") else (t.reason or "Failed")
    else:
        detail = f"{t.reason}: {t.message}" if t.message else (t.reason or "failed")
        reason = t.reason or "Failed"
    if t.attempt >= s.restarts:  # not counted (and said) before the operator restarted
        s.set("TrainerFailed", True, reason, f"attempt {t.attempt}: {detail}")
    if t.attempt < s.restarts:
        s.d.delete_trainer = True  # counted before the operator restarted; only replace it
        s.d.keep_pods = obs.pods.trainer_finished
        s.phase = Phase.Restarting
    elif s.restarts < limit:
        s.restarts += 1
        s.d.delete_trainer = True
        s.d.keep_pods = obs.pods.trainer_finished
        s.phase = Phase.Restarting
        s.set("Running", False, "TrainerFailed", detail)
        s.event("Warning", "TrainerFailed",
                f"trainer failed ({detail}); restart {s.restarts} of {limit}, resuming from the latest checkpoint")
    else:
        s.finish(Phase.Failed, "BackoffLimitExceeded",
                 f"the trainer failed {s.restarts + 1} time(s) (runPolicy.backoffLimit={limit}); last: {detail}")


def secret_field(job: GRPOJob, secret: str) -> str:
    """Which field of the job names `secret` (for a message that says what to fix)."""
    if secret == job.spec.storage.secret_ref:
        return "spec.storage.secretRef"
    if secret == job.spec.trainer.tracker_secret_ref:
        return "spec.trainer.trackerSecretRef"
    return "a pod template's env or envFrom (spec.trainer.template, spec.rollout.template)"


def _missing_secret(s: _Draft, job: GRPOJob, obs: Observed, waiting: bool) -> None:
    """A Secret the job's pods need that doesn't exist: condition SecretMissing (reason
    SecretNotFound) naming it and the field, from the kubelet's CreateContainerConfigError; the
    job fails once it lasts missing_secret_grace_seconds (_deadlines)."""
    problem = next((p for p in obs.pods.problems if p.missing_secret), None) if waiting else None
    if problem is None:
        if cond.is_true(s.conditions, "SecretMissing"):
            s.set("SecretMissing", False, "SecretFound", "")
        return
    message = f'secret "{problem.missing_secret}" not found ({secret_field(job, problem.missing_secret)})'
    old = cond.find(s.conditions, "SecretMissing")
    if old is None or old.status != "True" or old.message != message:
        s.event("Warning", "SecretNotFound", f"{message}: pod {problem.pod} can't start; the job fails if it is "
                                             f"still missing {obs.missing_secret_grace_seconds:g}s after the first sign")
    s.set("SecretMissing", True, "SecretNotFound", message)


SERVER_RESTART_LIMIT = 3
SERVER_FAILING_SECONDS = 300
"""A server that crashed at least SERVER_RESTART_LIMIT times and hasn't served for
SERVER_FAILING_SECONDS (the ServersFailing condition's age) fails the job: by then the kubelet's
back-off has retried it four times, and the trainer, which waits 900 s for a server, would
only use a restart and then blame the network. Both bounds, so that the one crash of a server
that ran for hours (whose restart count grew over days) has the time to load its model again."""

_SERVER_REASONS = {names.ROLLOUT: "RolloutServerFailing", names.REWARD: "RewardServerFailing",
                   names.SANDBOX: "SandboxServerFailing"}


def _servers_failing(s: _Draft, obs: Observed, serving: bool) -> bool:
    """A server pod that crash-loops or can't start: condition ServersFailing naming it, with its
    exit code and the end of its log, and a Warning event. A server that refused its input (exit 2:
    a missing model path, a reward function that can't be imported) fails the job at once, as the
    trainer's bad input does; any other crash once it lasts (SERVER_RESTART_LIMIT). True when the
    job failed."""
    failures = obs.pods.server_failures if serving else ()
    if not failures:
        if cond.is_true(s.conditions, "ServersFailing"):
            s.set("ServersFailing", False, "ServersRecovered", "")
        return False
    first = failures[0]
    reason = _SERVER_REASONS[first.role]
    message = first.describe() + (f" (and {len(failures) - 1} more failing server pod(s))" if len(failures) > 1 else "")
    old = cond.find(s.conditions, "ServersFailing")
    s.set("ServersFailing", True, reason, message)
    since = cond.true_since(s.conditions, "ServersFailing")
    if first.exit_code == BAD_INPUT_EXIT_CODE:
        why = (f"a server refused its input (exit code {BAD_INPUT_EXIT_CODE}; not retried: fix the spec and create "
               f"the job again)")
    elif first.restarts >= SERVER_RESTART_LIMIT and s.now >= since + timedelta(seconds=SERVER_FAILING_SECONDS):
        why = f"a server kept failing ({first.restarts} restarts, not serving for {(s.now - since).total_seconds():.0f}s)"
    else:
        if old is None or old.status != "True" or old.reason != reason:
            s.event("Warning", reason, message)
        return False
    _fail_now(s, obs, reason, f"{why}: {message}")    # its event says it all
    return True


def _pods_pending(s: _Draft, waiting: bool, obs: Observed) -> None:
    if not waiting:
        if cond.find(s.conditions, "PodsPending"):
            s.set("PodsPending", False, "PodsRunning", "")
        return
    problem = obs.pods.problems[0] if obs.pods.problems else None
    reason = problem.reason if problem else "Pending"
    message = problem.describe() if problem else "waiting for the pods to be created and scheduled"
    old = cond.find(s.conditions, "PodsPending")
    if problem and reason != "Pending" and (old is None or old.status != "True" or old.reason != reason):
        s.event("Warning", reason, message)
    s.set("PodsPending", True, reason, message)


def _deadlines(s: _Draft, job: GRPOJob, obs: Observed) -> None:
    rp = job.spec.run_policy
    missing_since = cond.true_since(s.conditions, "SecretMissing")
    if missing_since is not None and s.now >= missing_since + timedelta(seconds=obs.missing_secret_grace_seconds):
        c = cond.find(s.conditions, "SecretMissing")
        _fail_now(s, obs, "SecretNotFound", f"{c.message}: the pods can't start without it (still missing after "
                                            f"{obs.missing_secret_grace_seconds:g}s); create it, or fix the field, "
                                            f"and create the job again")
        return
    started = cond.parse_time(s.start_time)
    if rp.active_deadline_seconds is not None and started is not None \
            and s.now >= started + timedelta(seconds=rp.active_deadline_seconds):
        _fail_now(s, obs, "DeadlineExceeded",
                  f"the job ran longer than runPolicy.activeDeadlineSeconds={rp.active_deadline_seconds}")
        return
    pending_since = cond.true_since(s.conditions, "PodsPending")
    if rp.pending_deadline_seconds is not None and pending_since is not None \
            and s.now >= pending_since + timedelta(seconds=rp.pending_deadline_seconds):
        c = cond.find(s.conditions, "PodsPending")
        _fail_now(s, obs, "PendingDeadlineExceeded",
                  f"pods pending longer than runPolicy.pendingDeadlineSeconds={rp.pending_deadline_seconds}: "
                  f"{c.reason}: {c.message}")


def _fail_now(s: _Draft, obs: Observed, reason: str, message: str) -> None:
    """Fail a job whose pods may still exist: stop them all."""
    s.d.create_trainer = None
    if obs.trainer is not None and not obs.trainer.deleting and obs.trainer.outcome == "active":
        s.d.delete_trainer = True
    s.d.rollout_replicas = 0 if obs.rollout_replicas else None
    s.finish(Phase.Failed, reason, message)
