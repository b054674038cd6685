"""Tools the agent-loop tests load by reference (`tests.rollout.tool_fixtures.tools:<name>`)."""

import time
from typing import Literal, Optional


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b (int): The second number,
            zero if left out.

    Returns:
        The sum.
    """
    return a + b


def grade(answer: str, unit: Literal["m", "km"], note: Optional[str] = None, *, truth: str) -> str:
    """Compare an answer with the truth."""
    return "right" if answer == truth else "wrong"


def explode() -> str:
    """Always fails."""
    raise RuntimeError("the tool broke")


def hang() -> str:
    """Never answers in time."""
    time.sleep(60)
    return "late"


class EchoTool:
    """verl's BaseTool interface (async create/execute/release), without verl."""

    def __init__(self, config, tool_schema):
        self.prefix = config.get("prefix", "")
        self.name = tool_schema.function.name
        self.released = []

    async def create(self, instance_id=None, **kwargs):
        return "instance-1", None

    async def execute(self, instance_id, parameters, **kwargs):
        return self.prefix + str(parameters.get("text")), 0.0, {}

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)
