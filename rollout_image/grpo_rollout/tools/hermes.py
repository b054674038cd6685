"""The Hermes tool-call format (Qwen2.5/Qwen3, verl's `format: hermes`): a model turn holds
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

from __future__ import annotations

import json
import re

from grpo_rollout.tools import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse_tool_calls(text: str, limit: int | None = None) -> list[ToolCall]:
    """The calls in a model turn, in order (at most `limit`). A block that isn't a JSON object with
    a string `name` and object `arguments` is a ToolCall with `error` set: the model reads why."""
    calls = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body[:200]}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, f'a tool call must be {{"name": ..., "arguments": {{...}}}}: {body[:200]}'))
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):          # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(obj["name"], {}, f"tool {obj['name']}: arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], arguments))
    return calls[:limit] if limit else calls
