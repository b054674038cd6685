"""Subcommands of the rollout package (registered as `grpo.commands` entry points).

Each function takes argv (the words after the subcommand) and returns an exit code. Heavy
imports (torch, transformers) happen inside the functions, so that importing this module,
as the `grpo` dispatcher does, stays cheap.
"""

from __future__ import annotations

import argparse


def rollout(argv: list[str]) -> int:
    """Run a rollout server: generation and rewards for a job's trainer (`grpo run` and the operator do)."""
    from grpo_rollout.serve import main
    return main(argv)


def model(argv: list[str]) -> int:
    """Write a tiny random-weight model (for tests and the quickstart)."""
    parser = argparse.ArgumentParser(prog="grpo model", description="Build models locally (no downloads).")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    tiny = sub.add_parser("tiny", help="a tiny random-weight model and a locally built tokenizer",
                          description="Write a tiny random-init model of a real architecture and its "
                                      "word-level tokenizer (the quickstart's vocabulary), loadable "
                                      "offline with AutoModelForCausalLM/AutoTokenizer.from_pretrained.")
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--arch", default="qwen3", choices=["qwen3"], help="architecture (default: qwen3)")
    tiny.add_argument("--seed", type=int, default=0, help="weight init seed (default: 0)")
    args = parser.parse_args(argv)

    from grpo_rollout.tiny import build_tiny_model  # imports torch/transformers when called
    out = build_tiny_model(args.out, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} model (seed {args.seed}) to {out}")
    return 0
