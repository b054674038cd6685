"""`grpo trainer` (under torchrun) and `grpo export`. Heavy imports stay inside the functions."""

from __future__ import annotations

import argparse
import os
import sys


def trainer(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo trainer", description="The GRPO learner; run it under torchrun.")
    parser.add_argument("--spec", required=True, help="resolved GRPOJob YAML (what `grpo run`/the operator wrote)")
    parser.add_argument("--rollout", default=os.environ.get("GRPO_ROLLOUT_ADDRESSES", ""),
                        help="rollout servers: host:port,host:port or dns:///service:port (env GRPO_ROLLOUT_ADDRESSES)")
    parser.add_argument("--run-locally", action="store_true", help="a local run (default storage under ./outputs)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on rank 0")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if not args.rollout:
        parser.error("--rollout (or GRPO_ROLLOUT_ADDRESSES) is required")

    import torch.distributed as dist
    from grpo_api.jobfile import JobError, load_job
    from grpo_api.rpc import read_token
    try:
        job = load_job(args.spec, args.overrides)
    except JobError as exc:
        print(exc, file=sys.stderr)
        return 2
    backend = "nccl" if job.spec.trainer.device != "cpu" and _cuda() else "gloo"
    dist.init_process_group(backend)
    try:
        from grpo_trainer.trainer import SetupError, Trainer
        try:
            t = Trainer(job, rollout_addresses=args.rollout, token=read_token(), local=args.run_locally,
                        metrics_port=args.metrics_port)
        except (SetupError, FileNotFoundError) as exc:
            if dist.get_rank() == 0:   # every rank stops with the same message: say it once
                print(f"error: {exc}", file=sys.stderr)
            return 2
        import signal
        signal.signal(signal.SIGTERM, lambda *_: t.request_stop())
        t.train()
    finally:
        dist.destroy_process_group()
    return 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo export", description="Write a checkpoint as a Hugging Face model.")
    parser.add_argument("checkpoint", help="checkpoint folder URI (…/checkpoints/step-N)")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    import json
    from pathlib import Path

    from grpo_api.spec import ModelSpec
    from grpo_api.storage import Storage
    from grpo_trainer.checkpoint import MANIFEST, load_full_state_dict
    from grpo_trainer.export import save_hf
    uri = args.checkpoint if "://" in args.checkpoint else f"file://{Path(args.checkpoint).absolute()}"
    storage = Storage()
    if not storage.exists(f"{uri}/{MANIFEST}"):
        print(f"error: {uri} is not a complete checkpoint (no {MANIFEST})", file=sys.stderr)
        return 2
    state = json.loads(storage.read_bytes(f"{uri}/trainer_state.json"))
    weights = load_full_state_dict(uri, storage)
    out = f"file://{Path(args.out).absolute()}"
    save_hf(weights, ModelSpec.model_validate(state["model"]), out, storage)
    print(f"Exported step {state['step']} to {args.out}")
    return 0
