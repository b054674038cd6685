"""Subcommands that need only the API: `grpo validate`, `grpo crd`."""

from __future__ import annotations

import argparse
import sys

from grpo_api.jobfile import JobError, load_job


def validate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo validate", description="Check GRPOJob files; list every error.")
    parser.add_argument("files", nargs="+", help="GRPOJob YAML files")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set trainer.totalSteps=5")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.files:
        try:
            job = load_job(path, args.overrides)
        except JobError as exc:
            failed += 1
            print(exc, file=sys.stderr)
            continue
        print(f"{path}: ok ({job.metadata.name}: {job.spec.algorithm.adv_estimator.value}, "
              f"{job.spec.rollout.n} samples x {job.spec.data.train_batch_size} prompts per step)")
    return 1 if failed else 0


def crd(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="grpo crd", description="Print the GRPOJob CRD (generated from the API models).").parse_args(argv)
    from grpo_api.crd import crd_yaml
    sys.stdout.write(crd_yaml())
    return 0
