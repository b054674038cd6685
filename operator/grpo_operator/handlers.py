"""kopf wiring: which watch events trigger a reconcile, the resync loop, kopf's own settings.
Only I/O glue; the decisions are in lifecycle.py, the API calls in reconciler.py.

Why watch-event handlers (`@kopf.on.event`) and not kopf's create/update/resume handlers and
timers: the reconcile is level-triggered (it reads everything it needs each time), so it needs
none of kopf's per-object bookkeeping. That bookkeeping would cost RBAC (`patch` on grpojobs
for kopf's annotations, a finalizer for timers, which would also make deleting a job hang
while the operator is down) and buy nothing. Resume after a restart is kopf's initial listing:
every existing GRPOJob arrives as an event.

Triggers:
- any change of a GRPOJob (spec, status, deletion);
- any change of a trainer Job or a pod the operator manages (server-side label selector
  `app.kubernetes.io/managed-by=grpo-operator`, so the operator never streams other pods);
- every `resync_seconds`, each known job (reads progress.json, enforces deadlines and TTL);
- the GRPOJob CRD's deletion, seen by a watchdog that stops kopf (serving.py).

Retries: kopf does not retry watch-event handlers, so a failed reconcile (an API error) is
retried by the next event or resync, at most `resync_seconds` later (reconciler.request).
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from grpo_api.spec import API_GROUP, API_VERSION, PLURAL

from grpo_operator import names, serving
from grpo_operator.reconciler import Reconciler
from grpo_operator.settings import OperatorSettings

MANAGED = f"app.kubernetes.io/managed-by={names.MANAGER}"


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler, settings: OperatorSettings,
             stop: asyncio.Event | None = None) -> None:
    """Registers the handlers on `registry` (not kopf's global default). With `stop` (kopf's
    stop flag), a watchdog sets it when the GRPOJob CRD is deleted (serving.py)."""

    @kopf.on.login(registry=registry)
    def login(**kwargs):
        # The official client's config (in-cluster, else KUBECONFIG), as kube.py uses it. Named
        # explicitly: a custom registry has none of kopf's fallback login handlers.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_) -> None:
        # Only the resources known at start (the CRD is installed before the operator) and
        # only the configured namespaces: no list/watch of CRDs or namespaces is needed.
        settings.scanning.disabled = True
        settings.watching.label_selectors["batch", "v1", "jobs"] = MANAGED
        settings.watching.label_selectors["v1", "pods"] = MANAGED
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60
        # Reconciles are blocking API calls (~40 ms each on a busy API server) run in kopf's
        # thread pool; its default (cores + 4 threads) queues a burst of new jobs behind each other.
        settings.execution.max_workers = 32

    @kopf.on.startup(registry=registry)
    async def start_resync(memo: kopf.Memo, **_) -> None:
        memo["resync"] = asyncio.create_task(_resync_loop(reconciler, settings.resync_seconds))
        if stop is not None:
            memo["watchdog"] = asyncio.create_task(serving.watchdog(reconciler.kube, settings.resync_seconds, stop))

    @kopf.on.cleanup(registry=registry)
    async def stop_resync(memo: kopf.Memo, **_) -> None:
        for name in ("resync", "watchdog"):
            task = memo.get(name)
            if task is not None:
                task.cancel()

    @kopf.on.event(API_GROUP, API_VERSION, PLURAL, registry=registry)
    def grpojob_changed(type: str | None, name: str, namespace: str, **_) -> None:
        if type == "DELETED":
            reconciler.forget(namespace, name)
            return
        # type None is kopf's initial listing: a fresh operator process resumes every job.
        reconciler.request(namespace, name, trigger="grpojob", read_progress=type is None)

    @kopf.on.event("batch", "v1", "jobs", labels={"app.kubernetes.io/managed-by": names.MANAGER}, registry=registry)
    def trainer_changed(labels: kopf.Labels, namespace: str, **_) -> None:
        _child_changed(reconciler, labels, namespace, "trainer-job")

    @kopf.on.event("v1", "pods", labels={"app.kubernetes.io/managed-by": names.MANAGER}, registry=registry)
    def pod_changed(labels: kopf.Labels, namespace: str, **_) -> None:
        _child_changed(reconciler, labels, namespace, "pod")


def _child_changed(reconciler: Reconciler, labels, namespace: str, trigger: str) -> None:
    job = labels.get(names.JOB_LABEL)
    if job:
        reconciler.request(namespace, job, trigger=trigger)


async def _resync_loop(reconciler: Reconciler, interval: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        await loop.run_in_executor(None, reconciler.resync)
