"""Generate the GRPOJob CustomResourceDefinition from the pydantic models.

Kubernetes wants a structural schema: no `$ref`, no `anyOf` with null, `nullable` instead, no
`title`. Cross-field rules become CEL `x-kubernetes-validations`, so the API server refuses what
`grpo validate` refuses. `crds/grpojob.yaml` is this module's output; a test fails on drift.
"""

from __future__ import annotations

import copy
from typing import Any


from grpo_api.jobfile import k8s_yaml
from grpo_api.spec import (API_GROUP, API_VERSION, CROSS_FIELD_RULES, KIND, KUBERNETES_RULES, MAX_NAME_LENGTH,
                           MUTABLE_SPEC_FIELDS, NAME_PATTERN, PLURAL, GRPOJobSpec, GRPOJobStatus)

# Fields whose content is free-form: Kubernetes (partial pod templates), a reward function's kwargs.
_PRESERVE_UNKNOWN = {"template", "kwargs"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _structural({**target, **extra}, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(node["anyOf"])
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(options) == 1:
            merged = {**_structural(options[0], defs), **_structural(rest, defs)}
            if nullable:
                merged["nullable"] = True
            return merged
    out = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "const":  # structural schemas have no const: an enum of one value
            out["enum"] = [value]
            continue
        if key == "additionalProperties" and value is False:
            continue  # forbidden next to `properties`; the API server prunes unknown fields anyway
        if key in ("exclusiveMinimum", "exclusiveMaximum"):  # OpenAPI v3.0: a bound plus a flag
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
            continue
        if key == "properties":
            out[key] = {name: (_free_form(sub) if name in _PRESERVE_UNKNOWN else _structural(sub, defs))
                        for name, sub in value.items()}
            continue
        out[key] = _structural(value, defs)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("default") is None and "default" in out:
        del out["default"]
    return out


def _free_form(sub: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
            "description": sub.get("description", ""), "nullable": True}


def _schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def spec_schema() -> dict[str, Any]:
    schema = _schema(GRPOJobSpec)
    # Sections default to {} so the API server fills in their defaults before CEL runs.
    for name, prop in schema["properties"].items():
        if prop.get("type") == "object" and name not in schema.get("required", []):
            prop["default"] = {}
    _immutable_except(schema, MUTABLE_SPEC_FIELDS, "spec")
    schema["x-kubernetes-validations"] = [
        {"rule": r.cel, "message": r.message, "fieldPath": "." + r.field}
        for r in (*CROSS_FIELD_RULES, *KUBERNETES_RULES)]
    return schema


def _immutable_except(schema: dict[str, Any], mutable: tuple[str, ...], path: str) -> None:
    """A `self == oldSelf` rule on every property of `schema` that is not in `mutable` (dotted
    paths relative to it) and holds nothing mutable; into those that do, recursively."""
    allowed = ", ".join(f"spec.{m}" for m in MUTABLE_SPEC_FIELDS)
    for name, prop in schema["properties"].items():
        inner = tuple(m.removeprefix(name + ".") for m in mutable if m.startswith(name + "."))
        if name in mutable:
            continue
        if inner:
            _immutable_except(prop, inner, f"{path}.{name}")
            continue
        prop.setdefault("x-kubernetes-validations", []).append(
            {"rule": "self == oldSelf",
             "message": f"{path}.{name} can't change while the job exists: the pods read it once, at start "
                        f"(only {allowed} can change)"})


def build_crd() -> dict[str, Any]:
    status = _schema(GRPOJobStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": "grpojob", "shortNames": ["gj"], "categories": ["all"]},
            "scope": "Namespaced",
            "versions": [{
                "name": API_VERSION,
                "served": True,
                "storage": True,
                # `kubectl scale gj NAME --replicas=N`: the rollout servers, the one part that scales.
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.rollout.replicas",
                                                         "statusReplicasPath": ".status.rolloutReplicas"}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
                    {"name": "Total", "type": "integer", "jsonPath": ".status.progress.totalSteps"},
                    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.rewardMean"},
                    {"name": "Val", "type": "number", "jsonPath": ".status.progress.validationScore",
                     "description": "Last validation score"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    # -o wide
                    {"name": "Best", "type": "number", "jsonPath": ".status.progress.bestScore", "priority": 1},
                    {"name": "Best-Step", "type": "integer", "jsonPath": ".status.progress.bestStep",
                     "priority": 1},
                    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
                    {"name": "Resumed-From", "type": "integer", "jsonPath": ".status.progress.resumedFromStep",
                     "priority": 1, "description": "The step the trainer's latest start continued from"},
                    {"name": "Epoch", "type": "integer", "jsonPath": ".status.progress.epoch", "priority": 1},
                    {"name": "Reason", "type": "string", "priority": 1,
                     "description": "Why the job failed, waits or is stalled", "jsonPath": ".status.reason"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "GRPOJob: one RL post-training run (GRPO and relatives) of an LLM.",
                    "required": ["spec"],
                    # The root is the only place a CEL rule sees metadata.name.
                    "x-kubernetes-validations": [{
                        "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && "
                                f"self.metadata.name.matches('{NAME_PATTERN}')",
                        "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters of a-z, 0-9 and "
                                   f"'-' (a DNS label with room for the children's names, e.g. <name>-trainer-0)",
                        "fieldPath": ".metadata.name",     # else kubectl prints `<nil>: Invalid value`
                    }],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        # name declared so the rule above can name it (fieldPath); CRDs may say
                        # no more of metadata than name and generateName
                        "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
                        "spec": {**spec_schema(), "description": "The training recipe (verl-style)."},
                        "status": {**status, "description": "Observed state, owned by the operator."},
                    },
                }},
            }],
        },
    }


def crd_yaml() -> str:
    return "# Generated by `grpo crd` from grpo_api.spec; do not edit.\n" + k8s_yaml(build_crd())
