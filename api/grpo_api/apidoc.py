"""The GRPOJob field reference (docs/API.md), generated from the pydantic models so it can't
drift: `python -m grpo_api.apidoc > docs/API.md` (a test compares)."""

from __future__ import annotations

import json

from pydantic import BaseModel

from grpo_api.spec import GRPOJobSpec


def _model_of(annotation) -> type[BaseModel] | None:
    for cand in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("grpo_api.spec.", "")


def rows(model: type[BaseModel] = GRPOJobSpec, prefix: str = "spec") -> list[tuple[str, str, str, str]]:
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}"
        sub = _model_of(field.annotation)
        if sub is not None and sub.__module__ == GRPOJobSpec.__module__:
            out.append((path, sub.__name__, "", field.description or ""))
            out.extend(rows(sub, path))
            continue
        default = "required" if field.is_required() else json.dumps(
            getattr(field.default, "value", field.default), default=str)
        out.append((path, _type_name(field.annotation), default, field.description or ""))
    return out


def markdown() -> str:
    lines = ["# GRPOJob API reference (grpo.dev/v1alpha1)", "",
             "Generated from `grpo_api.spec` by `python -m grpo_api.apidoc`; do not edit.", "",
             "| field | type | default | description |", "|---|---|---|---|"]
    for path, typ, default, desc in rows():
        desc = " ".join(desc.split())  # a docstring's line breaks would end the table row
        lines.append(f"| `{path}` | {typ.replace('|', '&#124;')} | {default.replace('|', '&#124;')} | "
                     f"{desc.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
