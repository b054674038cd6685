"""metav1.Condition-style conditions on a GRPOJob's status, and the time format they use.

A condition's `lastTransitionTime` changes only when its `status` does (as in Kubernetes), so it
also records since when something holds: the pending deadline is measured from the
`PodsPending` condition's transition.

Condition types the operator sets:

    Created      the children (ConfigMap, Secret, Services, NetworkPolicy, ...) exist
    Running      all trainer pods run
    PodsPending  some pod the job waits for is not running (reason: ImagePullBackOff,
                 Unschedulable, ...); the pending deadline counts from its transition
    Queued       the trainer Job is suspended until Kueue admits it (reason WaitingForAdmission);
                 False (reason Admitted) once admitted
    Suspended    spec.runPolicy.suspend took effect (reason Suspending while the trainer stops)
    Succeeded    the trainer finished
    Failed       the job failed for good (reason: BackoffLimitExceeded, DeadlineExceeded, BadInput:
                 the trainer exited 2 and said why, not retried, ...)
    Invalid      the spec got past the CRD schema but not the operator's validation
    TrainerFailed  a trainer attempt failed: the exit code (with its signal), the kubelet's
                 reason (OOMKilled) and the end of its log or the trainer's `error:` line (the
                 termination message); False again, with the same message, once the next
                 attempt runs
    SecretMissing  a Secret the job's pods need doesn't exist (reason SecretNotFound, the message
                 names it and the field: `secret "x" not found (spec.storage.secretRef)`); the
                 job fails once it lasts the operator's missing_secret_grace_seconds
    ServersFailing  a rollout, reward or sandbox server pod crash-loops or can't start (reason
                 RolloutServerFailing, RewardServerFailing, SandboxServerFailing; the message names
                 the pod, the container's state, its exit code and the end of its log); the job
                 fails at once on a server's bad-input exit (2), else once it lasts
                 (lifecycle.SERVER_RESTART_LIMIT); False (ServersRecovered) once they serve
    ProgressUnreadable  the operator can't read progress.json (no storage credentials, most
                 often): why the Step, Reward and Val columns stay empty
"""

from __future__ import annotations

from datetime import datetime, timezone

from grpo_api.spec import Condition


def now_utc() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def fmt_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def find(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: list[Condition], type_: str) -> bool:
    c = find(conditions, type_)
    return c is not None and c.status == "True"


def set_condition(conditions: list[Condition], type_: str, status: bool, reason: str, message: str,
                  now: datetime) -> list[Condition]:
    """A new list with `type_` set; its lastTransitionTime moves only when its status changes."""
    value = "True" if status else "False"
    old = find(conditions, type_)
    since = old.last_transition_time if old is not None and old.status == value else fmt_time(now)
    new = Condition(type=type_, status=value, reason=reason, message=message[:1024], last_transition_time=since)
    if old is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


def true_since(conditions: list[Condition], type_: str) -> datetime | None:
    c = find(conditions, type_)
    return parse_time(c.last_transition_time) if c is not None and c.status == "True" else None
