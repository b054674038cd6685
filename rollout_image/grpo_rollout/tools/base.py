"""What a tool is to the agent loop: a name, an OpenAI function schema, and a call that turns the
model's arguments (and the row's per-tool kwargs) into the text the model reads back."""

from __future__ import annotations

from abc import ABC, abstractmethod


class ToolError(Exception):
    """A call that failed in a way the model should read about (bad arguments, a crash)."""


class ToolUnavailable(ToolError):
    """The service a tool runs on didn't answer in time (the python sandbox servers)."""


class Tool(ABC):
    name: str
    schema: dict

    @abstractmethod
    def call(self, arguments: dict, create_kwargs: dict) -> str:
        """The tool's answer. `create_kwargs`: the dataset row's extra_info.tools_kwargs[name].create_kwargs."""

    def close(self) -> None:
        """Release what the tool holds."""
