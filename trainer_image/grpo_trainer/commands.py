"""`grpo trainer` (under torchrun), `grpo trainer --torchrun` (torchrun, reporting its workers' exit)
and `grpo export`. Heavy imports stay inside the functions.

Exit codes: 0 done; 2 bad input (the spec, the data, the model, a checkpoint: retrying can't
help, so on Kubernetes the trainer Job's pod failure policy fails the job at once); 75 stopped
on SIGTERM (STOPPED_EXIT_CODE: the pod failure policy replaces the pod without using a
restart); anything else a crash. The reason of a bad-input exit is one `error: ...` line on
stderr, which is also the container's termination message (/dev/termination-log), so the
operator puts it in the job's status and events."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from grpo_api.cli import exit_without_teardown
from grpo_api.contracts import BAD_INPUT_EXIT_CODE, ROLLOUT_ADDRESSES_ENV, STOPPED_EXIT_CODE

TERMINATION_LOG_ENV = "GRPO_TERMINATION_LOG"
"""Where the termination message goes (default /dev/termination-log, Kubernetes' default
terminationMessagePath); written only when that file exists, as it does in a pod."""
BAD_INPUT = BAD_INPUT_EXIT_CODE
ERROR_DIR_ENV = "GRPO_TRAINER_ERROR_DIR"
"""Set by `grpo trainer --torchrun` for its workers: a worker stopping on bad input writes its
`error:` line to <dir>/rank-<RANK> instead of printing it, and the wrapper prints the first failed
worker's. (Printed by rank 0 itself, the line was lost whenever another rank exited first:
torchrun then stops rank 0 before it prints.)"""


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
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        try:
            with open(os.path.join(error_dir, f"rank-{os.environ.get('RANK', '0')}"), "w") as f:
                f.write(message)
        except OSError:
            error_dir = None
    if say and not error_dir:
        print(message, file=sys.stderr)
    termination_message(message)
    return BAD_INPUT


def trainer(argv: list[str]) -> int:
    """The GRPO learner (run it under torchrun; `grpo run` and the operator do)."""
    if argv[:1] == ["--torchrun"]:
        return torchrun(argv[1:])
    if argv[:1] == ["--colocate"]:      # rollout.placement colocated: this node's rollout servers, then torchrun
        from grpo_trainer.colocate import run
        return run(argv[1:], torchrun)
    parser = argparse.ArgumentParser(prog="grpo trainer", description="The GRPO learner; run it under torchrun. "
                                     "`grpo trainer --torchrun TORCHRUN_ARGS...` runs torchrun itself and exits "
                                     "with its first failed worker's exit code (2: bad input); `grpo trainer "
                                     "--colocate --spec S --ports P,... --torchrun TORCHRUN_ARGS...` starts this "
                                     "node's colocated rollout servers first.")
    parser.add_argument("--spec", required=True, help="resolved GRPOJob YAML (what `grpo run`/the operator wrote)")
    parser.add_argument("--rollout", default=os.environ.get(ROLLOUT_ADDRESSES_ENV, ""),
                        help=f"rollout servers: host:port,host:port or dns:///service:port (env {ROLLOUT_ADDRESSES_ENV})")
    parser.add_argument("--run-locally", action="store_true", help="a local run (default storage under ./outputs)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on rank 0")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if not args.rollout:
        parser.error(f"--rollout (or {ROLLOUT_ADDRESSES_ENV}) is required")
    _die_with_agent()

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
            _leave(code)
        signal.signal(signal.SIGTERM, lambda *_: t.request_stop())
        from grpo_trainer.reward_checks import RewardFunctionFailed
        try:
            t.train()
        except (RewardFunctionFailed, SetupError) as exc:
            # Every rank read the same samples (or the same refusal of a rollout server, a
            # SetupError) and stops here, at the same step; leave at once as above (no step of
            # zeros is trained, nothing needs saving).
            code = _bad_input(f"error: {exc}", say=dist.get_rank() == 0)
            _leave(code)
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, where gloo's or Arrow's threads sometimes
    # aborted a rank after its run had finished and been exported (CI: exit -6, which fails a job
    # that succeeded). The trainer's own threads are joined by now, or daemons.
    exit_without_teardown(0)


def _leave(code: int) -> None:
    """Exit at once, the run's lease released first (os._exit skips atexit)."""
    from grpo_trainer.lease import release_held
    release_held()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_agent() -> None:
    """Under torchrun: this rank is killed when the agent that started it dies, even by SIGKILL, so
    no orphaned rank goes on (retrying a dead rollout server, writing into the run). The parent-death
    signal fires when the parent *thread* ends: torchrun starts its workers from its main thread, and
    this sets it from ours. An agent that died before it was set has left us another parent already."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    parent = os.getppid()
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:   # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def torchrun(argv: list[str]) -> int:
    """torchrun with `argv` (its flags, then the worker command), in this process. torchrun
    itself exits 1 whatever its workers did, after a page of its own report; this exits with the
    first failed worker's code instead (128+N for one killed by signal N, as a shell reports it;
    STOPPED_EXIT_CODE when torchrun itself was told to stop by SIGTERM),
    so that Kubernetes sees the trainer's own exit code (2: bad input, which the trainer Job's pod
    failure policy fails the job on), and ends the log with one line saying which worker failed
    how: for bad input, the first failed worker's own `error:` line (which it made the termination
    message too); for a crash the termination message is the end of the log (FallbackToLogsOnError)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    # torchrun logs every failed worker ("failed (exitcode: 2) local_rank: 0 ...") and its stopping
    # the others ("Sending process 123 closing signal SIGTERM"): said below, with the first failed
    # worker's own `error:` line (ERROR_DIR_ENV) where it stopped on bad input.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not str(record.msg).startswith(("failed (exitcode", "Sending process")))
    import tempfile
    args = get_args_parser().parse_args(argv)
    error_dir = tempfile.TemporaryDirectory(prefix="grpo-trainer-errors-")
    os.environ[ERROR_DIR_ENV] = error_dir.name        # the workers inherit it
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        said = os.path.join(error_dir.name, f"rank-{rank}")
        if code == BAD_INPUT and os.path.exists(said):
            with open(said) as f:
                print(f.read().rstrip("\n"), file=sys.stderr)
            return code
        if code == STOPPED_EXIT_CODE:   # another node's pod was stopped: every rank stopped with it
            print(f"trainer stopped: rank {rank} stopped on a stop request (see its log)", file=sys.stderr)
            return code
        if code < 0:
            name = _signal_name(-code)
            print(f"error: trainer rank {rank} (pid {failure.pid}) was killed by signal {-code} ({name})",
                  file=sys.stderr)
            return 128 - code
        # a crash, or bad input said on another node (its line is in that node's log)
        print(f"error: trainer rank {rank} (pid {failure.pid}) exited with code {code}", file=sys.stderr)
        return code or 1
    except SignalException as exc:   # stopped (suspend, preemption): the workers checkpointed
        print(f"trainer stopped by {_signal_name(exc.sigval)}", file=sys.stderr)
        # SIGTERM is how Kubernetes stops a pod (`kubectl delete pod`, a drain, a suspend): not
        # the trainer's failure, whether or not its ranks finished their checkpoint in time
        # (a resume takes the latest complete one), so it must not use up the job's restarts.
        return STOPPED_EXIT_CODE if exc.sigval == signal.SIGTERM else 128 + int(exc.sigval)
    finally:
        error_dir.cleanup()
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
    """Write a checkpoint as a Hugging Face model (safetensors; LoRA merged, its adapter in OUT/lora_adapter)."""
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
        return BAD_INPUT_EXIT_CODE
    try:
        key = checkpoint_key(uri, args.key_file)
        weights, state = load_full_state_dict(uri, storage, key)
    except (signing.CheckpointKeyError, signing.ManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    out = f"file://{Path(args.out).absolute()}"
    # The model's config and tokenizer come from where the job read them (fetched again here when
    # that is object storage).
    model_spec = local_model(ModelSpec.model_validate(state.trainer.model))
    if state.trainer.lora_config is not None:
        # A LoRA checkpoint holds the adapters: merged onto the base model, and as PEFT's folder.
        from grpo_trainer import lora
        from grpo_trainer.export import save_adapter
        from grpo_trainer.model import load_hf_model
        merged = lora.merged_from_checkpoint(load_hf_model(model_spec), weights, state.trainer.lora_config)
        save_hf(merged, model_spec, out, storage)
        save_adapter({lora.adapter_file_name(k): v for k, v in weights.items()}, state.trainer.lora_config, model_spec,
                     out, storage)
    else:
        save_hf(weights, model_spec, out, storage)
    print(f"Exported step {state.trainer.step} to {args.out}")
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
