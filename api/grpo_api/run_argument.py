"""A run named on the command line, as `grpo replay`, `grpo ui` and `grpo rollouts export` take it:
RUN, its folder or its URI (status.runUri: s3://..., file://...), and --endpoint for an
S3-compatible server; the credentials are the environment's (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY), as for the job's own pods."""

from __future__ import annotations

import argparse
from pathlib import Path

from grpo_api.spec import StorageSpec
from grpo_api.storage import Storage


class RunNotFound(ValueError):
    """RUN names no run (nothing of a run's files under it)."""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run's URI (status.runUri: s3://..., file://...) or folder")
    parser.add_argument("--endpoint", default=None, help="S3-compatible endpoint URL (spec.storage.endpoint)")


def run_uri(run: str) -> str:
    """A run URI (file://, s3://, as status.runUri shows it) or a local folder, as a URI."""
    run = run.strip().rstrip("/")
    if not run:
        raise RunNotFound("RUN is empty")
    return run if "://" in run else f"file://{Path(run).absolute()}"


def open_run(args: argparse.Namespace) -> tuple[str, Storage]:
    """The run's URI and the Storage that reads it, from the arguments add_run_arguments added."""
    return run_uri(args.run), Storage(StorageSpec(endpoint=args.endpoint) if args.endpoint else None)
