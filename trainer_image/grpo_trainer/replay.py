"""`grpo replay RUN --step N` (issue 35): train step N of a run again, from the checkpoint taken
before it (checkpoints/step-(N-1)) and the rollouts it trained on (rollouts/step-N/accepted.json),
and compare its loss, gradient norm, KL, advantages (and the critic's, with PPO) with what the
run logged in metrics.jsonl. On CPU they match exactly: that audits the training math and its
determinism. On GPU, kernels are not bit-reproducible, and the table shows by how much they differ.

What the step consumed, and where replay takes it from:
- the spec: that of the trainer that trained the step. The step's record names its digest, and every
  checkpoint keeps its trainer's job, signed: the checkpoint before the step, or, when the run was
  restarted with a changed spec after it (a longer totalSteps), a later one of that trainer; with
  none, replay refuses rather than retrain under another spec. Runs written before the record:
  the checkpoint's job, else `grpo run`'s <run>/job.yaml;
- the world size: the step's record (else the checkpoint's ranks): every rank trains its share of
  each mini-batch in micro-batches, so the same sums need the same ranks. Replay runs them under
  torchrun on this machine (on GPU it needs that many GPUs);
- the weights, optimizer and scheduler state, the KL coefficient and every rank's RNG: the
  checkpoint (the trainer draws nothing between a checkpoint and the next step; dropout is 0);
- the samples: the step's accepted shards (dynamic sampling's kept prompts too). Generation and
  rewards are the rollout servers' and are not redone.
Torch's CPU threads change float sums: torchrun runs trainer and replay with OMP_NUM_THREADS=1
unless it is set.

Replay reads the run and writes nothing to it (the checkpoint is verified in a private copy).

Exit codes: 0 every compared metric within --tolerance; 1 some differ; 2 bad input (no such step,
no checkpoint before it, missing rollouts, a bad key...), with one `error: ...` line; 3 the replay
itself failed (its log on stderr)."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from grpo_api.contracts import BAD_INPUT_EXIT_CODE as BAD_INPUT
from grpo_trainer.state import FILE as STATE_FILE
from grpo_trainer.state import TrainerState

MATCH, MISMATCH, FAILED = 0, 1, 3
GPU_TOLERANCE = 1e-3
# Step metrics that depend on time, or that replay doesn't recompute (the epoch is the sampler's).
NOT_REPLAYED = ("timing_s/", "perf/throughput", "perf/mfu", "training/epoch")


def replay(argv: list[str]) -> int:
    """Train one step of a run again and compare it with what the run logged."""
    from grpo_api.run_argument import add_run_arguments
    parser = argparse.ArgumentParser(
        prog="grpo replay", description="Train step N of a run again, from the checkpoint before it and the "
        "rollouts it trained on, under torchrun with the run's world size; compare the loss, gradient norm, KL, "
        "advantages and the other update metrics with the run's metrics.jsonl. Exit 0: all match within "
        "--tolerance; 1: some differ; 2: bad input. Writes nothing to the run.")
    add_run_arguments(parser)
    parser.add_argument("--step", type=int, required=True, metavar="N", help="the step to replay")
    parser.add_argument("--tolerance", type=float, default=None, metavar="T",
                        help="a metric matches when |replayed - logged| <= T * max(1, |logged|); default 0 (exact) "
                             f"on CPU, {GPU_TOLERANCE:g} on GPU")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="replay under a changed spec (what-if; the optimizer and lr schedule come from the "
                             "checkpoint)")
    parser.add_argument("--key-file", default=None,
                        help="the job's checkpoint key (hex); default: GRPO_CHECKPOINT_KEY, else the run folder's "
                             "checkpoint.key (grpo run)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # a torchrun rank: its plan file
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(Path(args.worker))
    from grpo_api.signing import CheckpointKeyError
    try:
        plan, logged, key = _plan(args)
    except (ValueError, OSError, CheckpointKeyError) as exc:     # JobError, ManifestError, StorageError too
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    return _run(plan, logged, key)


# --- the plan: everything checked before a rank starts --------------------------------------------

def _plan(args: argparse.Namespace) -> tuple[dict, dict, bytes]:
    """(the workers' plan, the step's logged metrics, the checkpoint key); ValueError for bad input."""
    from grpo_api.jobfile import parse_job
    from grpo_trainer.rollout_history import RolloutHistory
    from grpo_api.run_argument import open_run
    from grpo_trainer.commands import checkpoint_key

    if args.tolerance is not None and not args.tolerance >= 0:
        raise ValueError(f"--tolerance: must be 0 or more (got {args.tolerance})")
    uri, storage = open_run(args)
    history = RolloutHistory(uri, storage)
    layout, step = history.layout, args.step
    logged = _logged(storage, layout, step)
    if step > history.trained_step():
        raise ValueError(f"--step {step}: not trained yet (progress.json: step {history.trained_step()})")
    before = step - 1
    if before < 1:
        raise ValueError(f"--step {step}: no checkpoint before it: a run's first step starts from spec.model.path, "
                         "and replay starts from a checkpoint (checkpoints/step-1 is the first)")
    uri = layout.checkpoint(before)
    if not storage.exists(f"{uri}/manifest.json"):
        have = [s for s, _ in _checkpoints(layout, storage)]
        raise ValueError(f"--step {step}: no checkpoint before it ({uri} is not a complete checkpoint; the run has "
                         f"checkpoints of steps {have or 'none'}): replay starts from the checkpoint of step "
                         f"{before} (trainer.saveFreq, trainer.keepCheckpoints)")
    key = checkpoint_key(uri, args.key_file)
    state = _trainer_state(uri, storage, key)

    record = history.accepted(step)
    job_doc, total_steps = _trained_under(state, record, storage, layout, key, step)
    job = parse_job(job_doc, args.overrides, f"the job of step {step}")
    spec = job.spec
    if record is not None:
        folder = layout.step_dir("rollouts", step)
        shards, keep, off_policy = [f"{folder}/{name}" for name in record.shards], record.keep, record.off_policy
        world = record.world_size
    else:       # a run written before steps recorded their rollouts
        if spec.algorithm.filter_groups:
            raise ValueError(f"--step {step}: the run predates rollouts/step-N/accepted.json, and with "
                             "algorithm.filterGroups which prompts the step kept is not known")
        shards, keep, off_policy = list(history.accepted_shards(step).values()), None, spec.rollout.max_staleness > 0
        world = state.trainer.world_size or len(state.checkpointer.rng.get("torch_by_rank") or [0])
    if not shards:
        raise ValueError(f"--step {step}: no rollout shards under {layout.step_dir('rollouts', step)}")
    for shard in shards:
        if not storage.exists(shard):
            raise ValueError(f"--step {step}: its rollout shard {shard} is gone")
    device = _device(spec.trainer.device, world, step)
    plan = {"run": layout.root, "step": step, "checkpoint": uri, "job": job.model_dump(mode="json", by_alias=True),
            "shards": shards, "keep": keep, "off_policy": off_policy, "world_size": world,
            "total_steps": total_steps, "endpoint": args.endpoint, "device": device,
            "tolerance": args.tolerance if args.tolerance is not None else 0.0 if device == "cpu" else GPU_TOLERANCE}
    return plan, logged, key


def _logged(storage, layout, step: int) -> dict:
    """Step `step`'s line of metrics.jsonl (a resumed run rewrote the steps after its checkpoint)."""
    try:
        lines = storage.read_bytes(layout.metrics).decode().splitlines()
    except FileNotFoundError:
        raise ValueError(f"{layout.metrics}: missing; replay compares with it (trainer.loggers: jsonl)") from None
    rows = {row["step"]: row for row in map(json.loads, filter(str.strip, lines))}
    if step not in rows:
        logged = sorted(s for s in rows if s > 0)
        shown = f"steps {logged[0]} to {logged[-1]}" if logged else "no step"
        raise ValueError(f"--step {step}: no such step in {layout.metrics} (it has {shown})")
    return rows[step]


def _trainer_state(uri: str, storage, key: bytes) -> TrainerState:
    """The checkpoint's trainer_state.json, its signed manifest and sha256 checked (the workers
    verify every file again when they load it)."""
    import hashlib

    from grpo_api import signing
    where = f"{uri}/manifest.json"
    manifest = signing.verify(storage.read_bytes(where), key, where)
    data = storage.read_bytes(f"{uri}/{STATE_FILE}")
    if hashlib.sha256(data).hexdigest() != manifest["files"].get(STATE_FILE, {}).get("sha256"):
        raise signing.ManifestError(f"{uri}/{STATE_FILE}: its sha256 does not match the signed manifest")
    return TrainerState.from_json(data)


def _trained_under(state: TrainerState, record, storage, layout, key: bytes, step: int) -> tuple[dict, int]:
    """(the job step `step` was trained under, its total steps). Every checkpoint keeps its
    trainer's job, signed; the step's record names the digest of its trainer's spec. That is the
    checkpoint before the step's, unless the run was restarted with a changed spec (a longer
    totalSteps) after it: then a later checkpoint of the trainer that trained the step."""
    from grpo_trainer.rollout_history import spec_digest
    if record is None:      # a run written before steps recorded their spec
        return state.trainer.job or _job_file(storage, layout), (state.trainer.total_steps
                                                                or _total_steps(storage, layout))
    later = (_trainer_state(uri, storage, key) for s, uri in _checkpoints(layout, storage) if s >= step)
    for candidate in itertools.chain([state], later):
        job = candidate.trainer.job
        if job is not None and spec_digest(job["spec"]) == record.spec_sha256:
            return job, candidate.trainer.total_steps
    raise ValueError(f"--step {step}: no checkpoint keeps the spec it was trained under (the run was restarted "
                     f"with a changed spec after checkpoint step-{state.trainer.step}, and that trainer left no checkpoint)")


def _checkpoints(layout, storage) -> list[tuple[int, str]]:
    """(step, uri) of the run's complete checkpoints, oldest first (checkpoint.complete_checkpoints,
    without importing torch here: the ranks do)."""
    found = []
    for uri in storage.list(layout.checkpoints):
        name = uri.rsplit("/", 1)[-1]
        if name.startswith("step-") and name[5:].isdigit() and storage.exists(f"{uri}/manifest.json"):
            found.append((int(name[5:]), uri))
    return sorted(found)


def _job_file(storage, layout) -> dict:
    """A checkpoint written before checkpoints kept the job: `grpo run`'s <run>/job.yaml."""
    import yaml
    try:
        return yaml.safe_load(storage.read_bytes(layout.job_file))
    except FileNotFoundError:
        raise ValueError(f"{layout.root}: the run records no spec (its checkpoints predate keeping it, and there "
                         "is no job.yaml)") from None


def _total_steps(storage, layout) -> int | None:
    from grpo_api.spec import Progress
    try:
        progress = Progress.from_json(storage.read_bytes(layout.progress))
    except FileNotFoundError:
        return None
    return progress.total_steps if progress else None


def _device(want: str, world: int, step: int) -> str:
    """"cpu" or "cuda", as the trainer's ranks pick it (model.training_device); on GPU, one per rank."""
    if want == "cpu":
        return "cpu"
    import torch
    if want == "auto" and not torch.cuda.is_available():
        return "cpu"
    gpus = torch.cuda.device_count()
    if gpus < world:
        raise ValueError(f"--step {step}: it was trained on {world} ranks, and this machine has {gpus} GPUs: the "
                         f"same sums need the same ranks and micro-batches (replay on a machine with {world} GPUs, "
                         "or on CPU with --set trainer.device=cpu, which won't match exactly)")
    return "cuda"


# --- the ranks, under torchrun ---------------------------------------------------------------------

def _run(plan: dict, logged: dict, key: bytes) -> int:
    world, step = plan["world_size"], plan["step"]
    print(f"Replaying step {step} of {plan['run']} from {plan['checkpoint'].removeprefix(plan['run'] + '/')} "
          f"on {world} {plan['device']} ranks...", flush=True)
    with tempfile.TemporaryDirectory(prefix="grpo-replay-") as tmp:
        plan_file, result_file, log_file = Path(tmp, "plan.json"), Path(tmp, "result.json"), Path(tmp, "ranks.log")
        plan_file.write_text(json.dumps({**plan, "result": str(result_file)}))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                "--no-python", sys.executable, "-m", "grpo_trainer.replay", plan["run"], "--step", str(step),
                "--worker", str(plan_file)]
        env = {**os.environ, "GRPO_CHECKPOINT_KEY": key.hex()}
        with open(log_file, "wb") as out:
            code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
        result = json.loads(result_file.read_text()) if result_file.exists() else None
        if result is not None and "error" in result:
            print(f"error: {result['error']}", file=sys.stderr)
            return BAD_INPUT
        if result is None:      # (a result with a non-zero exit: a rank's teardown, after the step)
            print(log_file.read_text(errors="replace")[-8000:], file=sys.stderr)
            print(f"error: the replay's ranks failed (torchrun exit {code})", file=sys.stderr)
            return FAILED
    rows, differ = compare(logged, result["metrics"], plan["tolerance"])
    print(table(rows))
    not_logged = sorted(k for k in result["metrics"] if k not in logged and not k.startswith(NOT_REPLAYED))
    if not_logged:
        print(f"Not in the run's log, not compared: {', '.join(not_logged)}")
    if differ:
        print(f"{len(differ)} of {len(rows)} metrics differ beyond the tolerance ({plan['tolerance']:g}): "
              f"{', '.join(differ)}")
        return MISMATCH
    within = "exactly" if plan["tolerance"] == 0 else f"within {plan['tolerance']:g}"
    print(f"All {len(rows)} metrics match ({within}).")
    return MATCH


def compare(logged: dict, replayed: dict, tolerance: float) -> tuple[list[tuple], list[str]]:
    """([(metric, logged, replayed, |diff|, matches)], the metrics that differ), over what both have."""
    rows, differ = [], []
    for name in sorted(replayed):
        if name not in logged or name.startswith(NOT_REPLAYED):
            continue
        a, b = float(logged[name]), float(replayed[name])
        diff = abs(a - b) if not (math.isnan(a) and math.isnan(b)) else 0.0
        ok = diff <= tolerance * max(1.0, abs(a))      # a NaN on one side only: never
        rows.append((name, a, b, diff, ok))
        if not ok:
            differ.append(name)
    return rows, differ


def table(rows: list[tuple]) -> str:
    width = max([len("metric")] + [len(r[0]) for r in rows])
    lines = [f"{'metric':<{width}}  {'logged':>24}  {'replayed':>24}  {'|diff|':>10}"]
    for name, a, b, diff, ok in rows:
        lines.append(f"{name:<{width}}  {a!r:>24}  {b!r:>24}  {diff:>10.3g}{'' if ok else '  <- differs'}")
    return "\n".join(lines)


def _worker(plan_file: Path) -> int:
    """One torchrun rank: the actor as the trainer builds it, the checkpoint, the step's samples, one
    update (train_on, the trainer's own code); rank 0 writes the metrics as the trainer logs them."""
    plan = json.loads(plan_file.read_text())
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl" if plan["device"] == "cuda" else "gloo")
    rank = dist.get_rank()

    def answer(result: dict) -> None:
        if rank == 0:
            Path(plan["result"]).write_text(json.dumps(result))

    try:
        if dist.get_world_size() != plan["world_size"]:
            raise ValueError(f"{dist.get_world_size()} ranks for a step trained on {plan['world_size']}")
        answer({"metrics": _replay_step(plan, torch, dist)})
        return 0
    except Exception as exc:
        from grpo_api.signing import ManifestError
        if isinstance(exc, (ManifestError, ValueError)):     # bad data found on load: a changed file, a bad shard
            answer({"error": str(exc)})
            return BAD_INPUT
        raise
    finally:
        dist.destroy_process_group()


def _replay_step(plan: dict, torch, dist) -> dict[str, float]:
    import pyarrow as pa

    from grpo_api import signing
    from grpo_api.jobfile import parse_job
    from grpo_api.model_cache import local_model
    from grpo_api.spec import StorageSpec
    from grpo_api.storage import Storage
    from grpo_trainer import batch as batching
    from grpo_trainer import checkpoint
    from grpo_trainer.actor import Actor
    from grpo_trainer.metrics import setup_logging, step_metrics
    from grpo_trainer.model import load_tokenizer, training_device
    from grpo_trainer.rollouts import RolloutBatch

    spec = parse_job(plan["job"]).spec
    setup_logging(dist.get_rank())
    device = training_device(plan["device"])
    torch.manual_seed(spec.trainer.seed)          # as the trainer starts; the checkpoint sets every rank's RNG
    storage = Storage(StorageSpec(endpoint=plan["endpoint"]) if plan["endpoint"] else None)
    model_spec = local_model(spec.model, spec.storage, log=lambda *_: None)
    tokenizer = load_tokenizer(model_spec)
    actor = Actor(model_spec, spec, device=device, total_steps=plan["total_steps"],
                  pad_token_id=tokenizer.pad_token_id)
    state = checkpoint.load(plan["checkpoint"], parts=actor.checkpoint_parts(), storage=storage,
                            key=signing.read_key(), device=device)
    actor.load_state_dict(state.actor)
    samples = batching.samples_from_table(pa.concat_tables([storage.read_table(u) for u in plan["shards"]]),
                                          read_image=functools.cache(storage.read_bytes))   # a VL model's images
    if plan["keep"] is not None:
        samples = batching.keep_prompts(samples, plan["keep"])
    version = state.trainer.policy_version
    try:
        batching.check_complete(samples, spec.data.train_batch_size, spec.rollout.n)
        staleness = batching.check_staleness(samples, version, spec.rollout.max_staleness)
    except RuntimeError as exc:
        raise ValueError(f"step {plan['step']}'s rollouts: {exc}") from None
    update = actor.train_on(samples, off_policy=plan["off_policy"], step=plan["step"])
    batch = RolloutBatch(step=plan["step"], epoch=-1, policy_version=min(s.policy_version for s in samples),
                         uris=plan["shards"], prompts=spec.data.train_batch_size, sampler_before={},
                         off_policy=plan["off_policy"], staleness=staleness)
    return step_metrics(plan["step"], version + 1, samples, batch, update, {"timing_s/step": 1.0},
                        world=dist.get_world_size(), device=device)


if __name__ == "__main__":      # a torchrun rank (`_run`): no entry-point lookup, whatever the cwd holds
    sys.exit(replay(sys.argv[1:]))
