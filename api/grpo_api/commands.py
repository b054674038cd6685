"""Subcommands that need only the API: `grpo validate`, `grpo crd`, `grpo from-verl`."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grpo_api.jobfile import JobError, kubectl_boolean_keys, load_job


def validate(argv: list[str], extra_checks=None) -> int:
    """Check GRPOJob files and list every error with its field path. `extra_checks(job)` returns
    more errors (the operator's pod-template rules: grpo_operator.commands.validate)."""
    parser = argparse.ArgumentParser(prog="grpo validate", description="Check GRPOJob files; list every error.")
    parser.add_argument("files", nargs="+", help="GRPOJob YAML files")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set trainer.totalSteps=5")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.files:
        try:
            job = load_job(path, args.overrides)
            # What Python reads one way and kubectl another: refused too, the file is for both.
            if bare := kubectl_boolean_keys(Path(path).read_text()):
                raise JobError(bare, str(path))
            if extra_checks is not None and (errors := extra_checks(job)):
                raise JobError(errors, str(path))
        except JobError as exc:
            failed += 1
            print(exc, file=sys.stderr)
            continue
        print(f"{path}: ok ({job.metadata.name}: {job.spec.algorithm.adv_estimator.value}, "
              f"{job.spec.rollout.n} samples x {job.spec.data.train_batch_size} prompts per step)")
    return 1 if failed else 0


def crd(argv: list[str]) -> int:
    """Print the GRPOJob CRD, generated from the API models."""
    argparse.ArgumentParser(prog="grpo crd", description="Print the GRPOJob CRD (generated from the API models).").parse_args(argv)
    from grpo_api.crd import crd_yaml
    sys.stdout.write(crd_yaml())
    return 0


def from_verl(argv: list[str]) -> int:
    """Translate a verl launch command or config into a GRPOJob."""
    parser = argparse.ArgumentParser(
        prog="grpo from-verl",
        description="Translate a verl launch command (python3 -m verl.trainer.main_ppo key=value ...) or a verl "
                    "YAML config into a GRPOJob. A script is run by bash with its launchers stubbed, so the "
                    "arguments are the ones bash passes. Warnings (keys with no meaning here) and errors (features "
                    "this operator doesn't have) go to stderr; errors exit 2 and write nothing (unreadable "
                    "input, and warnings with --strict, exit 1).",
        epilog="examples:  grpo from-verl run_qwen3-8b.sh -o job.yaml\n"
               "           grpo from-verl - < command.txt\n"
               "           grpo from-verl run_qwen3-8b.sh -- algorithm.norm_adv_by_std_in_grpo=False\n"
               "           grpo from-verl -- algorithm.adv_estimator=grpo data.train_files=... ...",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", help="a shell script / command file or a verl YAML config; "
                        "'-' or nothing reads stdin; or give the verl arguments after -- (with an input file, "
                        "arguments after -- are appended, as `bash run.sh key=value` passes them)")
    parser.add_argument("-o", "--output", help="write the GRPOJob here (default: stdout)")
    parser.add_argument("--expand-env", action="store_true",
                        help="substitute environment variables ($HOME, ~) instead of leaving them as written")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set a variable for the script's run (e.g. --env DEVICE=gpu --env NNODES=2); repeatable")
    parser.add_argument("--name", help="metadata.name (default: from trainer.experiment_name)")
    parser.add_argument("--namespace", help="metadata.namespace")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")
    parser.add_argument("--markdown-table", action="store_true",
                        help="print the verl key table (docs/MIGRATING_FROM_VERL.md) and exit")
    rest: list[str] | None = None
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1:]
    args = parser.parse_args(argv)
    from grpo_api import from_verl as fv
    from grpo_api import verl_command as vc
    if args.markdown_table:
        sys.stdout.write(fv.markdown_table())
        return 0
    bad = [e for e in args.env if not re.fullmatch(r"[A-Za-z_]\w*=.*", e, re.S)]
    if bad:
        parser.error(f"--env {bad[0]!r}: expected KEY=VALUE, KEY a shell variable name")
    env = dict(e.split("=", 1) for e in args.env)
    try:
        cfg, source = vc.read_input(args.input, args=rest, expand_env=args.expand_env, env=env)
    except vc.VerlInputError as exc:
        print(f"grpo from-verl: {exc}", file=sys.stderr)
        return 1
    result = fv.translate(cfg, name=args.name, namespace=args.namespace, expand_env=args.expand_env)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for error in result.errors:
        print(f"error: {error}", file=sys.stderr)
    if result.errors or (args.strict and result.warnings):
        print(f"grpo from-verl: not translated ({len(result.errors)} error(s), {len(result.warnings)} "
              f"warning(s){', --strict' if args.strict else ''})", file=sys.stderr)
        return 2 if result.errors else 1
    text = fv.render(result, source)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"Wrote {args.output} ({result.job.metadata.name}; {len(result.warnings)} warning(s))", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
