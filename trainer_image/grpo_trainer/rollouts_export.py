"""`grpo rollouts export RUN`: a run's accepted rollouts as one parquet or JSONL dataset (issue 35),
one row per sample, the decoded prompt and response next to the ids. The reading and filtering
is grpo_api.rollout_history; this adds the tokenizer (the run's model) and the writers.

Exit codes: 0 done; 2 bad input (RUN, the options, no tokenizer), with one `error: ...` line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BAD_INPUT = 2


def rollouts(argv: list[str]) -> int:
    """The run's rollout history (`grpo rollouts export`)."""
    parser = argparse.ArgumentParser(prog="grpo rollouts", description="A run's rollout history.")
    sub = parser.add_subparsers(dest="action", required=True)
    export = sub.add_parser(
        "export", help="export the accepted rollouts of a run as a dataset",
        description="Export every accepted rollout of a run (one row per sample: step, uid, prompt_index, "
                    "sample_index, data_source, reward, reward_extra, policy_version, finish_reason, lengths, ids "
                    "and the decoded prompt_text/response_text) as parquet or JSONL, loadable with Hugging Face "
                    "datasets. Steps not trained yet (a running job) are skipped. S3 credentials come from "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; --endpoint for S3-compatible servers.")
    export.add_argument("run", metavar="RUN", help="the run's URI (status.runUri: s3://..., file://...) or folder")
    export.add_argument("-o", "--output", default=None,
                        help="output file (default: rollouts.parquet, or rollouts.jsonl with --format jsonl)")
    export.add_argument("--format", choices=["parquet", "jsonl"], default=None,
                        help="default: from the output's suffix (.jsonl/.json: jsonl), else parquet")
    export.add_argument("--steps", default=None, metavar="A:B", help="steps A to B, both included (A:, :B, N)")
    export.add_argument("--min-reward", type=float, default=None)
    export.add_argument("--max-reward", type=float, default=None)
    export.add_argument("--data-source", action="append", default=[], metavar="S",
                        help="only samples of this data_source (repeatable)")
    export.add_argument("--min-length", type=int, default=None, metavar="N", help="at least N response tokens")
    export.add_argument("--max-length", type=int, default=None, metavar="N", help="at most N response tokens")
    export.add_argument("--no-text", action="store_true", help="ids only, no decoding (no tokenizer needed)")
    export.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer folder or hub id; default: the run's model (its job.yaml, else its "
                             "latest checkpoint's model)")
    export.add_argument("--endpoint", default=None, help="S3-compatible endpoint URL (spec.storage.endpoint)")
    args = parser.parse_args(argv)
    try:
        return _export(args)
    except (ValueError, OSError) as exc:      # RunNotFound, StorageError, a bad option, an unreadable tokenizer
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT


def _export(args: argparse.Namespace) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpo_api.rollout_history import EXPORT_SCHEMA, Filters, RolloutHistory, parse_steps
    from grpo_api.spec import StorageSpec
    from grpo_api.storage import Storage

    fmt = args.format or ("jsonl" if args.output and Path(args.output).suffix in (".jsonl", ".json") else "parquet")
    out = Path(args.output or f"rollouts.{fmt}")
    first, last = parse_steps(args.steps) if args.steps else (None, None)
    filters = Filters(first_step=first, last_step=last, min_reward=args.min_reward, max_reward=args.max_reward,
                      data_sources=args.data_source, min_length=args.min_length, max_length=args.max_length)
    storage = Storage(StorageSpec(endpoint=args.endpoint) if args.endpoint else None)
    history = RolloutHistory(args.run, storage)
    tokenizer = None if args.no_text else run_tokenizer(history, storage, args.tokenizer)
    schema = EXPORT_SCHEMA if tokenizer is None else EXPORT_SCHEMA.append(
        pa.field("prompt_text", pa.string())).append(pa.field("response_text", pa.string()))

    skipped: list[int] = []
    rows = 0
    tmp = out.with_name(f".tmp-{out.name}")       # a failed export leaves no half file under the name
    writer = pq.ParquetWriter(tmp, schema) if fmt == "parquet" else None
    try:
        with open(tmp, "w") if writer is None else _nothing() as jsonl:
            for table in history.tables(filters, skipped):
                if tokenizer is not None:
                    table = table.append_column("prompt_text", pa.array(
                        tokenizer.batch_decode(table["prompt_ids"].to_pylist()), pa.string()))
                    table = table.append_column("response_text", pa.array(
                        tokenizer.batch_decode(table["response_ids"].to_pylist()), pa.string()))
                if writer is not None:
                    writer.write_table(table)
                else:
                    for row in table.to_pylist():
                        jsonl.write(json.dumps(row) + "\n")
                rows += table.num_rows
        if writer is not None:
            writer.close()
            writer = None
        tmp.replace(out)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    note = f"; steps {_ranges(skipped)} not trained yet, skipped" if skipped else ""
    if (retention := history.retention()) is not None and (gone := retention.describe(first, last)):
        note += f"; {gone}"
    print(f"Exported {rows} samples of {history.layout.root} to {out}{note}")
    return 0


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def run_tokenizer(history, storage, path: str | None):
    """--tokenizer, else the run's model: `grpo run` keeps the job in <run>/job.yaml; every
    checkpoint records the model it trained (trainer_state.json)."""
    from transformers import AutoTokenizer

    from grpo_api.model_cache import local_model
    from grpo_api.spec import ModelSpec
    if path is None:
        model = _run_model(history, storage, ModelSpec)
        if model is None:
            raise ValueError(f"{history.layout.root}: the run records no model (no job.yaml, no checkpoint): pass "
                             "--tokenizer PATH, or --no-text")
        model = local_model(model, log=lambda *a, **k: print(*a, file=sys.stderr, **k))
        path, trust = model.tokenizer_path or model.path, model.trust_remote_code
    else:
        trust = False
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    except (OSError, ValueError) as exc:
        raise ValueError(f"can't load a tokenizer from {path!r} (--tokenizer PATH, or --no-text): {exc}") from None


def _run_model(history, storage, model_spec_cls):
    import yaml

    from grpo_api.storage import StorageError
    root = history.layout.root
    try:
        job = yaml.safe_load(storage.read_bytes(f"{root}/job.yaml"))
        return model_spec_cls.model_validate(job["spec"]["model"])
    except (FileNotFoundError, StorageError, KeyError, TypeError):
        pass
    checkpoints = sorted((int(u.rsplit("-", 1)[1]), u) for u in storage.list(history.layout.checkpoints)
                         if u.rsplit("/", 1)[-1].startswith("step-") and u.rsplit("-", 1)[1].isdigit())
    for _, uri in reversed(checkpoints):
        try:
            state = json.loads(storage.read_bytes(f"{uri}/trainer_state.json"))
        except FileNotFoundError:
            continue
        if "model" in state:
            return model_spec_cls.model_validate(state["model"])
    return None
