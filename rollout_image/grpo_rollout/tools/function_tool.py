"""Python functions as tools: `module:function` or `path/to/file.py:function`, the JSON schema
taken from the signature and the docstring (as transformers' `get_json_schema` and verl's
function tools do).

Parameters before `*` are the model's: they go into the schema, typed by their annotations,
described by the docstring's `Args:` section, and required unless they have a default.
Keyword-only parameters are the environment's: the model never sees them; they are filled from
the dataset row's `extra_info.tools_kwargs[<tool>].create_kwargs` (verl's per-row tool
arguments, e.g. the ground truth a checking tool compares against).
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any, Callable

from grpo_rollout.loading import load_attribute
from grpo_rollout.tools.base import Tool, ToolError

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               type(None): "null"}


def _json_type(annotation: Any) -> dict:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {"type": _json_type(type(values[0]))["type"], "enum": values}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {"type": [_json_type(a)["type"] for a in args]}
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    raise TypeError(f"no JSON type for the annotation {annotation!r} (use str, int, float, bool, list, dict, "
                    f"Literal or Optional of those)")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The description (the text before `Args:`) and each argument's description."""
    doc = inspect.cleandoc(doc or "")
    head, _, rest = doc.partition("\nArgs:")
    args: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        if re.match(r"^\S", line):     # the next section (Returns:, Raises:)
            break
        m = re.match(r"^\s+(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if m:
            current = m.group(1)
            args[current] = m.group(3).strip()
        elif current and line.strip():
            args[current] += " " + line.strip()
    return " ".join(head.split()), args


def function_schema(fn: Callable) -> dict:
    """The OpenAI function-tool schema of `fn` (its model-facing parameters only)."""
    description, arg_docs = _docstring_parts(fn.__doc__)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if name not in hints:
            raise TypeError(f"{fn.__name__}: parameter {name!r} has no type annotation (the tool schema needs one)")
        prop = _json_type(hints[name])
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if p.default is p.empty:
            required.append(name)
    return {"type": "function", "function": {
        "name": fn.__name__, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def import_function(ref: str) -> Callable:
    """`module:function` or `path/to/file.py:function` (grpo_rollout.loading)."""
    fn = load_attribute(ref, "tool")
    if not callable(fn):
        raise ValueError(f"tool {ref!r}: {ref.rpartition(':')[0]} has no function {ref.rpartition(':')[2]!r}")
    return fn


class FunctionTool(Tool):
    def __init__(self, fn: Callable):
        self.fn = fn
        self.schema = function_schema(fn)
        self.name = self.schema["function"]["name"]
        params = inspect.signature(fn).parameters
        self._model_params = {n for n, p in params.items() if p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD)}
        self._env_params = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}

    def call(self, arguments: dict, create_kwargs: dict) -> str:
        unknown = set(arguments) - self._model_params
        if unknown:
            raise ToolError(f"{self.name} takes no argument(s) {sorted(unknown)}; its parameters are "
                            f"{sorted(self._model_params)}")
        env = {k: v for k, v in create_kwargs.items() if k in self._env_params}
        try:
            result = self.fn(**arguments, **env)
        except TypeError as exc:     # missing or wrong arguments: the model's error, said to the model
            raise ToolError(f"{self.name}: {exc}") from exc
        return result if isinstance(result, str) else str(result)
