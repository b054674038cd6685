"""Headless Services: the trainer's (its pods' subdomain, the rendezvous at index 0); the servers'
are built with their Deployments (manifests.servers)."""

from __future__ import annotations

from typing import Any

from grpo_api.spec import GRPOJob

from grpo_operator import names
from grpo_operator.manifests.common import object_meta
from grpo_operator.names import MASTER_PORT, METRICS_PORT, TRAINER
from grpo_operator.settings import OperatorSettings


def headless_service(job: GRPOJob, name: str, role: str, ports: list[dict], publish_not_ready: bool,
              selector: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": object_meta(job, name, role),
            "spec": {"clusterIP": "None", "selector": selector or names.selector(job.metadata.name, role),
                     "publishNotReadyAddresses": publish_not_ready, "ports": ports}}


def build_trainer_service(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Not-ready addresses are published: every node must resolve node 0 before any is ready."""
    return headless_service(job, names.trainer_name(job.metadata.name), TRAINER, [
        {"name": "c10d", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"},
    ], publish_not_ready=True)
