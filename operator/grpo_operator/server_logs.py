"""The logs of a job's reward and sandbox pods, kept in its run as the rollout pods keep theirs
(`<run>/logs/<pod>.log`), written by the operator just before it scales or deletes them away.

Those pods can't keep their own (grpo_rollout.log_mirror): they hold no storage credentials, by
design, and the sandbox pods may reach nothing at all (docs/RELIABILITY.md). The operator reads
their logs through the API (pods/log) and writes them with the storage credentials it reads
progress.json with, which must then be allowed to write (the chart's
operator.readStorageSecrets, or an operator.storageCredentialsSecret that can write).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_api.records import RunLayout
from grpo_api.spec import GRPOJob
from grpo_api.storage import Storage, job_root

from grpo_operator import names
from grpo_operator.kube import KubeError

ROLES = (names.REWARD, names.SANDBOX)


def keep_server_logs(kube: Any, job: GRPOJob, env: Mapping[str, str]) -> list[str]:
    """Write each reward and sandbox pod's log into the run; the pods whose log could not be kept,
    each with why (never the credentials: storage errors name the operation and the URI)."""
    m = job.metadata
    layout = RunLayout(job_root(job, local=False))
    storage = Storage(job.spec.storage, env=env, attempts=2, backoff_seconds=0.2)
    failed = []
    for role in ROLES:
        for pod in kube.list("v1", "Pod", m.namespace, names.selector(m.name, role)):
            name = pod["metadata"]["name"]
            try:
                data = _log(kube, m.namespace, name, pod)
                if data is not None:
                    storage.write_bytes(layout.log(name), data)
            except (KubeError, OSError) as exc:
                failed.append(f"{name}: {exc}")
    return failed


def _log(kube: Any, namespace: str, name: str, pod: dict) -> bytes | None:
    """The container's log, after the one before its last restart (a crash's traceback) if any."""
    now = kube.pod_log(namespace, name)
    restarts = sum(s.get("restartCount", 0) for s in (pod.get("status") or {}).get("containerStatuses") or [])
    if now is None or not restarts:
        return now
    try:
        before = kube.pod_log(namespace, name, previous=True) or b""
    except KubeError:          # the kubelet keeps one earlier container's log at most, maybe none
        before = b""
    return (f"[the container before restart {restarts}]\n".encode() + before
            + f"[the container since restart {restarts}]\n".encode() + now)
