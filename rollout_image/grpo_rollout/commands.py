"""Subcommands of the rollout package (registered as `grpo.commands` entry points in pyproject).
Each keeps its heavy imports inside, so `grpo --help` stays fast."""

from __future__ import annotations


def rollout(argv: list[str]) -> int:
    """`grpo rollout --spec FILE [--port P] [--metrics-port P] [--worker-id ID]`: run a rollout server."""
    from grpo_rollout.serve import main
    return main(argv)
