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
owner reference needs) and the operator settings. One module per concern: config (ConfigMap,
Secret), trainer (Job, PodGroup), servers (the rollout, reward and sandbox pools: one builder for
a pool's Deployment, Service and NetworkPolicy), services, policies (NetworkPolicies, PodMonitor),
common (metadata, environment, the pod template).
"""

from __future__ import annotations

from typing import Any

from grpo_api.spec import GRPOJob

from grpo_operator.manifests.common import COMPLETION_INDEX_LABEL
from grpo_operator.manifests.config import build_config_map, build_rpc_secret, pod_job
from grpo_operator.manifests.policies import build_pod_monitor, build_trainer_network_policy
from grpo_operator.manifests.servers import (build_network_policy, build_reward_deployment, build_reward_network_policy,
                                             build_reward_service, build_rollout_dependencies, build_rollout_deployment,
                                             build_rollout_service, build_sandbox_deployment,
                                             build_sandbox_network_policy, build_sandbox_service, rollout_gpus,
                                             sandbox_replicas)
from grpo_operator.manifests.services import build_trainer_service
from grpo_operator.manifests.trainer import (TRAINER_COMMAND, build_pod_group, build_trainer_job, torchrun_args,
                                             trainer_gpus)
from grpo_operator.settings import OperatorSettings

__all__ = [
    "COMPLETION_INDEX_LABEL", "TRAINER_COMMAND", "build_children", "build_config_map", "build_network_policy",
    "build_pod_group", "build_pod_monitor", "build_reward_deployment", "build_reward_network_policy",
    "build_reward_service", "build_rollout_dependencies", "build_rollout_deployment", "build_rollout_service",
    "build_rpc_secret", "build_sandbox_deployment", "build_sandbox_network_policy", "build_sandbox_service",
    "build_trainer_job", "build_trainer_network_policy", "build_trainer_service", "pod_job", "rollout_gpus",
    "sandbox_replicas", "torchrun_args", "trainer_gpus",
]


def build_children(job: GRPOJob, settings: OperatorSettings, *, pod_monitor: bool) -> list[dict[str, Any]]:
    """Every child that is applied as-is whenever the spec changes (not the token Secret, which
    is created once; not the trainer Job and rollout Deployment, whose life the lifecycle
    decides). Raises TemplateError for a refused pod template, before anything is created."""
    colocated = job.spec.colocated      # no rollout pods: the trainer pods run the servers (issue 46)
    children = [build_config_map(job, settings), build_trainer_service(job, settings),
                *([] if colocated else [build_rollout_service(job, settings)]),
                *(build_reward_service(job, settings, rm.name) for rm in job.spec.reward.reward_models)]
    if sandbox_replicas(job):
        children.append(build_sandbox_service(job, settings))
    if settings.network_policy:
        # (the trainer's admits its own pods on every port: the colocated servers' gRPC too)
        children += [*([] if colocated else [build_network_policy(job, settings)]),
                     build_trainer_network_policy(job, settings)]
        if job.spec.reward.reward_models:
            children.append(build_reward_network_policy(job, settings))
        if sandbox_replicas(job):
            children.append(build_sandbox_network_policy(job, settings))
    if pod_monitor:
        children.append(build_pod_monitor(job, settings))
    if job.spec.run_policy.scheduling_policy is not None:
        children.append(build_pod_group(job, settings))
    return children
