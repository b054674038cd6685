"""`grpo trainer` (under torchrun) and `grpo export`. Heavy imports stay inside the functions."""

from __future__ import annotations

import argparse
import os
import sys


def trainer(argv: list[str]) -> int:
    """The GRPO learner (run it under torchrun; `grpo run` and the operator do)."""
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
    from grpo_api import signing
    from grpo_api.jobfile import JobError, load_job
    from grpo_api.rpc import TLSError, TokenError, client_auth
    try:
        job = load_job(args.spec, args.overrides)
    except JobError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        auth, key = client_auth(), signing.read_key()
    except (TokenError, TLSError, signing.CheckpointKeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    backend = "nccl" if job.spec.trainer.device != "cpu" and _cuda() else "gloo"
    dist.init_process_group(backend)
    try:
        from grpo_trainer.collectives import SetupError
        from grpo_trainer.trainer import Trainer
        try:
            t = Trainer(job, rollout_addresses=args.rollout, auth=auth, checkpoint_key=key, local=args.run_locally,
                        metrics_port=args.metrics_port)
        except (SetupError, FileNotFoundError, signing.ManifestError) as exc:
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
    """Write a checkpoint as a Hugging Face model (safetensors)."""
    parser = argparse.ArgumentParser(prog="grpo export", description="Write a checkpoint as a Hugging Face model.")
    parser.add_argument("checkpoint", help="checkpoint folder URI (…/checkpoints/step-N)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--key-file", default=None,
                        help="the job's checkpoint key (hex), to verify the checkpoint with; default: "
                             "GRPO_CHECKPOINT_KEY, else the run folder's checkpoint.key (grpo run)")
    args = parser.parse_args(argv)
    from pathlib import Path

    from grpo_api import signing
    from grpo_api.model_cache import local_model
    from grpo_api.spec import ModelSpec
    from grpo_api.storage import Storage
    from grpo_trainer.checkpoint import MANIFEST, load_full_state_dict
    from grpo_trainer.export import save_hf
    uri = args.checkpoint if "://" in args.checkpoint else f"file://{Path(args.checkpoint).absolute()}"
    uri = uri.rstrip("/")
    storage = Storage()
    if not storage.exists(f"{uri}/{MANIFEST}"):
        print(f"error: {uri} is not a complete checkpoint (no {MANIFEST})", file=sys.stderr)
        return 2
    try:
        key = _export_key(uri, args.key_file)
        weights, state = load_full_state_dict(uri, storage, key)
    except (signing.CheckpointKeyError, signing.ManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = f"file://{Path(args.out).absolute()}"
    # The model's config and tokenizer come from where the job read them (fetched again here when
    # that is object storage).
    save_hf(weights, local_model(ModelSpec.model_validate(state["model"])), out, storage)
    print(f"Exported step {state['step']} to {args.out}")
    return 0


def _export_key(uri: str, key_file: str | None) -> bytes:
    """--key-file, else GRPO_CHECKPOINT_KEY, else (a local run's checkpoint) the run's key file."""
    from pathlib import Path

    from grpo_api import signing
    if key_file:
        return signing.parse_key(signing.key_file(Path(key_file), create=False), key_file)
    if os.environ.get(signing.KEY_ENV, "").strip():
        return signing.read_key()
    run = Path(uri.removeprefix("file://")).parent.parent          # <run>/checkpoints/step-N
    if uri.startswith("file://") and (run / signing.KEY_FILE).exists():
        return signing.parse_key(signing.key_file(run / signing.KEY_FILE, create=False), str(run / signing.KEY_FILE))
    raise signing.CheckpointKeyError(
        f"no checkpoint key to verify {uri} with: pass --key-file, or set {signing.KEY_ENV} (on Kubernetes: the "
        f"job Secret's checkpoint-key; `grpo run` keeps it in <run>/{signing.KEY_FILE})")
