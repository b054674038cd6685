"""One reconcile of one GRPOJob: observe (the job, its trainer Job, pods, rollout Deployment,
progress.json), decide (lifecycle.decide, pure), write the status, act, post events.

Level-triggered: every reconcile starts from what the API server says now, so any trigger
(a watch event, the periodic resync, an operator restart) gives the same result and a reconcile
cut short by a crash is finished by the next one. Reconciles of one job never overlap: requests
that arrive while one runs are merged into one more run (`request`).

Callers: handlers.py (kopf watch events and the resync loop).
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from grpo_api.spec import API_GROUP, API_VERSION, KIND, GRPOJob, GRPOJobStatus

from grpo_operator import conditions, lifecycle, manifests, names, pods
from grpo_operator.kube import Kube, KubeError
from grpo_operator.metrics import OperatorMetrics
from grpo_operator.progress import read_progress
from grpo_operator.settings import OperatorSettings
from grpo_operator.validation import parse_grpojob

log = logging.getLogger("grpo.operator")
GJ = (f"{API_GROUP}/{API_VERSION}", KIND)
_POD_MONITOR_API = "monitoring.coreos.com/v1"
_DISCOVERY_TTL = 300.0


class Reconciler:
    def __init__(self, kube: Kube, settings: OperatorSettings, metrics: OperatorMetrics, *,
                 clock: Callable[[], datetime] = conditions.now_utc, env: Mapping[str, str] | None = None):
        self.kube, self.settings, self.metrics = kube, settings, metrics
        self.clock = clock
        self.env = dict(os.environ if env is None else env)
        self._applied: dict[tuple[str, str], tuple[str, int]] = {}   # key -> (uid, generation)
        self._known: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._running: set[tuple[str, str]] = set()
        self._pending: dict[tuple[str, str], bool] = {}              # key -> read progress
        self._pod_monitor_api: tuple[float, bool] | None = None

    # -- triggers ---------------------------------------------------------------------------

    def request(self, namespace: str, name: str, *, trigger: str, read_progress: bool = False) -> None:
        """Reconcile now in this thread, or, when a reconcile of the job is running, make it run
        once more when it ends. Errors are logged and counted, never raised: the next event or
        resync tries again."""
        key = (namespace, name)
        with self._lock:
            self._known.add(key)
            if key in self._running:
                self._pending[key] = self._pending.get(key, False) or read_progress
                return
            self._running.add(key)
        try:
            while True:
                self._timed(key, trigger, read_progress)
                with self._lock:
                    if key not in self._pending:
                        self._running.discard(key)
                        return
                    read_progress = self._pending.pop(key)
                    trigger = "coalesced"
        except BaseException:
            with self._lock:
                self._running.discard(key)
                self._pending.pop(key, None)
            raise

    def resync(self) -> None:
        """Reconcile every known job, reading progress.json (the resync loop calls this)."""
        with self._lock:
            keys = sorted(self._known)
        for namespace, name in keys:
            self.request(namespace, name, trigger="resync", read_progress=True)

    def forget(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        with self._lock:
            self._known.discard(key)
            self._applied.pop(key, None)
        self.metrics.forget(namespace, name)

    def _timed(self, key: tuple[str, str], trigger: str, read_progress: bool) -> None:
        start = time.monotonic()
        try:
            self.reconcile(*key, read_progress=read_progress)
        except KubeError as exc:
            if exc.gone:  # deleted while we looked (or its namespace is): the next event says so
                log.debug("%s/%s: gone during the reconcile: %s", *key, exc)
                return
            kind = "transient" if exc.transient else "permanent"
            self.metrics.reconcile_errors.labels(kind=kind).inc()
            log.log(logging.WARNING if exc.transient else logging.ERROR,
                    "%s/%s: reconcile failed (%s, retried on the next event or resync): %s", *key, kind, exc)
        except Exception:  # noqa: BLE001 - a bug must not stop the other jobs' reconciles
            self.metrics.reconcile_errors.labels(kind="bug").inc()
            log.exception("%s/%s: reconcile failed", *key)
        finally:
            self.metrics.reconcile_seconds.labels(trigger=trigger).observe(time.monotonic() - start)

    # -- one reconcile ----------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str, *, read_progress: bool = False) -> None:
        obj = self.kube.get(*GJ, namespace, name)
        if obj is None:
            self.forget(namespace, name)
            return
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return  # the garbage collector removes the children
        job, errors = parse_grpojob(obj, self.settings)
        old_status = _status(obj)
        observed = self._observe(obj, job, old_status, read_progress)
        decision = lifecycle.decide(job, errors, old_status, observed, self.clock())
        self._write_status(obj, old_status, decision.status)
        self._act(obj, job, decision)
        for event in decision.events:
            self._event(obj, event.type, event.reason, event.message)
        if decision.status.restarts > old_status.restarts:
            self.metrics.restarts.labels(namespace=namespace, job=name).inc(
                decision.status.restarts - old_status.restarts)
        self.metrics.set_phase(namespace, name, decision.status.phase.value)

    def _observe(self, obj: dict, job: GRPOJob | None, status: GRPOJobStatus, read: bool) -> lifecycle.Observed:
        meta = obj["metadata"]
        ns, name, uid, generation = meta["namespace"], meta["name"], meta["uid"], meta.get("generation", 1)
        trainer_obj = self.kube.get("batch/v1", "Job", ns, names.trainer_name(name))
        trainer = None
        if trainer_obj is not None:
            trainer = lifecycle.trainer_job_state(trainer_obj)
            if not _owned_by(trainer_obj, uid):
                # A same-named job's leftover, on its way out: wait for it.
                trainer = lifecycle.TrainerJob(attempt=-1, deleting=True)
        deployment = self.kube.get("apps/v1", "Deployment", ns, names.rollout_name(name))
        replicas = None
        if deployment is not None and _owned_by(deployment, uid):
            replicas = (deployment.get("spec") or {}).get("replicas", 1)
        pod_list = self.kube.list("v1", "Pod", ns, {names.JOB_LABEL: name})
        attempt = trainer.attempt if trainer is not None else status.restarts
        # A finished job's progress.json no longer changes: it is read one last time when the
        # trainer's outcome is first seen (the final step's numbers), then never again.
        finished = status.phase in lifecycle.TERMINAL
        finishing = trainer is not None and trainer.outcome != "active" and not finished
        progress = None
        if job is not None and (finishing or (read and not finished)):
            progress = read_progress(job, self._storage_env(job))
        return lifecycle.Observed(
            generation=generation, trainer=trainer, pods=pods.view(pod_list, attempt=attempt),
            rollout_replicas=replicas, progress=progress,
            children_applied=self._applied.get((ns, name)) == (uid, generation))

    def _write_status(self, obj: dict, old: GRPOJobStatus, new: GRPOJobStatus) -> None:
        old_doc, new_doc = _dump(old), _dump(new)
        if obj.get("status") and old_doc == new_doc:
            return
        meta = obj["metadata"]
        patch: dict[str, Any] = {k: None for k in old_doc if k not in new_doc}
        patch.update(new_doc)
        self.kube.patch_status(*GJ, meta["namespace"], meta["name"], patch)

    def _act(self, obj: dict, job: GRPOJob | None, d: lifecycle.Decision) -> None:
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        kube, settings = self.kube, self.settings
        if d.apply_children and job is not None:
            kube.create(manifests.build_rpc_secret(job, settings, token=secrets.token_hex(32)))
            for child in manifests.build_children(job, settings, pod_monitor=self._pod_monitor_enabled()):
                kube.apply(child)
            self._applied[(ns, name)] = (meta["uid"], meta.get("generation", 1))
        if d.rollout_replicas is not None:
            if job is not None:
                kube.apply(manifests.build_rollout_deployment(job, settings, replicas=d.rollout_replicas))
            else:
                self._scale_rollout_to_zero(ns, name)
        if d.delete_trainer:
            # Foreground: the Job stays until its pods are gone, so its replacement (or, when
            # suspending, the rollout's removal) waits for the trainer's checkpoint.
            kube.delete("batch/v1", "Job", ns, names.trainer_name(name), propagation="Foreground")
        if d.create_trainer is not None and job is not None:
            if kube.create(manifests.build_trainer_job(job, settings, attempt=d.create_trainer)):
                self._event(obj, "Normal", "TrainerCreated",
                            f"created trainer Job {names.trainer_name(name)} (attempt {d.create_trainer})")
        if d.delete_rollout:
            kube.delete("apps/v1", "Deployment", ns, names.rollout_name(name))
        if d.delete_job:
            kube.delete(*GJ, ns, name)

    def _scale_rollout_to_zero(self, ns: str, name: str) -> None:
        """Replicas alone, for a job whose spec became invalid (no manifest to apply)."""
        try:
            self.kube.merge_patch("apps/v1", "Deployment", ns, names.rollout_name(name), {"spec": {"replicas": 0}})
        except KubeError as exc:
            if exc.status != 404:
                raise

    def _event(self, obj: dict, type_: str, reason: str, message: str) -> None:
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s/%s: %s: %s",
                obj["metadata"]["namespace"], obj["metadata"]["name"], reason, message)
        try:
            self.kube.post_event(obj, type_, reason, message, conditions.fmt_time(self.clock()))
        except KubeError as exc:  # an event is worth a log line, not a failed reconcile
            log.warning("can't post event %s: %s", reason, exc)

    # -- helpers ----------------------------------------------------------------------------

    def _pod_monitor_enabled(self) -> bool:
        mode = self.settings.pod_monitor
        if mode != "auto":
            return mode == "true"
        now = time.monotonic()
        if self._pod_monitor_api is None or now - self._pod_monitor_api[0] > _DISCOVERY_TTL:
            self._pod_monitor_api = (now, self.kube.has_api(_POD_MONITOR_API))
        return self._pod_monitor_api[1]

    def _storage_env(self, job: GRPOJob) -> Mapping[str, str]:
        """S3 credentials for reading progress.json: the operator's own, or (when allowed) the
        job's secretRef's."""
        ref = job.spec.storage.secret_ref
        if not (self.settings.read_storage_secrets and ref and job.spec.storage.uri.startswith("s3://")):
            return self.env
        secret = self.kube.get("v1", "Secret", job.metadata.namespace, ref)
        data = (secret or {}).get("data") or {}
        return {**self.env, **{k: base64.b64decode(v).decode() for k, v in data.items() if k.startswith("AWS_")}}


def _owned_by(obj: dict, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def _status(obj: dict) -> GRPOJobStatus:
    try:
        return GRPOJobStatus.model_validate(obj.get("status") or {})
    except ValidationError:
        log.warning("%s/%s: unreadable status, starting afresh", obj["metadata"]["namespace"], obj["metadata"]["name"])
        return GRPOJobStatus()


def _dump(status: GRPOJobStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
