"""Names, labels, ports and owner references of a GRPOJob's children (docs/ARCHITECTURE.md §4).

Names are deterministic (`<job>-spec`, `<job>-trainer`, ...): a restarted operator finds what
it created before instead of creating it twice. Every child carries the same labels, so one
selector finds all of a job's objects, and `grpo.dev/role` tells trainer from rollout.
"""

from __future__ import annotations

import hashlib
from typing import Any

from grpo_api.spec import API_GROUP, API_VERSION, KIND, GRPOJob

MANAGER = "grpo-operator"
JOB_LABEL = "grpo.dev/job"
ROLE_LABEL = "grpo.dev/role"
ATTEMPT_LABEL = "grpo.dev/attempt"
"""On the trainer Job and its pods: the restart count the Job was created at, so a failure is
counted once even when the operator dies between counting it and replacing the Job."""

TRAINER, ROLLOUT, REWARD, SANDBOX = "trainer", "rollout", "reward", "sandbox"
REWARD_MODEL_LABEL = "grpo.dev/reward-model"
"""On a reward model's Deployment, Service and pods: spec.reward.rewardModels[].name."""

KUEUE_LABELS = ("kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class")
"""Kueue's labels, passed from the GRPOJob to its trainer Job as Kueue's own integrations pass
them from the parent: the LocalQueue that admits the trainer, and its WorkloadPriorityClass."""
POD_GROUP_API = "scheduling.x-k8s.io/v1alpha1"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
"""scheduler-plugins' coscheduling: the trainer pods' PodGroup (named like the trainer Job)."""

SPEC_DIR = "/etc/grpo"
SPEC_KEY = "job.yaml"
SPEC_PATH = f"{SPEC_DIR}/{SPEC_KEY}"
DEFAULTS_KEY = "operator-defaults.json"
"""In the `<job>-spec` ConfigMap: the operator's job defaults (images, resources, ...) the job's
pods are built with, pinned when the job was first reconciled (settings.JOB_DEFAULTS)."""
TOKEN_KEY = "token"
# The rest of the job's Secret: the trainer gets the checkpoint key and the CA, the rollout
# servers their certificate and its key; neither gets the other's.
CHECKPOINT_KEY_KEY = "checkpoint-key"
CA_CERT_KEY = "ca.crt"
TLS_CERT_KEY = "tls.crt"
TLS_KEY_KEY = "tls.key"

GRPC_PORT = 50051
METRICS_PORT = 9090
MASTER_PORT = 29500


def colocated_metrics_port(index: int) -> tuple[str, int]:
    """A trainer pod's colocated rollout server `index`'s /metrics port, by name and number (the
    pod's `metrics` port is trainer rank 0's): every trainer pod serves these, node 0 or not."""
    return f"metrics-{index}", METRICS_PORT + 1 + index


def config_map_name(job: str) -> str:
    return f"{job}-spec"


def secret_name(job: str) -> str:
    return f"{job}-rpc"


def trainer_name(job: str) -> str:
    """The trainer Job and its headless Service (the pods' subdomain)."""
    return f"{job}-trainer"


def rollout_name(job: str) -> str:
    """The rollout Deployment and its headless Service."""
    return f"{job}-rollout"


def master_addr(job: str) -> str:
    """Node rank 0's stable DNS name: Indexed Job pods get hostname `<job-name>-<index>`, and
    the headless Service named like the pods' subdomain gives it a record."""
    return f"{trainer_name(job)}-0.{trainer_name(job)}"


def rollout_address(job: str, namespace: str) -> str:
    """What the trainer dials: the headless Service's DNS name, re-resolved every step, so
    scaling the rollout Deployment adds or removes workers."""
    return f"dns:///{rollout_name(job)}.{namespace}.svc.cluster.local:{GRPC_PORT}"


def rollout_dns_names(job: str, namespace: str) -> list[str]:
    """The names of the rollout Service, short to fully qualified: its servers' certificate is
    for all of them. The first is what the trainer checks (independent of the cluster domain)."""
    service = rollout_name(job)
    return [f"{service}.{namespace}.svc", service, f"{service}.{namespace}",
            f"{service}.{namespace}.svc.cluster.local"]


def reward_model_name(job: str, model: str) -> str:
    """A reward model's Deployment and headless Service, `<job>-rm-<model>`. A Service name is one
    DNS label (<= 63): a longer one keeps its start and ends in a hash of the whole."""
    name = f"{job}-rm-{model}"
    if len(name) <= 63:
        return name
    return f"{name[:54].rstrip('-')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def reward_address(job: str, namespace: str, model: str) -> str:
    """What a rollout server dials: the headless Service, resolved by gRPC's dns resolver to every
    ready replica (round robin across them; a dead one leaves DNS when its readiness fails)."""
    return f"dns:///{reward_model_name(job, model)}.{namespace}.svc:{GRPC_PORT}"


def reward_dns_names(job: str, namespace: str, models: list[str]) -> list[str]:
    """The reward Services' names in the job's certificate: the rollout servers check the name
    they dial (`<service>.<namespace>.svc`), with the short forms as for the rollout Service."""
    out = []
    for model in models:
        service = reward_model_name(job, model)
        out += [f"{service}.{namespace}.svc", service, f"{service}.{namespace}",
                f"{service}.{namespace}.svc.cluster.local"]
    return out


def sandbox_name(job: str) -> str:
    """The `python` tool's sandbox Deployment, Service and NetworkPolicy (as long as `<job>-rollout`)."""
    return f"{job}-sandbox"


def sandbox_address(job: str, namespace: str) -> str:
    """What a rollout server dials: the headless Service, every ready sandbox pod (round robin)."""
    return f"dns:///{sandbox_name(job)}.{namespace}.svc:{GRPC_PORT}"


def sandbox_dns_names(job: str, namespace: str) -> list[str]:
    """The sandbox Service's names in the job's certificate (the rollout servers check the first)."""
    service = sandbox_name(job)
    return [f"{service}.{namespace}.svc", service, f"{service}.{namespace}", f"{service}.{namespace}.svc.cluster.local"]


def reward_selector(job: str, model: str) -> dict[str, str]:
    return {**selector(job, REWARD), REWARD_MODEL_LABEL: model}


def labels(job: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "grpojob",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGER,
        JOB_LABEL: job,
        ROLE_LABEL: component,
    }


def kueue_labels(job: GRPOJob | dict[str, Any]) -> dict[str, str]:
    """The Kueue labels among a GRPOJob's own (of the parsed job, or of the API object's metadata)."""
    meta = (job.get("metadata") or {}) if isinstance(job, dict) else (job.metadata.model_extra or {})
    return {k: v for k, v in (meta.get("labels") or {}).items() if k in KUEUE_LABELS}


def queue_name(job: GRPOJob) -> str | None:
    """The Kueue LocalQueue that admits the job's trainer; None: no queueing."""
    return kueue_labels(job).get(KUEUE_LABELS[0])


def selector(job: str, role: str) -> dict[str, str]:
    """Selector labels of a workload: only labels that never change for the job's life."""
    return {JOB_LABEL: job, ROLE_LABEL: role}


def owner_reference(name: str, uid: str, *, controller: bool = True) -> dict[str, Any]:
    """Makes the GRPOJob the controller of a child: deleting the job deletes the child (the
    garbage collector), and `blockOwnerDeletion` keeps a foreground deletion of the job waiting
    for it. `controller=False` for an object another controller owns (a kept trainer pod)."""
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": name, "uid": uid,
            "controller": controller, "blockOwnerDeletion": True}


def metadata(job: str, namespace: str, uid: str, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(job, component),
            "ownerReferences": [owner_reference(job, uid)]}

