"""Who reaches and who scrapes the job's pods: the NetworkPolicies (the trainer's here; a server
pool's is built with its Deployment, manifests.servers) and the PodMonitor."""

from __future__ import annotations

from typing import Any

from grpo_api.spec import GRPOJob

from grpo_operator import names
from grpo_operator.manifests.common import COMPLETION_INDEX_LABEL, object_meta
from grpo_operator.names import METRICS_PORT, ROLLOUT, TRAINER
from grpo_operator.settings import OperatorSettings


def network_policy(job: GRPOJob, name: str, role: str, ingress: list[dict[str, Any]], *,
                   deny_egress: bool = False) -> dict[str, Any]:
    """A NetworkPolicy over every pod of `role`: only `ingress` reaches them; with `deny_egress`,
    nothing leaves them, not even DNS."""
    m = job.metadata
    spec: dict[str, Any] = {"podSelector": {"matchLabels": names.selector(m.name, role)},
                            "policyTypes": ["Ingress", "Egress"] if deny_egress else ["Ingress"]}
    if deny_egress:
        spec["egress"] = []
    spec["ingress"] = ingress
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": object_meta(job, name, role), "spec": spec}


def pods_of(job: GRPOJob, role: str) -> dict[str, Any]:
    """A NetworkPolicy peer: the job's pods of `role`."""
    return {"podSelector": {"matchLabels": names.selector(job.metadata.name, role)}}


def scraped(settings: OperatorSettings, extra_ports: tuple[int, ...] = ()) -> dict[str, Any]:
    """The ingress rule of the metrics port (and `extra_ports`): from the job's namespace, or the
    configured one."""
    if settings.metrics_namespace:
        scrapers = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.metrics_namespace}}}
    else:
        scrapers = {"podSelector": {}}
    return {"from": [scrapers], "ports": [{"protocol": "TCP", "port": port} for port in (METRICS_PORT, *extra_ports)]}


def _colocated_metrics(job: GRPOJob) -> list[tuple[str, int]]:
    """The trainer pods' colocated rollout servers' metrics ports (none with placement separate)."""
    return [names.colocated_metrics_port(i) for i in range(job.spec.servers_per_node)] if job.spec.colocated else []


def build_trainer_network_policy(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Ingress to the trainer pods: from each other (torchrun's c10d rendezvous and NCCL between
    nodes use any port), from the job's rollout pods with the nccl weight sync (they join the
    trainer's collective), and the metrics port from the scrapers. Nothing else reaches c10d."""
    peers = [pods_of(job, TRAINER)]
    if job.spec.weight_sync.backend == "nccl":
        peers.append(pods_of(job, ROLLOUT))
    metrics = scraped(settings, tuple(port for _, port in _colocated_metrics(job)))
    return network_policy(job, names.trainer_name(job.metadata.name), TRAINER, [{"from": peers}, metrics])


def build_pod_monitor(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Scrapes the job's server pods and trainer node 0 (only global rank 0 serves the trainer's
    metrics: the other nodes' pods are left out by their completion index) and, with placement
    colocated, every trainer pod's rollout servers (`metrics-<i>`: there the other nodes' `metrics`
    port alone is left out)."""
    m = job.metadata
    meta = object_meta(job, m.name, "metrics")
    meta["labels"].update(settings.pod_monitor_labels)
    match: dict[str, Any] = {"matchLabels": {names.JOB_LABEL: m.name}}
    # honorLabels: the metrics' own `job` label (the GRPOJob's name) wins over the scrape job's.
    endpoints = [{"port": port, "path": "/metrics", "interval": "15s", "honorLabels": True}
                 for port in ("metrics", *(name for name, _ in _colocated_metrics(job)))]
    if job.spec.trainer.nnodes > 1 and job.spec.colocated:
        endpoints[0]["relabelings"] = [{"sourceLabels": [_COMPLETION_INDEX_META], "regex": "(0)?", "action": "keep"}]
    elif job.spec.trainer.nnodes > 1:
        match["matchExpressions"] = [{"key": COMPLETION_INDEX_LABEL, "operator": "NotIn",
                                      "values": [str(i) for i in range(1, job.spec.trainer.nnodes)]}]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta, "spec": {
        "selector": match, "podMetricsEndpoints": endpoints}}


# Prometheus's name for the pod label COMPLETION_INDEX_LABEL (empty on the server pods: kept).
_COMPLETION_INDEX_META = "__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index"
