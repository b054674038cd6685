"""Reading GRPOJob files: YAML, `--set a.b.c=value` overrides, and errors that name the field.

Callers: `grpo validate`, `grpo run`, the trainer and rollout entry points (they read the
resolved spec the operator or launcher wrote), and the operator (validating what got past the
CRD schema).
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpo_api.spec import GRPOJob


class JobError(ValueError):
    """A job that can't be used; `errors` lists every problem as 'path: reason'."""

    def __init__(self, errors: list[str], source: str = "job"):
        self.errors = errors
        super().__init__(f"{source}: invalid GRPOJob\n" + "\n".join(f"  - {e}" for e in errors))


class _Loader(yaml.SafeLoader):
    """YAML as kubectl reads it where PyYAML differs in a way a job notices: `lr: 1e-6` is a number
    (YAML 1.2, Go's yaml), not the string YAML 1.1 makes of it, which strict validation refuses."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


def load_yaml(text: str) -> Any:
    loader = _Loader(text)         # a SafeLoader: what yaml.safe_load does, with kubectl's floats
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _loc_to_path(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1] = f"{parts[-1]}[{item}]" if parts else f"[{item}]"
        else:
            parts.append(str(item))
    return ".".join(parts)


def format_errors(exc: ValidationError) -> list[str]:
    """One 'field.path: reason (got value)' line per problem; cross-field rules expand to theirs."""
    lines = []
    for err in exc.errors():
        if err["type"] == "cross_field":
            lines.extend(err["ctx"]["errors"])
            continue
        path = _loc_to_path(err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field" + _suggest(err["loc"])
        elif err["type"] == "string_pattern_mismatch":
            msg = f"must match {err['ctx']['pattern']}" + f" (got {err.get('input')!r})"
        elif err["type"] != "missing" and not isinstance(err.get("input"), (dict, list)):
            msg += f" (got {err.get('input')!r})"
        lines.append(f"{path}: {msg}")
    return lines


def _suggest(loc: tuple) -> str:
    """'; did you mean X?' for a misspelled field, found by walking the model along loc."""
    model: type[BaseModel] | None = GRPOJob
    for item in loc[:-1]:
        if model is None or isinstance(item, int):
            continue
        model = _child_model(model, str(item))
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), _aliases(model), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _aliases(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _child_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            ann = field.annotation
            for cand in (ann, *getattr(ann, "__args__", ())):
                if isinstance(cand, type) and issubclass(cand, BaseModel):
                    return cand
            return None
    return None


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply verl-style dotted overrides (`trainer.totalSteps=5`, relative to spec or starting
    with `spec.`/`metadata.`). Values are parsed as YAML scalars/lists, then validated with the
    whole job. Unknown paths are refused with a suggestion."""
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            errors.append(f"--set {item!r}: expected key=value")
            continue
        parts = key.split(".")
        if parts[0] not in ("spec", "metadata"):
            parts = ["spec", *parts]
        model: type[BaseModel] | None = GRPOJob
        node = doc
        for depth, part in enumerate(parts):
            if model is not None and part not in _aliases(model) and part not in model.model_fields:
                close = difflib.get_close_matches(part, _aliases(model), n=1)
                hint = f"; did you mean '{'.'.join(parts[:depth] + [close[0]])}'?" if close else ""
                errors.append(f"--set {key}: unknown field '{'.'.join(parts[:depth + 1])}'{hint}")
                break
            if depth == len(parts) - 1:
                node[part] = load_yaml(raw) if raw else ""
            else:
                nxt = model and _child_model(model, part)
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node, model = node[part], nxt
    if errors:
        raise JobError(errors, "--set")
    return doc


def parse_job(doc: Any, overrides: list[str] = (), source: str = "job") -> GRPOJob:
    """Validate a parsed YAML document (a GRPOJob, or a bare spec) into a GRPOJob."""
    if not isinstance(doc, dict):
        raise JobError([f"expected a mapping with apiVersion, kind, metadata and spec (got {type(doc).__name__})"], source)
    if "spec" not in doc and "model" in doc:
        doc = {"spec": doc}  # a bare spec, as the operator stores it in the ConfigMap
    doc = apply_overrides(doc, list(overrides))
    try:
        # Strict, through JSON, as the API server sees the document: `useKLLoss: 'yes'` or
        # `trainBatchSize: '16'` are refused as the CRD refuses them, never coerced; strings still
        # become enums and timestamps, and integers numbers.
        return GRPOJob.model_validate_json(json.dumps(_as_kubectl_sends(doc), default=str), strict=True)
    except ValidationError as exc:
        raise JobError(format_errors(exc), source) from None


def _as_kubectl_sends(node: Any) -> Any:
    """Go's JSON writes a whole float as an integer (`n: 4.0` reaches the API server as 4, which an
    integer field takes); a YAML date becomes its text (json.dumps' default=str above)."""
    if isinstance(node, dict):
        return {k: _as_kubectl_sends(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_as_kubectl_sends(v) for v in node]
    if isinstance(node, float) and node.is_integer() and abs(node) < 2 ** 63:
        return int(node)
    return node


def load_job(path: str | Path, overrides: list[str] = ()) -> GRPOJob:
    """Read and validate a GRPOJob YAML file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobError([f"can't read file: {exc.strerror}"], str(path)) from None
    try:
        doc = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise JobError([f"malformed YAML{where}: {getattr(exc, 'problem', exc)}"], str(path)) from None
    return parse_job(doc, overrides, str(path))


def kubectl_boolean_keys(text: str) -> list[str]:
    """Unquoted keys that kubectl's YAML 1.1 reads as booleans: `n: 5` is `false: 5` to it, and
    the API server refuses `spec.rollout.false`. Python's YAML (and so `grpo run`) reads `n` as a
    string, so only `grpo validate` says it. `text` must be valid YAML."""
    return _yaml11_boolean_keys(yaml.compose(text))


def _yaml11_boolean_keys(node: yaml.Node | None, path: str = "") -> list[str]:
    errors = []
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = f"{path}.{key.value}" if path else str(key.value)
            if isinstance(key, yaml.ScalarNode) and key.style is None and key.value in _YAML11_BOOLS:
                shown = value.value if isinstance(value, yaml.ScalarNode) else "..."
                boolean = _yaml11_bool(key.value)
                errors.append(f"{name}: quote the key, \"{key.value}\": {shown} (line {key.start_mark.line + 1}): "
                              f"kubectl reads YAML 1.1, where a bare {key.value} is the boolean {boolean}, so the "
                              f"API server would refuse this as {path + '.' if path else ''}{boolean}")
            errors.extend(_yaml11_boolean_keys(value, name))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            errors.extend(_yaml11_boolean_keys(item, f"{path}[{i}]"))
    return errors


def _yaml11_bool(word: str) -> str:
    return "true" if word.lower() in ("y", "yes", "on") else "false"


class K8sDumper(yaml.SafeDumper):
    """Quotes strings that YAML 1.1 parsers (kubectl's) read as booleans: `n`, `y`, `on`..."""


_YAML11_BOOLS = {"y", "Y", "n", "N", "yes", "Yes", "YES", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF"}
K8sDumper.add_representer(str, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:str", v, style="'" if v in _YAML11_BOOLS else None))


def k8s_yaml(obj) -> str:
    return yaml.dump(obj, Dumper=K8sDumper, sort_keys=False, width=100)


def dump_job(job: GRPOJob) -> str:
    """The resolved job as YAML (camelCase, defaults filled in): what the pods read."""
    # None is kept: an explicit null (e.g. keepCheckpoints: null, keep all) must survive the trip.
    return k8s_yaml(job.model_dump(mode="json", by_alias=True, exclude={"status"}))
