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
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from grpo_api import signing
from grpo_api.spec import API_GROUP, API_VERSION, KIND, GRPOJob, GRPOJobStatus
from grpo_api.storage import job_root

from grpo_operator import conditions, lifecycle, manifests, names, pods
from grpo_operator.kube import Kube, KubeError
from grpo_operator.metrics import OperatorMetrics
from grpo_operator.pki import make_job_tls
from grpo_operator.progress import read_progress
from grpo_operator.server_logs import keep_server_logs
from grpo_operator.settings import OperatorSettings
from grpo_operator.validation import parse_grpojob

log = logging.getLogger("grpo.operator")
GJ = (f"{API_GROUP}/{API_VERSION}", KIND)
_POD_MONITOR_API = "monitoring.coreos.com/v1"
_KUEUE_API = "kueue.x-k8s.io/v1beta2"
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
        self._apis: dict[str, tuple[float, bool]] = {}              # group/version -> (when, served)
        self._progress_errors: dict[tuple[str, str], str] = {}
        self._pinned: dict[tuple[str, str], tuple[str, OperatorSettings]] = {}  # key -> (uid, the job's)

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
        """Reconcile every known job, reading progress.json (the resync loop calls this); counted
        in grpo_operator_resyncs_total once done (metrics.py says what that count proves)."""
        with self._lock:
            keys = sorted(self._known)
        for namespace, name in keys:
            self.request(namespace, name, trigger="resync", read_progress=True)
        self.metrics.resyncs.inc()

    def forget(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        with self._lock:
            self._known.discard(key)
            self._applied.pop(key, None)
            self._progress_errors.pop(key, None)
            self._pinned.pop(key, None)
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
        settings = self._job_settings(obj)
        job, errors = parse_grpojob(obj, settings)
        old_status = _status(obj)
        # Checked once per spec generation, as an admission check would: a discovery hiccup
        # later must not fail a running job.
        if job is not None and job.spec.run_policy.scheduling_policy is not None \
                and old_status.observed_generation != meta.get("generation", 1) \
                and not self._has_api(names.POD_GROUP_API):
            job, errors = None, [
                "spec.runPolicy.schedulingPolicy: gang scheduling needs scheduler-plugins' PodGroup CRD "
                "(podgroups.scheduling.x-k8s.io), which this cluster lacks; install scheduler-plugins "
                "or remove schedulingPolicy"]
        observed = self._observe(obj, job, old_status, read_progress, settings)
        decision = lifecycle.decide(job, errors, old_status, observed, self.clock())
        self._write_status(obj, old_status, decision.status)
        self._act(obj, job, decision, settings)
        for event in decision.events:
            self._event(obj, event.type, event.reason, event.message)
        if decision.status.restarts > old_status.restarts:
            self.metrics.restarts.labels(namespace=namespace, job=name).inc(
                decision.status.restarts - old_status.restarts)
        self.metrics.set_phase(namespace, name, decision.status.phase.value)

    def _job_settings(self, obj: dict) -> OperatorSettings:
        """The operator settings this job's children are built with: the current ones, with the
        job defaults (images, resources, ...: settings.JOB_DEFAULTS) pinned when the job was first
        reconciled. The pin is in the job's `<job>-spec` ConfigMap (the first child applied, before
        any pod exists), so it survives an operator restart, and a `helm upgrade` of the chart's
        jobDefaults reaches new jobs only. Read once per job and operator process."""
        meta = obj["metadata"]
        key, uid = (meta["namespace"], meta["name"]), meta["uid"]
        with self._lock:
            cached = self._pinned.get(key)
        if cached is not None and cached[0] == uid:
            return cached[1]
        config_map = self.kube.get("v1", "ConfigMap", key[0], names.config_map_name(key[1]))
        pinned = ((config_map or {}).get("data") or {}).get(names.DEFAULTS_KEY) \
            if config_map is not None and _owned_by(config_map, uid) else None
        settings = self.settings
        if pinned is not None:
            try:
                settings = self.settings.with_job_defaults(json.loads(pinned))
            except (ValueError, TypeError) as exc:
                log.warning("%s/%s: unreadable %s in ConfigMap %s (%s): pinning the current defaults", *key,
                            names.DEFAULTS_KEY, names.config_map_name(key[1]), exc)
        with self._lock:
            if key in self._known:   # not one forgotten (deleted) meanwhile
                self._pinned[key] = (uid, settings)
        return settings

    def _observe(self, obj: dict, job: GRPOJob | None, status: GRPOJobStatus, read: bool,
                 settings: OperatorSettings) -> lifecycle.Observed:
        meta = obj["metadata"]
        ns, name, uid, generation = meta["namespace"], meta["name"], meta["uid"], meta.get("generation", 1)
        trainer_obj = self.kube.get("batch/v1", "Job", ns, names.trainer_name(name))
        trainer = None
        if trainer_obj is not None:
            trainer = lifecycle.trainer_job_state(trainer_obj)
            if not _owned_by(trainer_obj, uid):
                # A same-named job's leftover, on its way out: wait for it.
                trainer = lifecycle.TrainerJob(attempt=-1, deleting=True)
        kueue_message = None
        if trainer is not None and trainer.suspended and self._has_api(_KUEUE_API):
            kueue_message = self._why_not_admitted(ns, trainer_obj["metadata"]["uid"])
        deployment = self.kube.get("apps/v1", "Deployment", ns, _followed_deployment(job, name))
        replicas, ready = None, 0
        if deployment is not None and _owned_by(deployment, uid):
            replicas = (deployment.get("spec") or {}).get("replicas", 1)
            ready = (deployment.get("status") or {}).get("readyReplicas") or 0
        # Only a valid job's pods are looked at: an invalid name (over-long, admitted by an older
        # CRD) is no valid label value, and an invalid job only needs its pods stopped.
        pod_list = self.kube.list("v1", "Pod", ns, {names.JOB_LABEL: name}) if job is not None else []
        if job is not None and job.spec.colocated:
            ready = _colocated_ready(job, pod_list)
        attempt = trainer.attempt if trainer is not None else status.restarts
        # A finished job's progress.json no longer changes: it is read one last time when the
        # trainer's outcome is first seen (the final step's numbers), then never again.
        finished = status.phase in lifecycle.TERMINAL
        finishing = trainer is not None and trainer.outcome != "active" and not finished
        progress = progress_error = None
        read_now = job is not None and (finishing or (read and not finished))
        hint = ""
        if read_now:
            env, progress_error = self._storage_env(job)
            if progress_error is None:
                progress, progress_error = read_progress(job, env)
            hint = self._progress_hint(job, progress_error)
            self._log_progress_error((ns, name), progress_error)
        return lifecycle.Observed(
            generation=generation, trainer=trainer, pods=pods.view(pod_list, attempt=attempt),
            rollout_replicas=replicas, rollout_ready=ready, progress=progress, progress_error=progress_error if read_now else None,
            progress_read=read_now, children_applied=self._applied.get((ns, name)) == (uid, generation),
            kueue_message=kueue_message,
            runs_with=runs_with(settings),
            progress_hint=hint, missing_secret_grace_seconds=self.settings.missing_secret_grace_seconds,
            run_uri=job_root(job, local=False) if job is not None and job.spec.storage.uri else None)

    def _why_not_admitted(self, ns: str, job_uid: str) -> str | None:
        """Kueue's reason for not admitting the trainer Job (no quota, no such LocalQueue, ...):
        the QuotaReserved condition of the Workload it made for the Job. Read at each reconcile
        of a waiting job (the resync), since the operator doesn't watch Workloads."""
        for workload in self.kube.list(_KUEUE_API, "Workload", ns, {"kueue.x-k8s.io/job-uid": job_uid}):
            for c in (workload.get("status") or {}).get("conditions") or []:
                if c.get("type") == "QuotaReserved" and c.get("status") == "False" and c.get("message"):
                    return c["message"]
        return None

    def _log_progress_error(self, key: tuple[str, str], error: str | None) -> None:
        """Once per job and reason, not at every resync: the status condition carries it."""
        if error is not None and self._progress_errors.get(key) != error:
            log.warning("%s/%s: can't read progress: %s", *key, error)
        if error is None:
            self._progress_errors.pop(key, None)
        else:
            self._progress_errors[key] = error

    def _write_status(self, obj: dict, old: GRPOJobStatus, new: GRPOJobStatus) -> None:
        old_doc, new_doc = _dump(old), _dump(new)
        if obj.get("status") and old_doc == new_doc:
            return
        meta = obj["metadata"]
        patch: dict[str, Any] = {k: None for k in old_doc if k not in new_doc}
        patch.update(new_doc)
        self.kube.patch_status(*GJ, meta["namespace"], meta["name"], patch)

    def _act(self, obj: dict, job: GRPOJob | None, d: lifecycle.Decision, settings: OperatorSettings) -> None:
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        kube = self.kube
        if d.apply_children and job is not None:
            kube.create(manifests.build_rpc_secret(job, settings, token=secrets.token_hex(32),
                                                   checkpoint_key=signing.new_key(),
                                                   tls=make_job_tls(name, _server_names(job))))
            for child in manifests.build_children(job, settings, pod_monitor=self._pod_monitor_enabled()):
                kube.apply(child)
            self._applied[(ns, name)] = (meta["uid"], meta.get("generation", 1))
        if (d.rollout_replicas == 0 or d.delete_rollout) and job is not None:
            self._keep_server_logs(obj, job)        # before the pods go with their logs
        if d.rollout_replicas is not None:
            if job is not None:
                if not job.spec.colocated:          # colocated: the trainer pods run the servers
                    kube.apply(manifests.build_rollout_deployment(job, settings, replicas=d.rollout_replicas))
                # The reward and sandbox servers live as long as the rollout servers, their only callers.
                for deployment in manifests.build_rollout_dependencies(job, settings,
                                                                     rollout_replicas=d.rollout_replicas):
                    kube.apply(deployment)
            else:
                self._scale_rollout_to_zero(obj)
        if d.delete_trainer:
            kept = d.keep_pods if settings.keep_failed_trainer_pods else ()
            for pod in kept:
                # Owned by the GRPOJob too, the pod outlives its Job (the garbage collector keeps
                # a dependent that still has an owner) and goes with the GRPOJob at the latest.
                kube.add_owner_reference("v1", "Pod", ns, pod, names.owner_reference(name, meta["uid"], controller=False))
            # Foreground: the Job stays until its pods are gone, so its replacement (or, when
            # suspending, the rollout's removal) waits for the trainer's checkpoint. A failed
            # Job's kept pods have stopped already.
            kube.delete("batch/v1", "Job", ns, names.trainer_name(name),
                        propagation="Background" if kept else "Foreground")
        for pod in d.delete_pods:
            kube.delete("v1", "Pod", ns, pod)
        if d.create_trainer is not None and job is not None:
            if kube.create(manifests.build_trainer_job(job, settings, attempt=d.create_trainer)):
                self._event(obj, "Normal", "TrainerCreated",
                            f"created trainer Job {names.trainer_name(name)} (attempt {d.create_trainer})")
        if d.delete_rollout:
            kube.delete("apps/v1", "Deployment", ns, names.rollout_name(name))
            for deployment in _dependent_deployments(obj):
                kube.delete("apps/v1", "Deployment", ns, deployment)
        if d.delete_job:
            kube.delete(*GJ, ns, name)

    def _scale_rollout_to_zero(self, obj: dict) -> None:
        """Replicas alone, for a job whose spec became invalid (no manifest to apply): the rollout
        Deployment and those of the servers it calls."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        for deployment in [names.rollout_name(name), *_dependent_deployments(obj)]:
            try:
                self.kube.merge_patch("apps/v1", "Deployment", ns, deployment, {"spec": {"replicas": 0}})
            except KubeError as exc:
                if exc.status != 404:
                    raise

    def _keep_server_logs(self, obj: dict, job: GRPOJob) -> None:
        """The reward and sandbox pods' logs into the run (server_logs); one Warning event naming
        the pods whose log could not be kept, and why."""
        if not (job.spec.reward.reward_models or manifests.sandbox_replicas(job)):
            return
        env, _ = self._storage_env(job)
        try:
            failed = keep_server_logs(self.kube, job, env)
        except KubeError as exc:             # the pods can't be listed: a log line, not a failed reconcile
            failed = [f"listing the pods: {exc}"]
        if failed:
            self._event(obj, "Warning", "ServerLogsNotKept",
                        f"the logs of the reward and sandbox pods are not kept in the run ({'; '.join(failed)[:800]}); "
                        f"the operator writes them with its storage credentials (operator.readStorageSecrets, "
                        f"operator.storageCredentialsSecret)")

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
        return self._has_api(_POD_MONITOR_API)

    def _has_api(self, group_version: str) -> bool:
        """API discovery, cached for a while: CRDs come and go rarely."""
        now = time.monotonic()
        cached = self._apis.get(group_version)
        if cached is None or now - cached[0] > _DISCOVERY_TTL:
            cached = self._apis[group_version] = (now, self.kube.has_api(group_version))
        return cached[1]

    def _uses_storage_secret(self, job: GRPOJob) -> bool:
        ref = job.spec.storage.secret_ref
        return bool(self.settings.read_storage_secrets and ref and job.spec.storage.uri.startswith("s3://"))

    def _storage_env(self, job: GRPOJob) -> tuple[Mapping[str, str], str | None]:
        """S3 credentials for reading progress.json: the operator's own, or (when allowed) the
        job's secretRef's; and why not, when that Secret doesn't exist."""
        if not self._uses_storage_secret(job):
            return self.env, None
        ref = job.spec.storage.secret_ref
        secret = self.kube.get("v1", "Secret", job.metadata.namespace, ref)
        if secret is None:
            return self.env, f'secret "{ref}" not found (spec.storage.secretRef)'
        data = secret.get("data") or {}
        return {**self.env, **{k: base64.b64decode(v).decode() for k, v in data.items() if k.startswith("AWS_")}}, None

    def _progress_hint(self, job: GRPOJob, error: str | None) -> str:
        """What fixes an unreadable progress.json, given how this operator reads it (issue 36: it
        told an admin to set operator.readStorageSecrets=true, which was set)."""
        if error is None:
            return ""
        if self._uses_storage_secret(job):
            return (f"The operator reads it with the Secret spec.storage.secretRef names "
                    f"({job.spec.storage.secret_ref!r}, operator.readStorageSecrets=true): create it, or give it "
                    f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY that can read spec.storage")
        return lifecycle.DEFAULT_PROGRESS_HINT


def runs_with(settings: OperatorSettings) -> str:
    """The job's pinned images for its Created condition, and how to change them: a job created
    during a bad `helm upgrade` keeps that upgrade's images after `helm rollback` (issue 48)."""
    return (f"trainer image {settings.trainer_image}, rollout image {settings.rollout_image}; another rollout "
            "image for this job: the image of spec.rollout.template's container (a running job takes it), "
            "another trainer image only in a new job (spec.trainer.template)")


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


def _followed_deployment(job: GRPOJob | None, name: str) -> str:
    """The Deployment whose replicas the lifecycle decides: the rollout servers'; for a colocated
    job, which has none, the reward or sandbox servers' that follow them (scaled to 0 when the job
    ends)."""
    if job is not None and job.spec.colocated:
        if job.spec.reward.reward_models:
            return names.reward_model_name(name, job.spec.reward.reward_models[0].name)
        if manifests.sandbox_replicas(job):
            return names.sandbox_name(name)
    return names.rollout_name(name)


def _colocated_ready(job: GRPOJob, pod_list: list[dict]) -> int:
    """status.rolloutReplicas of a colocated job: the servers of its ready trainer pods (a pod
    is ready once its servers are: the supervisor starts torchrun only then)."""
    def ready(pod: dict) -> bool:
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (pod.get("status") or {}).get("conditions") or [])
    trainers = [p for p in pod_list if (p["metadata"].get("labels") or {}).get(names.ROLE_LABEL) == names.TRAINER]
    return job.spec.servers_per_node * sum(map(ready, trainers))


def _server_names(job: GRPOJob) -> list[str]:
    """The names in the job's server certificate: the rollout Service's (the trainer checks the
    first) and each reward model's Service (the rollout servers dial those by name)."""
    m = job.metadata
    return [*names.rollout_dns_names(m.name, m.namespace),
            *names.reward_dns_names(m.name, m.namespace, [rm.name for rm in job.spec.reward.reward_models]),
            *(names.sandbox_dns_names(m.name, m.namespace) if manifests.sandbox_replicas(job) else [])]


def _dependent_deployments(obj: dict) -> list[str]:
    """The reward models' and the python sandbox's Deployments by the API object's spec, read without
    parsing it (a spec that became invalid still names them; the operator may not list Deployments)."""
    spec, name = obj.get("spec") or {}, obj["metadata"]["name"]
    models = (spec.get("reward") or {}).get("rewardModels") or []
    out = [names.reward_model_name(name, m["name"]) for m in models
           if isinstance(m, dict) and isinstance(m.get("name"), str)]
    tools = ((spec.get("rollout") or {}).get("multiTurn") or {}).get("tools") or []
    if isinstance(tools, list) and "python" in tools:
        out.append(names.sandbox_name(name))
    return out
