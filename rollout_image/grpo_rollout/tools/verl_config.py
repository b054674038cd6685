"""verl's tool config files (actor_rollout_ref.rollout.multi_turn.tool_config_path):

    tools:
      - class_name: my_tools.Calculator      # a class with verl's BaseTool interface
        config: {type: native}
        tool_schema: {type: function, function: {name: calc, description: ..., parameters: {...}}}

The class is built as verl builds it, `cls(config=config, tool_schema=schema)`, and each call
goes through its (async) `create(**create_kwargs)` -> instance id, `execute(instance_id,
parameters)` -> (response, reward, metrics), `release(instance_id)`. A verl tool class itself
(`verl.tools.*`) needs verl installed on the rollout server; a class of your own that follows the
interface needs only its module on the path.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from pathlib import Path

import yaml

from grpo_rollout.tools.base import Tool


class _Schema(dict):
    """The tool schema as a dict that also reads as attributes (`schema.function.name`, verl's
    pydantic model's way), with `model_dump()`."""

    def __getattr__(self, name):
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return _Schema(value) if isinstance(value, dict) else value

    def model_dump(self, **_):
        return dict(self)


def _text(response) -> str:
    if isinstance(response, tuple):
        response = response[0]
    text = getattr(response, "text", response)
    return "" if text is None else str(text)


class VerlTool(Tool):
    def __init__(self, instance, schema: dict):
        self.instance = instance
        self.schema = schema
        self.name = schema["function"]["name"]

    def call(self, arguments: dict, create_kwargs: dict) -> str:
        return asyncio.run(self._call(arguments, create_kwargs))

    async def _call(self, arguments: dict, create_kwargs: dict) -> str:
        created = await _maybe_await(self.instance.create(**create_kwargs))
        instance_id = created[0] if isinstance(created, tuple) else created
        try:
            return _text(await _maybe_await(self.instance.execute(instance_id, arguments)))
        finally:
            release = getattr(self.instance, "release", None)
            if release is not None:
                await _maybe_await(release(instance_id))


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def load_tool_config(path: str) -> list[Tool]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"rollout.multiTurn.toolConfigPath: no file {path}")
    doc = yaml.safe_load(file.read_text()) or {}
    entries = doc.get("tools")
    if not isinstance(entries, list):
        raise ValueError(f"rollout.multiTurn.toolConfigPath {path}: expected a top-level 'tools' list")
    tools = []
    for i, entry in enumerate(entries):
        where = f"rollout.multiTurn.toolConfigPath {path}: tools[{i}]"
        class_name, schema = entry.get("class_name"), entry.get("tool_schema")
        if not class_name or "." not in class_name:
            raise ValueError(f"{where}.class_name: expected 'package.module.Class' (got {class_name!r})")
        if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict) \
                or not schema["function"].get("name"):
            raise ValueError(f"{where}.tool_schema: expected {{type: function, function: {{name: ..., ...}}}}")
        module_name, _, cls_name = class_name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"{where}.class_name: cannot import {class_name}: {exc}") from exc
        instance = cls(config=entry.get("config") or {}, tool_schema=_Schema(schema))
        tools.append(VerlTool(instance, schema))
    return tools
