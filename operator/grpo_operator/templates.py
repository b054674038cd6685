"""Per-job pod overrides: `spec.trainer.template` / `spec.rollout.template` merged into the pods
the operator builds.

A template is a partial PodTemplateSpec (`{metadata: ..., spec: ...}`). Only what a job has a
reason to choose may be set; the rest (the command, ports, probes, security context, the
operator's volumes and wiring env) stays the operator's, so a job can't break its own wiring or
escalate privileges through the operator's ServiceAccount. The rules, field by field:

| field | merge |
|---|---|
| metadata.labels, metadata.annotations | added; the operator's own label keys are refused |
| spec.nodeSelector | merged key by key, the template wins |
| spec.tolerations, topologySpreadConstraints, imagePullSecrets | appended |
| spec.affinity, priorityClassName, schedulerName, runtimeClassName, serviceAccountName | set (replace) |
| spec.volumes | added by name; the operator's volume names are refused |
| spec.containers[] | matched by `name` (omitted: the main container); other names are refused |
| container image, imagePullPolicy | set |
| container env | by name, the template wins; the operator's wiring variables are refused |
| container envFrom, volumeMounts | appended; a mountPath the operator uses is refused |
| container resources | merged per requests/limits key, the template wins |

Anything else is refused with the field's path: the operator reports it as `Invalid` and
creates nothing (see lifecycle.py).
"""

from __future__ import annotations

import copy
from typing import Any

from grpo_api import model_cache, rpc, signing

_METADATA_KEYS = {"labels", "annotations"}
_SPEC_MERGE = {"nodeSelector"}
_SPEC_APPEND = {"tolerations", "topologySpreadConstraints", "imagePullSecrets"}
_SPEC_SET = {"affinity", "priorityClassName", "schedulerName", "runtimeClassName", "serviceAccountName"}
_SPEC_KEYS = _SPEC_MERGE | _SPEC_APPEND | _SPEC_SET | {"volumes", "containers"}
_CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "env", "envFrom", "volumeMounts", "resources"}
RESERVED_ENV = frozenset({rpc.TOKEN_ENV, rpc.TOKEN_FILE_ENV, rpc.TLS_CA_ENV, rpc.TLS_SERVER_NAME_ENV, rpc.TLS_CERT_ENV,
                          rpc.TLS_KEY_ENV, signing.KEY_ENV, model_cache.CACHE_ENV, "POD_NAME",
                          "JOB_COMPLETION_INDEX"})
RESERVED_ENV_PREFIX = "PET_"
"""Variables that wire the pods together (RPC token, TLS, checkpoint key, worker identity,
torchrun rendezvous): a template can't override them (turning TLS off, say)."""


class TemplateError(ValueError):
    """A template the operator refuses; `errors` lists 'field.path: reason' lines."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("; ".join(errors))


def merge_pod_template(base: dict[str, Any], override: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """`base` (the operator's PodTemplateSpec) with `override` merged in as the table above says.

    `path` names the override in errors (e.g. `spec.trainer.template`). Neither argument is
    modified. Raises TemplateError listing every refused field."""
    merged = copy.deepcopy(base)
    if not override:
        return merged
    errors: list[str] = []
    if not isinstance(override, dict):
        raise TemplateError([f"{path}: must be a partial pod template {{metadata: ..., spec: ...}}"])
    for key in override:
        if key not in ("metadata", "spec"):
            errors.append(f"{path}.{key}: not allowed (a pod template has metadata and spec)")
    _merge_metadata(merged.setdefault("metadata", {}), override.get("metadata") or {}, f"{path}.metadata", errors)
    _merge_spec(merged["spec"], override.get("spec") or {}, f"{path}.spec", errors)
    if errors:
        raise TemplateError(errors)
    return merged


def _merge_metadata(meta: dict, override: dict, path: str, errors: list[str]) -> None:
    for key, value in override.items():
        if key not in _METADATA_KEYS:
            errors.append(f"{path}.{key}: not allowed (allowed: {', '.join(sorted(_METADATA_KEYS))})")
            continue
        if not isinstance(value, dict):
            errors.append(f"{path}.{key}: must be a map of strings")
            continue
        target = meta.setdefault(key, {})
        for k, v in value.items():
            if key == "labels" and k in target:
                errors.append(f"{path}.labels.{k}: set by the operator; choose another label")
                continue
            target[k] = str(v)


def _merge_spec(spec: dict, override: dict, path: str, errors: list[str]) -> None:
    if not isinstance(override, dict):
        errors.append(f"{path}: must be a map")
        return
    for key, value in override.items():
        where = f"{path}.{key}"
        if key not in _SPEC_KEYS:
            errors.append(f"{where}: not allowed in a GRPOJob pod template (allowed: {', '.join(sorted(_SPEC_KEYS))})")
        elif key in _SPEC_MERGE:
            if isinstance(value, dict):
                spec[key] = {**spec.get(key, {}), **value}
            else:
                errors.append(f"{where}: must be a map")
        elif key in _SPEC_APPEND:
            if isinstance(value, list):
                spec[key] = [*spec.get(key, []), *copy.deepcopy(value)]
            else:
                errors.append(f"{where}: must be a list")
        elif key in _SPEC_SET:
            spec[key] = copy.deepcopy(value)
        elif key == "volumes":
            _merge_volumes(spec, value, where, errors)
        else:
            _merge_containers(spec, value, where, errors)


def _merge_volumes(spec: dict, volumes: Any, path: str, errors: list[str]) -> None:
    if not isinstance(volumes, list):
        errors.append(f"{path}: must be a list")
        return
    reserved = {v["name"] for v in spec.get("volumes", [])}
    merged = list(spec.get("volumes", []))
    for i, volume in enumerate(volumes):
        name = volume.get("name") if isinstance(volume, dict) else None
        if not name:
            errors.append(f"{path}[{i}].name: required")
        elif name in reserved:
            errors.append(f"{path}[{i}].name: '{name}' is the operator's volume; choose another name")
        else:
            merged.append(copy.deepcopy(volume))
    spec["volumes"] = merged


def _merge_containers(spec: dict, containers: Any, path: str, errors: list[str]) -> None:
    if not isinstance(containers, list):
        errors.append(f"{path}: must be a list")
        return
    by_name = {c["name"]: c for c in spec["containers"]}
    main = spec["containers"][0]["name"]
    for i, partial in enumerate(containers):
        where = f"{path}[{i}]"
        if not isinstance(partial, dict):
            errors.append(f"{where}: must be a map")
            continue
        name = partial.get("name", main)
        if name not in by_name:
            errors.append(f"{where}.name: no container '{name}' (the pod's container is '{main}')")
            continue
        container = by_name[name]
        for key, value in partial.items():
            if key not in _CONTAINER_KEYS:
                errors.append(f"{where}.{key}: not allowed (allowed: {', '.join(sorted(_CONTAINER_KEYS))})")
            elif key in ("image", "imagePullPolicy"):
                container[key] = value
            elif key == "env":
                _merge_env(container, value, f"{where}.env", errors)
            elif key == "envFrom":
                container["envFrom"] = [*container.get("envFrom", []), *copy.deepcopy(value or [])]
            elif key == "volumeMounts":
                _merge_mounts(container, value, f"{where}.volumeMounts", errors)
            elif key == "resources":
                _merge_resources(container, value, f"{where}.resources", errors)


def _merge_env(container: dict, env: Any, path: str, errors: list[str]) -> None:
    if not isinstance(env, list):
        errors.append(f"{path}: must be a list")
        return
    merged = {e["name"]: e for e in container.get("env", [])}
    for i, var in enumerate(env):
        name = var.get("name") if isinstance(var, dict) else None
        if not name:
            errors.append(f"{path}[{i}].name: required")
        elif name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
            errors.append(f"{path}[{i}].name: '{name}' is set by the operator (it wires the pods together)")
        else:
            merged[name] = copy.deepcopy(var)
    container["env"] = list(merged.values())


def _merge_mounts(container: dict, mounts: Any, path: str, errors: list[str]) -> None:
    if not isinstance(mounts, list):
        errors.append(f"{path}: must be a list")
        return
    taken = {m["mountPath"] for m in container.get("volumeMounts", [])}
    merged = list(container.get("volumeMounts", []))
    for i, mount in enumerate(mounts):
        mount_path = mount.get("mountPath") if isinstance(mount, dict) else None
        if not mount_path or not mount.get("name"):
            errors.append(f"{path}[{i}]: name and mountPath are required")
        elif mount_path in taken:
            errors.append(f"{path}[{i}].mountPath: '{mount_path}' is the operator's; choose another path")
        else:
            merged.append(copy.deepcopy(mount))
    container["volumeMounts"] = merged


def _merge_resources(container: dict, resources: Any, path: str, errors: list[str]) -> None:
    if not isinstance(resources, dict):
        errors.append(f"{path}: must be a map")
        return
    target = container.setdefault("resources", {})
    for key, value in resources.items():
        if key not in ("requests", "limits") or not isinstance(value, dict):
            errors.append(f"{path}.{key}: only requests and limits maps are allowed")
            continue
        target[key] = {**target.get(key, {}), **value}
