"""Tools for the agent loop (grpo_rollout.agent_loop): Python functions, verl tool config files,
the built-in sandboxed `python`; and `ToolRunner`, which runs a turn's calls at once, each under
a timeout, and turns every failure into an error message for the model."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass

from grpo_api.spec import MultiTurnSpec
from grpo_rollout.tools.base import Tool, ToolError, ToolUnavailable
from grpo_rollout.tools.function_tool import FunctionTool, import_function
from grpo_rollout.tools.python_tool import PythonTool
from grpo_rollout.tools.verl_config import load_tool_config

__all__ = ["Tool", "ToolError", "ToolUnavailable", "ToolCall", "ToolResult", "ToolRunner", "load_tools", "truncate"]


def load_tools(spec: MultiTurnSpec, sandbox=None) -> dict[str, Tool]:
    """sandbox: the SandboxClient the `python` tool runs its programs on (None: in a child process
    here, refused when spec.python.replicas asks for sandbox servers)."""
    tools: list[Tool] = []
    for i, ref in enumerate(spec.tools):
        if ref == "python":
            if sandbox is None and spec.python.replicas:
                raise ValueError(f"rollout.multiTurn.python.replicas is {spec.python.replicas}: the python tool runs "
                                 f"its programs only on sandbox servers, and this rollout server has none (pass "
                                 f"--sandbox HOST:PORT or set GRPO_SANDBOX_ADDRESSES)")
            tools.append(PythonTool(spec.python, sandbox))
            continue
        try:
            tools.append(FunctionTool(import_function(ref)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"rollout.multiTurn.tools[{i}]: {exc}") from exc
    if spec.tool_config_path:
        tools.extend(load_tool_config(spec.tool_config_path))
    by_name: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ValueError(f"rollout.multiTurn.tools: two tools are named {tool.name!r}")
        by_name[tool.name] = tool
    return by_name


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str = ""
    """Set when the call could not be parsed: the model reads it instead of a tool's answer."""


@dataclass(frozen=True)
class ToolResult:
    name: str
    text: str
    error: str          # "" or the kind, one of grpo_api.records.TOOL_ERROR_KINDS (the trainer counts each)
    seconds: float


def truncate(text: str, limit: int, side: str) -> str:
    """verl's tool_response_truncate_side: keep the first (right: cut the right), last (left) or
    both ends (middle) of a long answer."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "...(truncated)" + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]


class ToolRunner:
    """Runs a turn's calls at once, each in a thread of its own and under its own timeout, counted
    from its own start; `seconds` is that call's time. A call past its timeout answers with an
    error at once and its thread is abandoned (Python can't kill a thread; the `python` tool's
    process is killed by its own limit). Abandoned threads never delay other calls, as a shared
    pool's would; while `max_running` calls are still running (hung ones included), a new call is
    refused as `unavailable` rather than queued behind them."""

    def __init__(self, tools: dict[str, Tool], *, timeout_seconds: float, max_response_length: int,
                 truncate_side: str, max_running: int = 256):
        self.tools = tools
        self.timeout = timeout_seconds
        self.max_length = max_response_length
        self.side = truncate_side
        self._slots = threading.BoundedSemaphore(max_running)
        self.max_running = max_running

    def run(self, calls: list[tuple[ToolCall, dict]]) -> list[ToolResult]:
        """`calls`: each with its row's create_kwargs for that tool. Results in order."""
        started = [self._start(call, kwargs) for call, kwargs in calls]
        return [self._result(call, begun) for (call, _), begun in zip(calls, started)]

    def _start(self, call: ToolCall, create_kwargs: dict):
        """A ToolResult at once (nothing to run), or (future, start time) of the call's thread."""
        if call.error:
            return ToolResult(call.name, f"Error: {call.error}", "parse", 0.0)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"Error: no tool named {call.name!r}; the tools are {sorted(self.tools)}",
                              "unknown_tool", 0.0)
        if not self._slots.acquire(blocking=False):
            return ToolResult(call.name, f"Error: tool {call.name} is unavailable: {self.max_running} calls are "
                              f"still running (hung past the timeout)", "unavailable", 0.0)
        future: cf.Future = cf.Future()

        def target():
            try:
                answer, failure = tool.call(call.arguments, create_kwargs), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                answer, failure = None, exc
            self._slots.release()
            future.seconds = time.monotonic() - begun      # before the result: a reader sees both
            future.set_exception(failure) if failure else future.set_result(answer)
        begun = time.monotonic()
        threading.Thread(target=target, name=f"tool-{call.name}", daemon=True).start()
        return future, begun

    def _result(self, call: ToolCall, started) -> ToolResult:
        if isinstance(started, ToolResult):
            return started
        future, begun = started
        try:
            text, error = future.result(timeout=max(0.0, begun + self.timeout - time.monotonic())), ""
        except cf.TimeoutError:
            text, error = f"Error: tool {call.name} timed out after {self.timeout:g}s", "timeout"
        except ToolUnavailable as exc:
            text, error = f"Error: {exc}", "unavailable"
        except ToolError as exc:
            text, error = f"Error: {exc}", "tool_error"
        except Exception as exc:  # noqa: BLE001 - a tool's crash is the model's answer, not the server's
            text, error = f"Error: tool {call.name} raised {type(exc).__name__}: {exc}", "crash"
        seconds = getattr(future, "seconds", None) if future.done() else None
        return ToolResult(call.name, truncate(text, self.max_length, self.side), error,
                          self.timeout if seconds is None else seconds)

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()
