"""What every child of a GRPOJob shares: its metadata and owner reference, environment variables
from the job's Secret, and the pod template (security, the spec volume, the model cache)."""

from __future__ import annotations

import copy
from typing import Any

from grpo_api import model_cache
from grpo_api.rpc import TOKEN_ENV
from grpo_api.spec import GRPOJob

from grpo_operator import names
from grpo_operator.names import SPEC_DIR, SPEC_PATH
from grpo_operator.settings import OperatorSettings
from grpo_operator.templates import merge_pod_template

_SPEC_VOLUME, _SHM_VOLUME, MODEL_VOLUME = "grpo-spec", "dshm", "model-cache"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def object_meta(job: GRPOJob, name: str, component: str) -> dict[str, Any]:
    m = job.metadata
    uid = m.uid
    if not uid:
        raise ValueError(f"GRPOJob {m.namespace}/{m.name}: metadata.uid is needed for the owner reference")
    return names.metadata(m.name, m.namespace, uid, name, component)


def _security(settings: OperatorSettings) -> tuple[dict, dict]:
    uid = settings.run_as_user
    pod = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod, container


def from_secret(job: GRPOJob, env: str, key: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": names.secret_name(job.metadata.name), "key": key}}}


def common_env(job: GRPOJob) -> list[dict[str, Any]]:
    env = [
        from_secret(job, TOKEN_ENV, names.TOKEN_KEY),
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    secret = job.spec.storage.secret_ref
    if secret:
        for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                              ("AWS_SESSION_TOKEN", True)):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}})
    return env


def container_resources(base: dict[str, Any], gpus: int, settings: OperatorSettings) -> dict[str, Any]:
    resources = copy.deepcopy(base)
    if gpus:
        # Extended resources are set as limits; the API server copies them to requests.
        resources.setdefault("limits", {})[settings.gpu_resource] = gpus
    return resources


def pod_template(job: GRPOJob, settings: OperatorSettings, role: str, container: dict[str, Any], *,
                  grace: int, override: dict | None, extra_labels: dict[str, str] | None = None,
                  template_field: str | None = None, fetch_model: bool = True,
                  scratch: tuple[dict, dict] | None = None, **spec: Any) -> dict[str, Any]:
    """scratch: (volume, mount) in place of the shared-memory volume, and a read-only root
    filesystem (the sandbox pods)."""
    pod_security, container_security = _security(settings)
    if scratch:
        container_security = {**container_security, "readOnlyRootFilesystem": True}
    m = job.metadata
    scratch_volume, scratch_mount = scratch or ({"name": _SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                                                  "sizeLimit": settings.shm_size}},
                                                {"name": _SHM_VOLUME, "mountPath": "/dev/shm"})
    container = {
        **container,
        "imagePullPolicy": settings.image_pull_policy,
        # A crash's last log lines become the termination message: the operator copies it into
        # the job's event and condition, which outlive the pod.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security,
        "volumeMounts": [{"name": _SPEC_VOLUME, "mountPath": SPEC_DIR, "readOnly": True}, scratch_mount],
    }
    template = {
        "metadata": {"labels": {**names.labels(m.name, role), **(extra_labels or {})}},
        "spec": {
            **spec,
            "containers": [container],
            "volumes": [
                {"name": _SPEC_VOLUME, "configMap": {"name": names.config_map_name(m.name),
                                                     "items": [{"key": names.SPEC_KEY, "path": names.SPEC_KEY}]}},
                scratch_volume,
            ],
            "securityContext": pod_security,
            "terminationGracePeriodSeconds": grace,
            # The pods never call the Kubernetes API, and service links would flood the env.
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
        },
    }
    if settings.image_pull_secrets:
        template["spec"]["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    fetch = fetch_model and model_cache.needs_fetch(job.spec.model)
    if fetch:
        _add_model_cache(job, template)
    merged = merge_pod_template(template, override, template_field or f"spec.{role}.template")
    if fetch:
        merged["spec"]["initContainers"] = [
            _model_init_container(job, merged["spec"]["containers"][0], container_security)]
    return merged


def _add_model_cache(job: GRPOJob, template: dict[str, Any]) -> None:
    """The model cache volume (the job's claim, else the pod's own emptyDir), read-only in the main
    container, which finds the fetched model through GRPO_MODEL_CACHE."""
    cache = job.spec.model.cache
    source = {"persistentVolumeClaim": {"claimName": cache.claim_name}} if cache else {"emptyDir": {}}
    template["spec"]["volumes"].append({"name": MODEL_VOLUME, **source})
    main = template["spec"]["containers"][0]
    main["volumeMounts"].append({"name": MODEL_VOLUME, "mountPath": model_cache.MOUNT_PATH, "readOnly": True})
    main["env"].append({"name": model_cache.CACHE_ENV, "value": model_cache.MOUNT_PATH})


def _model_init_container(job: GRPOJob, main: dict[str, Any], security: dict[str, Any]) -> dict[str, Any]:
    """`grpo model fetch` in the main container's image, writing the cache: the pod starts once its
    model is there. Least privilege: it gets the main container's environment (storage credentials,
    HF_TOKEN or a proxy from the template) without the job's own Secret (token, TLS key, checkpoint
    key) and without the tracker's Secret: a fetch needs neither."""
    job_secret, tracker = names.secret_name(job.metadata.name), job.spec.trainer.tracker_secret_ref
    env = [e for e in main["env"]
           if ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name") != job_secret]
    env_from = [e for e in main.get("envFrom", []) if not (tracker and (e.get("secretRef") or {}).get("name") == tracker)]
    return {"name": "model", "image": main["image"], "imagePullPolicy": main["imagePullPolicy"],
            "command": ["grpo"], "args": ["model", "fetch", "--spec", SPEC_PATH],
            "env": copy.deepcopy(env), **({"envFrom": copy.deepcopy(env_from)} if env_from else {}),
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": security,
            "volumeMounts": [{"name": _SPEC_VOLUME, "mountPath": SPEC_DIR, "readOnly": True},
                             {"name": MODEL_VOLUME, "mountPath": model_cache.MOUNT_PATH}]}
