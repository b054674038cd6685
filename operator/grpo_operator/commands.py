"""`grpo run` (local launcher), `grpo report`, `grpo operator`. No torch here."""

from __future__ import annotations

import argparse
import sys


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="grpo run", description="Run a GRPOJob on this machine: rollout servers + a torchrun trainer.")
    parser.add_argument("job", help="GRPOJob YAML, e.g. examples/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set trainer.totalSteps=5")
    args = parser.parse_args(argv)
    from grpo_api.jobfile import JobError
    from grpo_operator.local import run_job
    try:
        return run_job(args.job, args.overrides)
    except (JobError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo report", description="Plot a run's metrics (PNG) and summarise it.")
    parser.add_argument("run_dir", help="run directory, e.g. outputs/<project>/<experiment>")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    from pathlib import Path
    from grpo_operator.report import write_report
    try:
        written = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print((written[-1]).read_text(), end="")
    print(f"Wrote {len(written)} files to {written[-1].parent}")
    return 0
