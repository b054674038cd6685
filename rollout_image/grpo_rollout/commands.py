"""Subcommands of the rollout package (registered as `grpo.commands` entry points).

Each function takes argv (the words after the subcommand) and returns an exit code. Heavy
imports (torch, transformers) happen inside the functions, so that importing this module,
as the `grpo` dispatcher does, stays cheap.
"""

from __future__ import annotations

import argparse

from grpo_api.contracts import BAD_INPUT_EXIT_CODE


def rollout(argv: list[str]) -> int:
    """Run a rollout server: generation and rewards for a job's trainer (`grpo run` and the operator do)."""
    from grpo_rollout.serve import main
    return main(argv)


def reward(argv: list[str]) -> int:
    """Serve one of a job's reward models (spec.reward.rewardModels) to its rollout servers."""
    from grpo_rollout.reward_server import main
    return main(argv)


def sandbox(argv: list[str]) -> int:
    """Run the `python` tool's programs for a job's rollout servers (spec.rollout.multiTurn.python)."""
    from grpo_rollout.sandbox_server import main
    return main(argv)


def model(argv: list[str]) -> int:
    """Fetch a job's model into a cache folder, or write a tiny random-weight model (tests, quickstart)."""
    parser = argparse.ArgumentParser(prog="grpo model", description="Models: fetch a job's model into a cache "
                                     "folder; build a tiny one locally.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = sub.add_parser("fetch", help="copy a job's model into a cache folder (the pods' init container)",
                           description="Copy spec.model.path (and tokenizerPath) of a GRPOJob into "
                                       "<cache>/<name>-<hash>/ unless it is there: from object storage with "
                                       "spec.storage's endpoint and credentials, or from the Hugging Face hub. "
                                       "Pods fetching at once download it once.")
    fetch.add_argument("--spec", required=True, help="GRPOJob YAML file")
    fetch.add_argument("--cache", default=None,
                       help="cache folder (default: $GRPO_MODEL_CACHE, else ~/.cache/grpo-operator/models)")
    tiny = sub.add_parser("tiny", help="a tiny random-weight model and a locally built tokenizer",
                          description="Write a tiny random-init model of a real architecture and its "
                                      "word-level tokenizer (the quickstart's vocabulary), loadable "
                                      "offline with AutoModelForCausalLM/AutoTokenizer.from_pretrained.")
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3-rm", "qwen3-tools", "qwen2.5-vl",
                                                          "qwen3-vl"],
                      help="architecture (default: qwen3); qwen3-rm: a one-label sequence classifier (a reward "
                           "model); qwen3-tools: qwen3 whose vocabulary holds the lookup task's tool call; "
                           "qwen2.5-vl, qwen3-vl: a Qwen2.5-VL or Qwen3-VL with its image processor (the colours "
                           "task's vocabulary)")
    tiny.add_argument("--seed", type=int, default=0, help="weight init seed (default: 0)")
    args = parser.parse_args(argv)
    if args.action == "fetch":
        return _fetch(args.spec, args.cache)

    from grpo_rollout.tiny import build_tiny_model, build_tiny_reward_model  # imports torch when called
    if args.arch == "qwen3-rm":
        out = build_tiny_reward_model(args.out, seed=args.seed)
    elif args.arch in ("qwen2.5-vl", "qwen3-vl"):
        from grpo_rollout.tiny_vl import build_tiny_vl_model
        out = build_tiny_vl_model(args.out, seed=args.seed, arch=args.arch)
    elif args.arch == "qwen3-tools":
        from grpo_rollout.tool_task import build_model
        out = build_model(args.out, seed=args.seed)
    else:
        out = build_tiny_model(args.out, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} model (seed {args.seed}) to {out}")
    return 0


def _fetch(spec_path: str, cache: str | None) -> int:
    import os
    import sys

    from grpo_api import model_cache
    from grpo_api.jobfile import JobError, load_job
    try:
        spec = load_job(spec_path).spec
        root = cache or os.environ.get(model_cache.CACHE_ENV) or model_cache.default_root(os.environ)
        model_cache.fetch_model(spec.model, spec.storage, root)
    except JobError as exc:
        print(exc, file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    except (OSError, ValueError) as exc:      # unreachable storage, no such model, a full volume
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
