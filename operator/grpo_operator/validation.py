"""What the operator checks beyond the CRD schema before it creates anything (pure).

The API server already refused what the schema and its CEL rules can express. What is left:
the pydantic model (the same one `grpo validate` uses: unknown-field suggestions, patterns),
Kubernetes-only requirements (a storage URI every pod can reach, a name short enough for the
children's names) and the pod templates (templates.py). Any error here makes the job `Invalid`
with no children.
"""

from __future__ import annotations

from typing import Any

from grpo_api.jobfile import JobError, parse_job
from grpo_api.spec import KUBERNETES_RULES, GRPOJob

from grpo_operator import manifests, names
from grpo_operator.settings import OperatorSettings
from grpo_operator.templates import TemplateError


def parse_grpojob(obj: dict[str, Any], settings: OperatorSettings) -> tuple[GRPOJob | None, list[str]]:
    """The job from an API object, or None and every error as 'field.path: reason'."""
    meta = obj.get("metadata") or {}
    doc = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
           "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                        "labels": names.kueue_labels(obj)},
           "spec": obj.get("spec")}
    try:
        job = parse_job(doc, source=f"{meta.get('namespace')}/{meta.get('name')}")
    except JobError as exc:
        return None, list(exc.errors)
    errors = kubernetes_errors(job)
    try:
        manifests.build_trainer_job(job, settings)
        manifests.build_rollout_deployment(job, settings)
        manifests.build_rollout_dependencies(job, settings, rollout_replicas=1)
    except TemplateError as exc:
        errors.extend(exc.errors)
    return (None, errors) if errors else (job, [])


def kubernetes_errors(job: GRPOJob) -> list[str]:
    """The CRD refuses these at apply; an object admitted under an older CRD may still break them."""
    return [e for rule in KUBERNETES_RULES if (e := rule.check(job.spec))]
