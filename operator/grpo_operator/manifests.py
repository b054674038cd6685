"""The children of a GRPOJob as plain manifests (docs/ARCHITECTURE.md §4). Pure functions: no I/O, the same
input always gives the same dict; the reconciler applies them (reconciler.Reconciler._act).

    <job>-spec      ConfigMap   the resolved spec; the pods read it at /etc/grpo/job.yaml. And
                                the operator defaults (images, resources, ...) the job's pods
                                are built with, pinned at its first reconcile
    <job>-rpc       Secret      the per-job gRPC token, TLS CA and server certificate, and
                                checkpoint key (created once, never re-applied)
    <job>-trainer   Service     headless; the trainer pods' subdomain (rendezvous at index 0)
    <job>-trainer   Job         Indexed: one pod per node, pod index = torchrun node rank
    <job>-rollout   Deployment  rollout servers
    <job>-rollout   Service     headless; the trainer re-resolves it every step
    <job>-rollout   NetworkPolicy  who reaches the rollout pods
    <job>-trainer   NetworkPolicy  who reaches the trainer pods (c10d, NCCL, metrics)
    <job>-rm-<name> Deployment  a reward model's servers (spec.reward.rewardModels[], `grpo reward`)
    <job>-rm-<name> Service     headless; the rollout servers dial it (gRPC's dns resolver, round robin)
    <job>-reward    NetworkPolicy  only the job's rollout pods reach the reward servers' gRPC
    <job>-sandbox   Deployment  the `python` tool's sandbox servers (spec.rollout.multiTurn.python, `grpo sandbox`)
    <job>-sandbox   Service     headless; the rollout servers dial it
    <job>-sandbox   NetworkPolicy  no egress at all; ingress only from the job's rollout pods
    <job>           PodMonitor  when the monitoring.coreos.com CRDs exist
    <job>-trainer   PodGroup    with spec.runPolicy.schedulingPolicy (gang scheduling)

A model to fetch (spec.model.cache, or a model in object storage) gives every trainer and rollout
pod a `model` init container, `grpo model fetch`, and the cache volume (grpo_api.model_cache).

Kueue: a GRPOJob labelled `kueue.x-k8s.io/queue-name` gets a trainer Job created suspended,
with that label, for Kueue's batch/Job integration to admit (docs/ARCHITECTURE.md §4).

torchrun is wired the way Kubeflow Trainer and JobSet wire it: a static rendezvous at node 0's
stable DNS name, with both the flags and the PET_* variables torchrun reads.

Every builder takes the job as parsed from the API object (its metadata carries the uid the
owner reference needs) and the operator settings.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from grpo_api import model_cache, signing
from grpo_api.jobfile import dump_job
from grpo_api.rpc import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TLS_SERVER_NAME_ENV, TOKEN_ENV
from grpo_api.spec import GRPOJob, ObjectMeta
from grpo_api.storage import job_root

from grpo_operator import names
from grpo_operator.names import (GRPC_PORT, MASTER_PORT, METRICS_PORT, REWARD, ROLLOUT, SANDBOX, SPEC_DIR, SPEC_PATH,
                                 TRAINER)
from grpo_operator.pki import JobTLS
from grpo_operator.settings import OperatorSettings
from grpo_operator.templates import merge_pod_template

LOG_URI_ENV = "GRPO_LOG_URI"    # grpo_rollout.log_mirror (the operator doesn't import the rollout package)

_SPEC_VOLUME, _SHM_VOLUME, _MODEL_VOLUME = "grpo-spec", "dshm", "model-cache"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
TRAINER_COMMAND = ["grpo", "trainer", "--torchrun"]
BAD_INPUT_EXIT_CODE = 2
"""The trainer's exit code for input it refuses (grpo_trainer.commands): retrying can't help."""


def _meta(job: GRPOJob, name: str, component: str) -> dict[str, Any]:
    m = job.metadata
    uid = m.uid
    if not uid:
        raise ValueError(f"GRPOJob {m.namespace}/{m.name}: metadata.uid is needed for the owner reference")
    return names.metadata(m.name, m.namespace, uid, name, component)


# --- configuration ---------------------------------------------------------------------------

def pod_job(job: GRPOJob) -> GRPOJob:
    """What the pods read: the spec with defaults filled in, named (the uid places the run's
    files: grpo_api.storage.job_root), without status or API bookkeeping (managedFields, ...)."""
    meta = ObjectMeta(name=job.metadata.name, namespace=job.metadata.namespace, uid=job.metadata.uid)
    return GRPOJob(metadata=meta, spec=job.spec)


def build_config_map(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """The resolved spec the pods read, and the operator defaults the job's pods are built with
    (pinned when the job was first reconciled: reconciler.Reconciler._job_settings reads them
    back, so a changed operator default never reaches a running job)."""
    m = job.metadata
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(job, names.config_map_name(m.name), "spec"),
            "data": {names.SPEC_KEY: dump_job(pod_job(job)),
                     names.DEFAULTS_KEY: json.dumps(settings.job_defaults(), indent=2, sort_keys=True) + "\n"}}


def build_rpc_secret(job: GRPOJob, settings: OperatorSettings, *, token: str, checkpoint_key: str,
                     tls: JobTLS) -> dict[str, Any]:
    """The secrets are arguments (kept pure); the reconciler makes them (`secrets.token_hex`,
    `grpo_api.signing.new_key`, `pki.make_job_tls`) and creates the Secret once: it is never
    re-applied, so running pods keep a valid token, certificate and key."""
    m = job.metadata
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(job, names.secret_name(m.name), "rpc"),
            "stringData": {names.TOKEN_KEY: token, names.CHECKPOINT_KEY_KEY: checkpoint_key,
                           names.CA_CERT_KEY: tls.ca_cert, names.TLS_CERT_KEY: tls.cert, names.TLS_KEY_KEY: tls.key}}


# --- services --------------------------------------------------------------------------------

def _headless(job: GRPOJob, name: str, role: str, ports: list[dict], publish_not_ready: bool,
              selector: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(job, name, role),
            "spec": {"clusterIP": "None", "selector": selector or names.selector(job.metadata.name, role),
                     "publishNotReadyAddresses": publish_not_ready, "ports": ports}}


def build_trainer_service(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Not-ready addresses are published: every node must resolve node 0 before any is ready."""
    return _headless(job, names.trainer_name(job.metadata.name), TRAINER, [
        {"name": "c10d", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"},
    ], publish_not_ready=True)


def build_rollout_service(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Only ready servers (model loaded) are in DNS, so the trainer never dispatches to a
    loading one."""
    return _headless(job, names.rollout_name(job.metadata.name), ROLLOUT, [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"},
    ], publish_not_ready=False)


def build_reward_service(job: GRPOJob, settings: OperatorSettings, model: str) -> dict[str, Any]:
    """One reward model's servers; only ready ones (model loaded) are in DNS."""
    m = job.metadata
    service = _headless(job, names.reward_model_name(m.name, model), REWARD, [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"},
    ], publish_not_ready=False, selector=names.reward_selector(m.name, model))
    service["metadata"]["labels"][names.REWARD_MODEL_LABEL] = model
    return service


def build_sandbox_service(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """The python tool's sandbox servers; only ready ones are in DNS."""
    return _headless(job, names.sandbox_name(job.metadata.name), SANDBOX, [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"},
    ], publish_not_ready=False)


# --- pods ------------------------------------------------------------------------------------

def _security(settings: OperatorSettings) -> tuple[dict, dict]:
    uid = settings.run_as_user
    pod = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod, container


def _from_secret(job: GRPOJob, env: str, key: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": names.secret_name(job.metadata.name), "key": key}}}


def _trainer_secrets(job: GRPOJob) -> list[dict[str, Any]]:
    """The trainer verifies the rollout servers against the job's CA (it dials pod IPs: the
    name to check is the Service's) and signs and verifies checkpoints with the job's key."""
    m = job.metadata
    return [_from_secret(job, TLS_CA_ENV, names.CA_CERT_KEY),
            {"name": TLS_SERVER_NAME_ENV, "value": names.rollout_dns_names(m.name, m.namespace)[0]},
            _from_secret(job, signing.KEY_ENV, names.CHECKPOINT_KEY_KEY)]


def _rollout_secrets(job: GRPOJob) -> list[dict[str, Any]]:
    """The rollout servers serve TLS; they never get the checkpoint key (they run the user's
    reward code, and could otherwise sign a checkpoint)."""
    return [_from_secret(job, TLS_CERT_ENV, names.TLS_CERT_KEY), _from_secret(job, TLS_KEY_ENV, names.TLS_KEY_KEY)]


def _common_env(job: GRPOJob) -> list[dict[str, Any]]:
    env = [
        _from_secret(job, TOKEN_ENV, names.TOKEN_KEY),
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    secret = job.spec.storage.secret_ref
    if secret:
        for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                              ("AWS_SESSION_TOKEN", True)):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}})
    return env


def _log_uri_env(job: GRPOJob) -> list[dict[str, Any]]:
    """Where a rollout pod keeps its log after the job scales it away (grpo_rollout.log_mirror).
    A job without storage.uri is refused on Kubernetes; `grpo validate` builds its pods anyway."""
    if job.spec.storage.uri is None:
        return []
    return [{"name": LOG_URI_ENV, "value": f"{job_root(job, local=False)}/logs/$(POD_NAME).log"}]


def _tracker_env_from(job: GRPOJob) -> dict[str, Any]:
    """The wandb/mlflow credentials and endpoints, every key of the job's Secret as a variable
    of the trainer (only rank 0 logs, but every node runs the same pod). By reference: the values
    never pass through the spec, the ConfigMap or the status. Explicit `env` wins over `envFrom`,
    so such a Secret can't rewire the pods."""
    secret = job.spec.trainer.tracker_secret_ref
    return {"envFrom": [{"secretRef": {"name": secret}}]} if secret else {}


def _resources(base: dict[str, Any], gpus: int, settings: OperatorSettings) -> dict[str, Any]:
    resources = copy.deepcopy(base)
    if gpus:
        # Extended resources are set as limits; the API server copies them to requests.
        resources.setdefault("limits", {})[settings.gpu_resource] = gpus
    return resources


def _pod_template(job: GRPOJob, settings: OperatorSettings, role: str, container: dict[str, Any], *,
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
    template["spec"]["volumes"].append({"name": _MODEL_VOLUME, **source})
    main = template["spec"]["containers"][0]
    main["volumeMounts"].append({"name": _MODEL_VOLUME, "mountPath": model_cache.MOUNT_PATH, "readOnly": True})
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
                             {"name": _MODEL_VOLUME, "mountPath": model_cache.MOUNT_PATH}]}


def trainer_gpus(job: GRPOJob) -> int:
    t = job.spec.trainer
    return 0 if t.device == "cpu" else t.nproc_per_node


def rollout_gpus(job: GRPOJob) -> int:
    """vLLM needs its tensor-parallel GPUs; the hf engine is the CPU/dev engine."""
    r = job.spec.rollout
    return r.tensor_parallel_size if r.engine == "vllm" else 0


def torchrun_args(job: GRPOJob) -> list[str]:
    m, t = job.metadata, job.spec.trainer
    return [f"--nnodes={t.nnodes}", f"--nproc-per-node={t.nproc_per_node}",
            "--node-rank=$(JOB_COMPLETION_INDEX)",
            f"--master-addr={names.master_addr(m.name)}", f"--master-port={MASTER_PORT}",
            "--no-python", "grpo", "trainer", "--spec", SPEC_PATH,
            "--rollout", names.rollout_address(m.name, m.namespace),
            "--metrics-port", str(METRICS_PORT)]


def _torchrun_env(job: GRPOJob) -> list[dict[str, Any]]:
    """The PET_* variables torchrun reads (the same values as its flags)."""
    m, t = job.metadata, job.spec.trainer
    return [
        {"name": "PET_NNODES", "value": str(t.nnodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(t.nproc_per_node)},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{COMPLETION_INDEX_LABEL}']"}}},
        {"name": "PET_MASTER_ADDR", "value": names.master_addr(m.name)},
        {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)},
    ]


def _gang(job: GRPOJob, settings: OperatorSettings) -> tuple[dict[str, str], dict[str, Any]]:
    """The trainer pods' pod-group label and scheduler fields when they are gang-scheduled."""
    policy = job.spec.run_policy.scheduling_policy
    if policy is None:
        return {}, {}
    spec: dict[str, Any] = {"schedulerName": settings.gang_scheduler_name}
    if policy.priority_class:
        spec["priorityClassName"] = policy.priority_class
    return {names.POD_GROUP_LABEL: names.trainer_name(job.metadata.name)}, spec


def build_trainer_job(job: GRPOJob, settings: OperatorSettings, *, attempt: int = 0) -> dict[str, Any]:
    """The Indexed Job. backoffLimit 0: the operator owns restarts (runPolicy.backoffLimit),
    each one a fresh Job resuming from the latest checkpoint. `attempt` (the restarts so far)
    labels the Job and its pods. Queued in Kueue (a queue-name label), it is created suspended:
    Kueue unsuspends it when it admits it."""
    m, t = job.metadata, job.spec.trainer
    name = names.trainer_name(m.name)
    attempt_label = {names.ATTEMPT_LABEL: str(attempt)}
    gang_labels, gang_spec = _gang(job, settings)
    container = {
        "name": TRAINER,
        "image": settings.trainer_image,
        # torchrun, run by `grpo trainer --torchrun`: the container exits with the failed worker's
        # own code (2: bad input) where torchrun would exit 1 (grpo_trainer.commands.torchrun).
        "command": TRAINER_COMMAND,
        "args": torchrun_args(job),
        "env": [*_torchrun_env(job), *_common_env(job), *_trainer_secrets(job)],
        **_tracker_env_from(job),
        "ports": [{"name": "c10d", "containerPort": MASTER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": _resources(settings.trainer_resources, trainer_gpus(job), settings),
    }
    template = _pod_template(job, settings, TRAINER, container,
                             grace=settings.trainer_termination_grace_seconds, override=t.template,
                             extra_labels={**attempt_label, **gang_labels}, restartPolicy="Never",
                             subdomain=name, **gang_spec)
    meta = _meta(job, name, TRAINER)
    meta["labels"].update({**attempt_label, **names.kueue_labels(job)})
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {
        "completionMode": "Indexed",
        "completions": t.nnodes,
        "parallelism": t.nnodes,
        "backoffLimit": 0,
        # A replacement pod starts only once the old one is gone: its GPUs and its rendezvous
        # hostname are free by then.
        "podReplacementPolicy": "Failed",
        # Preemption, eviction and node drains are not the trainer's fault: the Job controller
        # replaces the pod without failing the Job (it resumes from the checkpoint). Bad input
        # (exit 2: the spec, the data, the model, a checkpoint) can't go away by retrying: the
        # Job fails with reason PodFailurePolicy, and the operator fails the GRPOJob at once.
        # (A pod failure policy needs restartPolicy Never, which the pods have.)
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": TRAINER, "operator": "In",
                                                  "values": [BAD_INPUT_EXIT_CODE]}},
        ]},
        "template": template,
        **({"suspend": True} if names.queue_name(job) is not None else {}),
    }}


def build_rollout_deployment(job: GRPOJob, settings: OperatorSettings, *, replicas: int | None = None
                             ) -> dict[str, Any]:
    """`replicas` defaults to spec.rollout.replicas (0 once the job finished)."""
    m, r = job.metadata, job.spec.rollout
    name = names.rollout_name(m.name)
    container = {
        "name": ROLLOUT,
        "image": settings.rollout_image,
        "command": ["grpo"],
        "args": ["rollout", "--spec", SPEC_PATH, "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT),
                 "--worker-id", "$(POD_NAME)"],
        "env": [*_common_env(job), *_rollout_secrets(job), *_client_env(job), *_log_uri_env(job)],
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": _resources(settings.rollout_resources, rollout_gpus(job), settings),
        # The gRPC Health RPC needs the job's token, which a kubelet probe can't send: the
        # server answers the same readiness (model loaded, weights at a known version) on
        # its metrics port.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "metrics"},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        # Liveness waits until the server first got ready: loading a large model may take an hour.
        "startupProbe": {"httpGet": {"path": "/ready", "port": "metrics"},
                         "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 360},
        # A Generate call still in flight after twice the trainer's request timeout (the trainer
        # gave up on it long ago) means the engine hangs: restart the server.
        "livenessProbe": {"httpGet": {"path": f"/live?stuckAfterSeconds={2 * r.request_timeout_seconds:g}",
                                      "port": "metrics"},
                          "periodSeconds": 30, "timeoutSeconds": 5, "failureThreshold": 2},
    }
    template = _pod_template(job, settings, ROLLOUT, container,
                             grace=settings.rollout_termination_grace_seconds, override=r.template)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(job, name, ROLLOUT), "spec": {
        "replicas": r.replicas if replicas is None else replicas,
        "selector": {"matchLabels": names.selector(m.name, ROLLOUT)},
        # GPUs are scarce: replace pods one at a time instead of surging past the quota.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        "revisionHistoryLimit": 2,
        "template": template,
    }}


def _client_env(job: GRPOJob) -> list[dict[str, Any]]:
    """The servers the rollout servers call: the reward models' (one dns:/// name per model) and the
    python tool's sandbox servers, with the job's CA to check them by (the name checked is the
    Service's, which the certificate carries)."""
    m = job.metadata
    env = []
    models = [rm.name for rm in job.spec.reward.reward_models]
    if models:
        env.append({"name": names.REWARD_ADDRESSES_ENV,
                    "value": ";".join(f"{model}={names.reward_address(m.name, m.namespace, model)}" for model in models)})
    if sandbox_replicas(job):
        env.append({"name": names.SANDBOX_ADDRESSES_ENV, "value": names.sandbox_address(m.name, m.namespace)})
    return [*env, _from_secret(job, TLS_CA_ENV, names.CA_CERT_KEY)] if env else []


def sandbox_replicas(job: GRPOJob) -> int:
    return job.spec.rollout.multi_turn.sandbox_replicas(kubernetes=True)


def build_reward_deployment(job: GRPOJob, settings: OperatorSettings, index: int, *, replicas: int | None = None
                            ) -> dict[str, Any]:
    """spec.reward.rewardModels[index]'s servers, `grpo reward` in the rollout image. `replicas`
    defaults to the model's replicas (0 while the rollout servers are at 0: a finished or queued
    job holds no GPUs). They get the job's token and TLS certificate, not the checkpoint key nor the
    storage credentials (they read only their model). With spec.model.cache the cache volume is
    mounted read-only, so a reward model placed in it is found; the reward model's path is a
    local folder (nothing to fetch, so no init container)."""
    m, rm = job.metadata, job.spec.reward.reward_models[index]
    name = names.reward_model_name(m.name, rm.name)
    container = {
        "name": REWARD,
        "image": settings.rollout_image,
        "command": ["grpo"],
        "args": ["reward", "--spec", SPEC_PATH, "--model", rm.name, "--port", str(GRPC_PORT),
                 "--metrics-port", str(METRICS_PORT)],
        "env": [_from_secret(job, TOKEN_ENV, names.TOKEN_KEY),
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "PYTHONUNBUFFERED", "value": "1"}, *_rollout_secrets(job)],
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": _resources(settings.rollout_resources, rm.gpus, settings),
        # As the rollout server's: the gRPC Health RPC needs the token; /ready on the metrics port
        # answers 200 once the model is loaded and serving.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "metrics"},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "startupProbe": {"httpGet": {"path": "/ready", "port": "metrics"},
                         "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 360},
        "livenessProbe": {"httpGet": {"path": "/live", "port": "metrics"},
                          "periodSeconds": 30, "timeoutSeconds": 5, "failureThreshold": 2},
    }
    template = _pod_template(job, settings, REWARD, container, grace=settings.rollout_termination_grace_seconds,
                             override=rm.template, extra_labels={names.REWARD_MODEL_LABEL: rm.name},
                             template_field=f"spec.reward.rewardModels[{index}].template", fetch_model=False)
    cache = job.spec.model.cache
    if cache:
        spec = template["spec"]
        spec["volumes"].append({"name": _MODEL_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}})
        spec["containers"][0]["volumeMounts"].append(
            {"name": _MODEL_VOLUME, "mountPath": model_cache.MOUNT_PATH, "readOnly": True})
    meta = _meta(job, name, REWARD)
    meta["labels"][names.REWARD_MODEL_LABEL] = rm.name
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
        "replicas": rm.replicas if replicas is None else replicas,
        "selector": {"matchLabels": names.reward_selector(m.name, rm.name)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        "revisionHistoryLimit": 2,
        "template": template,
    }}


def build_sandbox_deployment(job: GRPOJob, settings: OperatorSettings, *, replicas: int | None = None
                             ) -> dict[str, Any]:
    """The python tool's sandbox servers, `grpo sandbox` in the rollout image, for model-written code
    (docs/RELIABILITY.md). Least privilege: the job's token and server certificate (to serve the
    rollout servers), nothing else: no storage credentials, no checkpoint key, no model, no
    service-account token, a read-only root filesystem with a size-limited /tmp; the
    `<job>-sandbox` NetworkPolicy lets nothing out. The memory limit fits `concurrency` programs
    at their address-space limit. `replicas` defaults to spec.rollout.multiTurn.python's."""
    m, py = job.metadata, job.spec.rollout.multi_turn.python
    name = names.sandbox_name(m.name)
    memory = f"{py.concurrency * py.memory_mb + 256}Mi"
    container = {
        "name": SANDBOX,
        "image": settings.rollout_image,
        "command": ["grpo"],
        "args": ["sandbox", "--spec", SPEC_PATH, "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT)],
        "env": [_from_secret(job, TOKEN_ENV, names.TOKEN_KEY),
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "TMPDIR", "value": "/tmp"},
                *_rollout_secrets(job)],
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                      "limits": {"cpu": str(py.concurrency), "memory": memory}},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "metrics"},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/live", "port": "metrics"},
                          "periodSeconds": 30, "timeoutSeconds": 5, "failureThreshold": 2},
    }
    # Each program may write 64 files of 16 MiB (its rlimits): /tmp holds every slot's worth.
    scratch = ({"name": "tmp", "emptyDir": {"sizeLimit": f"{py.concurrency}Gi"}}, {"name": "tmp", "mountPath": "/tmp"})
    template = _pod_template(job, settings, SANDBOX, container, grace=10, override=py.template,
                             template_field="spec.rollout.multiTurn.python.template", fetch_model=False,
                             scratch=scratch)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(job, name, SANDBOX), "spec": {
        "replicas": sandbox_replicas(job) if replicas is None else replicas,
        "selector": {"matchLabels": names.selector(m.name, SANDBOX)},
        "revisionHistoryLimit": 2,
        "template": template,
    }}


def build_rollout_dependencies(job: GRPOJob, settings: OperatorSettings, *, rollout_replicas: int
                               ) -> list[dict[str, Any]]:
    """The Deployments of the servers the rollout servers call: every reward model's and the python
    tool's sandbox; at zero whenever the rollout servers, their only callers, are."""
    deployments = [build_reward_deployment(job, settings, i, replicas=None if rollout_replicas else 0)
                   for i in range(len(job.spec.reward.reward_models))]
    if sandbox_replicas(job):
        deployments.append(build_sandbox_deployment(job, settings, replicas=None if rollout_replicas else 0))
    return deployments


# --- network and monitoring ------------------------------------------------------------------

def build_network_policy(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Ingress to the rollout pods: gRPC only from this job's trainer pods; with the nccl
    weight sync, any port from this job's trainer and rollout pods (the collective's
    connections use ephemeral ports, and NCCL rings connect the rollout servers to each
    other); the metrics port from the job's namespace or the configured one."""
    m = job.metadata
    trainer = {"podSelector": {"matchLabels": names.selector(m.name, TRAINER)}}
    rollout = {"podSelector": {"matchLabels": names.selector(m.name, ROLLOUT)}}
    ingress = [
        {"from": [trainer], "ports": [{"protocol": "TCP", "port": GRPC_PORT}]},
        {"from": [_scrapers(settings)], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
    ]
    if job.spec.weight_sync.backend == "nccl":
        ingress.append({"from": [trainer, rollout]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, names.rollout_name(m.name), ROLLOUT),
            "spec": {"podSelector": {"matchLabels": names.selector(m.name, ROLLOUT)},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def build_reward_network_policy(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Ingress to the reward pods: gRPC only from this job's rollout pods (the trainer never calls
    them), the metrics port from the scrapers."""
    m = job.metadata
    reward = {"matchLabels": names.selector(m.name, REWARD)}
    rollout = {"podSelector": {"matchLabels": names.selector(m.name, ROLLOUT)}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, f"{m.name}-reward", REWARD),
            "spec": {"podSelector": reward, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [rollout], "ports": [{"protocol": "TCP", "port": GRPC_PORT}]},
                                 {"from": [_scrapers(settings)], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}]}}


def build_sandbox_network_policy(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """The sandbox pods run model-written code: no egress at all (not even DNS), ingress to gRPC only
    from this job's rollout pods and to the metrics port from the scrapers. Enforced by the
    cluster's network plugin (one that implements NetworkPolicy's Egress)."""
    m = job.metadata
    rollout = {"podSelector": {"matchLabels": names.selector(m.name, ROLLOUT)}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, names.sandbox_name(m.name), SANDBOX),
            "spec": {"podSelector": {"matchLabels": names.selector(m.name, SANDBOX)},
                     "policyTypes": ["Ingress", "Egress"], "egress": [],
                     "ingress": [{"from": [rollout], "ports": [{"protocol": "TCP", "port": GRPC_PORT}]},
                                 {"from": [_scrapers(settings)], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}]}}


def build_trainer_network_policy(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Ingress to the trainer pods: from each other (torchrun's c10d rendezvous and NCCL between
    nodes use any port), from the job's rollout pods with the nccl weight sync (they join the
    trainer's collective), and the metrics port from the scrapers. Nothing else reaches c10d."""
    m = job.metadata
    trainer = {"podSelector": {"matchLabels": names.selector(m.name, TRAINER)}}
    peers = [trainer]
    if job.spec.weight_sync.backend == "nccl":
        peers.append({"podSelector": {"matchLabels": names.selector(m.name, ROLLOUT)}})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, names.trainer_name(m.name), TRAINER),
            "spec": {"podSelector": {"matchLabels": names.selector(m.name, TRAINER)},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": peers},
                                 {"from": [_scrapers(settings)], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}]}}


def _scrapers(settings: OperatorSettings) -> dict[str, Any]:
    if settings.metrics_namespace:
        return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.metrics_namespace}}}
    return {"podSelector": {}}


def build_pod_monitor(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Scrapes the rollout pods and trainer node 0 (only global rank 0 serves metrics: the
    other nodes' pods are left out by their completion index)."""
    m = job.metadata
    meta = _meta(job, m.name, "metrics")
    meta["labels"].update(settings.pod_monitor_labels)
    match: dict[str, Any] = {"matchLabels": {names.JOB_LABEL: m.name}}
    if job.spec.trainer.nnodes > 1:
        match["matchExpressions"] = [{"key": COMPLETION_INDEX_LABEL, "operator": "NotIn",
                                      "values": [str(i) for i in range(1, job.spec.trainer.nnodes)]}]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta, "spec": {
        "selector": match,
        # honorLabels: the metrics' own `job` label (the GRPOJob's name) wins over the scrape job's.
        "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s", "honorLabels": True}],
    }}


def build_pod_group(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """scheduler-plugins' coscheduling PodGroup of the trainer pods: the scheduler binds none of
    them until all trainer.nnodes fit, so a multi-node trainer never holds half its GPUs."""
    m = job.metadata
    spec: dict[str, Any] = {"minMember": job.spec.trainer.nnodes}
    timeout = job.spec.run_policy.scheduling_policy.schedule_timeout_seconds
    if timeout is not None:
        spec["scheduleTimeoutSeconds"] = timeout
    return {"apiVersion": names.POD_GROUP_API, "kind": "PodGroup",
            "metadata": _meta(job, names.trainer_name(m.name), TRAINER), "spec": spec}


def build_children(job: GRPOJob, settings: OperatorSettings, *, pod_monitor: bool) -> list[dict[str, Any]]:
    """Every child that is applied as-is whenever the spec changes (not the token Secret, which
    is created once; not the trainer Job and rollout Deployment, whose life the lifecycle
    decides). Raises TemplateError for a refused pod template, before anything is created."""
    children = [build_config_map(job, settings), build_trainer_service(job, settings),
                build_rollout_service(job, settings),
                *(build_reward_service(job, settings, rm.name) for rm in job.spec.reward.reward_models)]
    if sandbox_replicas(job):
        children.append(build_sandbox_service(job, settings))
    if settings.network_policy:
        children += [build_network_policy(job, settings), build_trainer_network_policy(job, settings)]
        if job.spec.reward.reward_models:
            children.append(build_reward_network_policy(job, settings))
        if sandbox_replicas(job):
            children.append(build_sandbox_network_policy(job, settings))
    if pod_monitor:
        children.append(build_pod_monitor(job, settings))
    if job.spec.run_policy.scheduling_policy is not None:
        children.append(build_pod_group(job, settings))
    return children
