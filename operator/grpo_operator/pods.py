"""What a job's pods say: how many run, why the others don't, and which servers crash (pure,
over API dicts).

A pod stuck Pending says why in two places: the PodScheduled condition (Unschedulable, with the
scheduler's message) and its containers' waiting state (ErrImagePull, ImagePullBackOff,
CreateContainerConfigError, ...). lifecycle.py puts the most telling reason in the job's status
and fails the job when it lasts past runPolicy.pendingDeadlineSeconds.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any

from grpo_api.contracts import BAD_INPUT_EXIT_CODE, STOPPED_EXIT_CODE

from grpo_operator import names

# Waiting reasons that won't fix themselves soon, most specific first.
STUCK_REASONS = ("InvalidImageName", "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError",
                 "CreateContainerError", "ErrImageNeverPull")


@dataclass(frozen=True)
class PodProblem:
    pod: str
    reason: str
    message: str

    def describe(self) -> str:
        return f"pod {self.pod}: {self.reason}" + (f": {self.message}" if self.message else "")

    @property
    def missing_secret(self) -> str | None:
        """The Secret the kubelet can't find for the pod's env/envFrom (CreateContainerConfigError:
        `secret "NAME" not found`), if that is the problem."""
        found = _SECRET_NOT_FOUND.search(self.message) if self.reason == "CreateContainerConfigError" else None
        return found.group(1) if found else None


_SECRET_NOT_FOUND = re.compile(r'secret "([^"]+)" not found')


@dataclass(frozen=True)
class PodExit:
    """A trainer container that exited with an error: its code and the end of its termination
    message (with `terminationMessagePolicy: FallbackToLogsOnError`, the end of its log)."""

    pod: str
    exit_code: int
    reason: str
    message: str

    def describe(self, max_chars: int = 700) -> str:
        """`pod P exited with code C (SIGNAL, reason): the end of its termination message`;
        codes above 128 are a signal's (128+N, as the trainer's launcher and a shell report it)."""
        tail = self.message.strip()[-max_chars:]
        notes = [name for name in (_signal_name(self.exit_code - 128),) if name and self.exit_code > 128]
        notes += [self.reason] if self.reason else []
        head = f"pod {self.pod} exited with code {self.exit_code}" + (f" ({', '.join(notes)})" if notes else "")
        return f"{head}: {tail}" if tail else head


@dataclass(frozen=True)
class ServerFailure:
    """A rollout, reward or sandbox server pod whose container (or `model` init container) crashed
    and hasn't been ready since, or can't start (an image or config error). The kubelet restarts it
    on its own (CrashLoopBackOff), so nothing else says so: lifecycle.py makes it a condition."""

    pod: str
    role: str
    container: str
    reason: str
    """CrashLoopBackOff, the crash's own (Error, OOMKilled) or the waiting one (ImagePullBackOff)."""
    exit_code: int | None
    """The last crash's exit code; None for a container that never ran."""
    restarts: int
    message: str
    """The last crash's termination message (the end of its log: FallbackToLogsOnError), else the
    waiting state's."""
    reward_model: str = ""

    def describe(self, max_chars: int = 700) -> str:
        server = f"reward model {self.reward_model!r}" if self.reward_model else self.role
        head = f"{server} server pod {self.pod} (container {self.container}): {self.reason}"
        head += f", exit code {self.exit_code}" if self.exit_code is not None else ""
        head += f", {self.restarts} restart(s)" if self.restarts else ""
        tail = self.message.strip()[-max_chars:]
        return f"{head}: {tail}" if tail else head


def server_failure(pod: dict[str, Any]) -> ServerFailure | None:
    """Why a server pod's container isn't serving, or None (a trainer pod, a healthy or a deleted
    pod). A container running again after a crash but not ready yet still counts: its crash
    loop would otherwise look healthy between back-offs."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    role = labels.get(names.ROLE_LABEL)
    if role not in (names.ROLLOUT, names.REWARD, names.SANDBOX) or meta.get("deletionTimestamp"):
        return None
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        state = cs.get("state") or {}
        waiting, now = state.get("waiting") or {}, state.get("terminated") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        crash = now if now.get("exitCode") else last if last.get("exitCode") else None
        if waiting.get("reason") in STUCK_REASONS:
            reason, crash = waiting["reason"], None
        elif waiting.get("reason") == "CrashLoopBackOff" or now.get("exitCode"):
            reason = waiting.get("reason") or now.get("reason") or "Error"
        elif crash is not None and not now and not cs.get("ready"):
            reason = crash.get("reason") or "Error"
        else:
            continue
        message = (crash or {}).get("message") or waiting.get("message", "")
        return ServerFailure(meta["name"], role, cs.get("name", ""), reason,
                             crash.get("exitCode") if crash else None, cs.get("restartCount") or 0, message,
                             labels.get(names.REWARD_MODEL_LABEL, ""))
    return None


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


@dataclass(frozen=True)
class PodsView:
    trainer_running: int = 0
    """Trainer pods of the current attempt in phase Running (or already Succeeded)."""
    rollout_running: int = 0
    """Rollout pods in phase Running."""
    problems: tuple[PodProblem, ...] = ()
    """Pending pods of the job with the reason they are stuck (generic 'Pending' last)."""
    trainer_exits: tuple[PodExit, ...] = ()
    """Trainer containers of the current attempt that exited with an error, node rank 0 first."""
    trainer_finished: tuple[str, ...] = ()
    """Trainer pods of the current attempt that have stopped (Failed or Succeeded)."""
    old_trainer: tuple[str, ...] = ()
    """Trainer pods of earlier attempts (a failed attempt's, kept for `kubectl logs`)."""
    server_failures: tuple[ServerFailure, ...] = ()
    """Server pods that crash or can't start: a bad-input exit first, then the most restarted."""


def pod_problem(pod: dict[str, Any]) -> PodProblem | None:
    """Why a Pending pod doesn't run; None for a pod that isn't Pending."""
    status = pod.get("status") or {}
    if status.get("phase", "Pending") != "Pending" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    name = pod["metadata"]["name"]
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS:
            return PodProblem(name, waiting["reason"], waiting.get("message", ""))
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return PodProblem(name, cond.get("reason") or "Unschedulable", cond.get("message", ""))
    return PodProblem(name, "Pending", "")


def pod_exit(pod: dict[str, Any]) -> PodExit | None:
    """The first container of the pod that terminated with a non-zero exit code."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        done = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
        if done.get("exitCode"):
            return PodExit(pod["metadata"]["name"], done["exitCode"], done.get("reason", ""), done.get("message", ""))
    return None


def view(pods: list[dict[str, Any]], *, attempt: int | None) -> PodsView:
    """Summarize the job's pods; trainer pods of other attempts (an old, failed Job's) only
    count as old."""
    trainer_running = rollout_running = 0
    problems, exits, finished, old, failing = [], [], [], [], []
    for pod in sorted(pods, key=_node_rank):
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        role = labels.get(names.ROLE_LABEL)
        phase = (pod.get("status") or {}).get("phase", "Pending")
        if role == names.TRAINER and labels.get(names.ATTEMPT_LABEL) != str(attempt):
            if not meta.get("deletionTimestamp"):
                old.append(meta["name"])
            continue
        if role == names.TRAINER and phase in ("Failed", "Succeeded") and not meta.get("deletionTimestamp"):
            finished.append(meta["name"])
            # a trainer stopped on SIGTERM (replaced by the Job, issue 48) is no failure to report
            if (stopped := pod_exit(pod)) is not None and stopped.exit_code != STOPPED_EXIT_CODE:
                exits.append(stopped)
        if role == names.TRAINER and phase in ("Running", "Succeeded"):
            trainer_running += 1
        elif role == names.ROLLOUT and phase == "Running":
            rollout_running += 1
        problem = pod_problem(pod)
        if problem is not None:
            problems.append(problem)
        if (failure := server_failure(pod)) is not None:
            failing.append(failure)
    # The specific reasons first: they are what the user must fix.
    problems.sort(key=lambda p: (p.reason == "Pending", p.pod))
    failing.sort(key=lambda f: (f.exit_code != BAD_INPUT_EXIT_CODE, -f.restarts, f.pod))
    return PodsView(trainer_running, rollout_running, tuple(problems), tuple(exits), tuple(finished), tuple(old),
                    tuple(failing))


def _node_rank(pod: dict[str, Any]) -> tuple[int, str]:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    index = annotations.get("batch.kubernetes.io/job-completion-index", "")
    return (int(index) if index.isdigit() else 1 << 30, (pod.get("metadata") or {}).get("name", ""))
