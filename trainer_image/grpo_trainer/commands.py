"""`grpo trainer` (under torchrun), `grpo trainer --torchrun` (torchrun, reporting its workers' exit)
and `grpo export`. Heavy imports stay inside the functions.

Exit codes: 0 done; 2 bad input (the spec, the data, the model, a checkpoint: retrying can't
help, so on Kubernetes the trainer Job's pod failure policy fails the job at once); anything
else a crash. The reason of a bad-input exit is one `error: ...` line on stderr, which is also
the container's termination message (/dev/termination-log), so the operator puts it in the
job's status and events."""

from __future__ import annotations

import argparse
import os
import signal
import sys

TERMINATION_LOG_ENV = "GRPO_TERMINATION_LOG"
"""Where the termination message goes (default /dev/termination-log, Kubernetes' default
terminationMessagePath); written only when that file exists, as it does in a pod."""
BAD_INPUT = 2


def termination_message(message: str) -> None:
    """`message` as the container's termination message, when there is one to write (a pod),
    by the node's first worker only (every rank stops with the same message)."""
    path = os.environ.get(TERMINATION_LOG_ENV, "/dev/termination-log")
    if os.environ.get("LOCAL_RANK", "0") != "0" or not os.path.isfile(path):
        return
    try:
        with open(path, "w") as f:
            f.write(message.strip()[-4000:] + "\n")    # the kubelet keeps at most 4096 bytes
    except OSError:
        pass


def _bad_input(message: str, *, say: bool = True) -> int:
    """Say why the trainer can't run (once: `say` is False on the ranks that don't), as the
    termination message too, and return the bad-input exit code."""
    if say:
        print(message, file=sys.stderr)
    termination_message(message)
    return BAD_INPUT


def trainer(argv: list[str]) -> int:
    """The GRPO learner (run it under torchrun; `grpo run` and the operator do)."""
    if argv[:1] == ["--torchrun"]:
        return torchrun(argv[1:])
    parser = argparse.ArgumentParser(prog="grpo trainer", description="The GRPO learner; run it under torchrun. "
                                     "`grpo trainer --torchrun TORCHRUN_ARGS...` runs torchrun itself and exits "
                                     "with its first failed worker's exit code (2: bad input).")
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
        return _bad_input(str(exc))
    try:
        auth, key = client_auth(), signing.read_key()
    except (TokenError, TLSError, signing.CheckpointKeyError) as exc:
        return _bad_input(f"error: {exc}")
    backend = "nccl" if job.spec.trainer.device != "cpu" and _cuda() else "gloo"
    dist.init_process_group(backend)
    try:
        from grpo_trainer.collectives import SetupError
        from grpo_trainer.trainer import Trainer
        try:
            t = Trainer(job, rollout_addresses=args.rollout, auth=auth, checkpoint_key=key, local=args.run_locally,
                        metrics_port=args.metrics_port)
        except (SetupError, FileNotFoundError, signing.ManifestError) as exc:
            # Every rank stops with the same message: say it once. Then leave at once: nothing
            # was written that needs saving, and gloo's teardown (destroy_process_group, then
            # the interpreter's) sometimes aborted here (SIGABRT, "terminate called without an
            # active exception", ~1 run in 20 with 2 ranks on a loaded machine), which turned
            # this exit 2, that the operator fails the job on, into a crash that is retried.
            code = _bad_input(f"error: {exc}", say=dist.get_rank() == 0)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        signal.signal(signal.SIGTERM, lambda *_: t.request_stop())
        t.train()
    finally:
        dist.destroy_process_group()
    return 0


def torchrun(argv: list[str]) -> int:
    """torchrun with `argv` (its flags, then the worker command), in this process. torchrun
    itself exits 1 whatever its workers did, after a page of its own report; this exits with the
    first failed worker's code instead (128+N for one killed by signal N, as a shell reports it),
    so that Kubernetes sees the trainer's own exit code (2: bad input, which the trainer Job's pod
    failure policy fails the job on), and ends the log with one line saying which worker failed
    how. A worker that said why (bad input) has made that its termination message already; for a
    crash the termination message is the end of the log (FallbackToLogsOnError)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if code < 0:
            name = _signal_name(-code)
            print(f"error: trainer rank {rank} (pid {failure.pid}) was killed by signal {-code} ({name})",
                  file=sys.stderr)
            return 128 - code
        if code != BAD_INPUT:
            print(f"error: trainer rank {rank} (pid {failure.pid}) exited with code {code}", file=sys.stderr)
        return code or 1
    except SignalException as exc:   # stopped (suspend, preemption): the workers checkpointed
        print(f"trainer stopped by {_signal_name(exc.sigval)}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def export(argv: list[str]) -> int:
    """Write a checkpoint as a Hugging Face model (safetensors); a LoRA checkpoint merged, and its
    PEFT adapter folder in OUT/lora_adapter."""
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
        key = checkpoint_key(uri, args.key_file)
        weights, state = load_full_state_dict(uri, storage, key)
    except (signing.CheckpointKeyError, signing.ManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = f"file://{Path(args.out).absolute()}"
    # The model's config and tokenizer come from where the job read them (fetched again here when
    # that is object storage).
    model_spec = local_model(ModelSpec.model_validate(state["model"]))
    if "lora_config" in state:
        # A LoRA checkpoint holds the adapters: merged onto the base model, and as PEFT's folder.
        from grpo_trainer import lora
        from grpo_trainer.export import save_adapter
        from grpo_trainer.model import load_hf_model
        merged = lora.merged_from_checkpoint(load_hf_model(model_spec), weights, state["lora_config"])
        save_hf(merged, model_spec, out, storage)
        save_adapter({lora.adapter_file_name(k): v for k, v in weights.items()}, state["lora_config"], model_spec,
                     out, storage)
    else:
        save_hf(weights, model_spec, out, storage)
    print(f"Exported step {state['step']} to {args.out}")
    return 0


def checkpoint_key(uri: str, key_file: str | None) -> bytes:
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
