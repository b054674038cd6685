"""The trainer: an Indexed Job of torchrun nodes, wired the way Kubeflow Trainer and JobSet wire it
(a static rendezvous at node 0's stable DNS name, with both the flags and the PET_* variables
torchrun reads), and its coscheduling PodGroup."""

from __future__ import annotations

from typing import Any

from grpo_api import signing
from grpo_api.contracts import BAD_INPUT_EXIT_CODE, STOPPED_EXIT_CODE
from grpo_api.rpc import TLS_CA_ENV, TLS_SERVER_NAME_ENV
from grpo_api.spec import GRPOJob

from grpo_operator import names
from grpo_operator.manifests.common import (COMPLETION_INDEX_LABEL, common_env, container_resources, from_secret,
                                            object_meta, pod_template)
from grpo_operator.manifests.servers import colocated_server_env
from grpo_operator.names import GRPC_PORT, MASTER_PORT, METRICS_PORT, SPEC_PATH, TRAINER
from grpo_operator.settings import OperatorSettings

TRAINER_COMMAND = ["grpo", "trainer", "--torchrun"]
# rollout.placement colocated (issue 46): the node's rollout servers first, then torchrun
# (grpo_trainer.colocate); a server that dies fails the pod.
COLOCATED_COMMAND = ["grpo", "trainer", "--colocate"]


def _trainer_secrets(job: GRPOJob) -> list[dict[str, Any]]:
    """The trainer verifies the rollout servers against the job's CA (it dials pod IPs: the
    name to check is the Service's) and signs and verifies checkpoints with the job's key."""
    m = job.metadata
    return [from_secret(job, TLS_CA_ENV, names.CA_CERT_KEY),
            {"name": TLS_SERVER_NAME_ENV, "value": names.rollout_dns_names(m.name, m.namespace)[0]},
            from_secret(job, signing.KEY_ENV, names.CHECKPOINT_KEY_KEY)]


def _tracker_env_from(job: GRPOJob) -> dict[str, Any]:
    """The wandb/mlflow credentials and endpoints, every key of the job's Secret as a variable
    of the trainer (only rank 0 logs, but every node runs the same pod). By reference: the values
    never pass through the spec, the ConfigMap or the status. Explicit `env` wins over `envFrom`,
    so such a Secret can't rewire the pods."""
    secret = job.spec.trainer.tracker_secret_ref
    return {"envFrom": [{"secretRef": {"name": secret}}]} if secret else {}


def trainer_gpus(job: GRPOJob) -> int:
    t = job.spec.trainer
    return 0 if t.device == "cpu" else t.nproc_per_node


def colocated_ports(job: GRPOJob) -> list[int]:
    """The gRPC ports of a trainer pod's colocated servers, one per tensorParallelSize of its GPUs."""
    return [GRPC_PORT + i for i in range(job.spec.servers_per_node)]


def colocated_addresses(job: GRPOJob) -> str:
    """Every trainer pod's colocated servers, by the pods' stable names in the trainer's headless
    Service (published before they are ready): trainer rank 0 dispatches to all of them."""
    m, service = job.metadata, names.trainer_name(job.metadata.name)
    return ",".join(f"{service}-{node}.{service}.{m.namespace}.svc:{port}"
                    for node in range(job.spec.trainer.nnodes) for port in colocated_ports(job))


def torchrun_args(job: GRPOJob) -> list[str]:
    m, t = job.metadata, job.spec.trainer
    rollout = colocated_addresses(job) if job.spec.colocated else names.rollout_address(m.name, m.namespace)
    return [f"--nnodes={t.nnodes}", f"--nproc-per-node={t.nproc_per_node}",
            "--node-rank=$(JOB_COMPLETION_INDEX)",
            f"--master-addr={names.master_addr(m.name)}", f"--master-port={MASTER_PORT}",
            "--no-python", "grpo", "trainer", "--spec", SPEC_PATH,
            "--rollout", rollout,
            "--metrics-port", str(METRICS_PORT)]


def _colocated(job: GRPOJob) -> dict[str, Any]:
    """The container fields that differ with placement colocated: the supervisor's command before
    torchrun's, the servers' certificate and clients (never the checkpoint key: the supervisor
    drops it from their environment), their gRPC ports and their /metrics ports (`metrics-<i>`,
    which the PodMonitors scrape on every trainer pod; the pod's `metrics` is trainer rank 0's)."""
    if not job.spec.colocated:
        return {}
    ports = colocated_ports(job)
    metrics = [names.colocated_metrics_port(i) for i in range(len(ports))]
    return {"command": COLOCATED_COMMAND,
            "args": ["--spec", SPEC_PATH, "--ports", ",".join(map(str, ports)),
                     "--metrics-ports", ",".join(str(port) for _, port in metrics), "--torchrun", *torchrun_args(job)],
            "env": colocated_server_env(job),
            "ports": [{"name": name, "containerPort": port, "protocol": "TCP"}
                      for name, port in [*((f"grpc-{i}", port) for i, port in enumerate(ports)), *metrics]]}


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
    colocated = _colocated(job)
    container = {
        "name": TRAINER,
        "image": (settings.colocated_image or settings.rollout_image) if job.spec.colocated
                  else settings.trainer_image,
        # torchrun, run by `grpo trainer --torchrun`: the container exits with the failed worker's
        # own code (2: bad input) where torchrun would exit 1 (grpo_trainer.commands.torchrun).
        "command": colocated.get("command", TRAINER_COMMAND),
        "args": colocated.get("args", torchrun_args(job)),
        "env": [*_torchrun_env(job), *common_env(job), *_trainer_secrets(job), *colocated.get("env", [])],
        **_tracker_env_from(job),
        "ports": [{"name": "c10d", "containerPort": MASTER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}, *colocated.get("ports", [])],
        "resources": container_resources(settings.trainer_resources, trainer_gpus(job), settings),
    }
    template = pod_template(job, settings, TRAINER, container,
                             grace=settings.trainer_termination_grace_seconds, override=t.template,
                             extra_labels={**attempt_label, **gang_labels}, restartPolicy="Never",
                             subdomain=name, **gang_spec)
    meta = object_meta(job, name, TRAINER)
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
        # A trainer stopped by SIGTERM (`kubectl delete pod`, which sets no DisruptionTarget) exits
        # 75 after its checkpoint: replaced the same way, and the operator counts no restart (as a
        # JobSet counts only the failures of its Jobs). (A pod failure policy needs restartPolicy
        # Never, which the pods have.)
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "Ignore", "onExitCodes": {"containerName": TRAINER, "operator": "In",
                                                 "values": [STOPPED_EXIT_CODE]}},
            {"action": "FailJob", "onExitCodes": {"containerName": TRAINER, "operator": "In",
                                                  "values": [BAD_INPUT_EXIT_CODE]}},
        ]},
        "template": template,
        **({"suspend": True} if names.queue_name(job) is not None else {}),
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
            "metadata": object_meta(job, names.trainer_name(m.name), TRAINER), "spec": spec}
