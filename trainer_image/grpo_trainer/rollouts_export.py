"""`grpo rollouts export RUN`: a run's accepted rollouts as one parquet or JSONL dataset (issue 35),
one row per sample, the decoded prompt and response next to the ids. The reading and filtering
is grpo_trainer.rollout_history; this adds the tokenizer (the run's model), a VL run's images
(--images: inlined as verl's {bytes, path}, copied once beside the output, or the run's URIs) and
the writers.

Exit codes: 0 done; 2 bad input (RUN, the options, no tokenizer), with one `error: ...` line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa

from grpo_api.contracts import BAD_INPUT_EXIT_CODE as BAD_INPUT
from grpo_trainer.state import FILE as STATE_FILE
from grpo_trainer.state import TrainerState


def rollouts(argv: list[str]) -> int:
    """The run's rollout history (`grpo rollouts export`)."""
    from grpo_api.run_argument import add_run_arguments
    parser = argparse.ArgumentParser(prog="grpo rollouts", description="A run's rollout history.")
    sub = parser.add_subparsers(dest="action", required=True)
    export = sub.add_parser(
        "export", help="export the accepted rollouts of a run as a dataset",
        description="Export every accepted rollout of a run (one row per sample: step, uid, prompt_index, "
                    "sample_index, data_source, reward, reward_extra, policy_version, finish_reason, lengths, ids "
                    "and the decoded prompt_text/response_text; a vision-language run's images, see --images) as "
                    "parquet or JSONL, loadable with Hugging Face datasets. Steps not trained yet (a running job) "
                    "are skipped. S3 credentials come from "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; --endpoint for S3-compatible servers.")
    add_run_arguments(export)
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
    export.add_argument("--images", choices=["inline", "files", "uris"], default=None,
                        help="a vision-language run's prompt images (the images column). inline: verl's dataset "
                             "layout, a list of {bytes, path} per row holding the image's bytes (path: its URI in "
                             "the run), so the export feeds verl or data.imageKey as it is; a group's samples each "
                             "repeat their prompt's bytes. files: each image copied once beside the output (for "
                             "rollouts.parquet: rollouts-images/<sha256>.png, .jpg ...), the column {bytes: null, "
                             "path: that file's absolute path}. uris: the URIs the run's records hold "
                             "(<run>/images/<sha256>). "
                             "Default: inline for parquet, files for JSONL (JSON holds no bytes)")
    export.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer folder or hub id; default: the run's model (its job.yaml, else its "
                             "latest checkpoint's model)")
    args = parser.parse_args(argv)
    try:
        return _export(args)
    except (ValueError, OSError) as exc:      # RunNotFound, StorageError, a bad option, an unreadable tokenizer
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT


def _export(args: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    from grpo_trainer.rollout_history import EXPORT_SCHEMA, Filters, RolloutHistory, parse_steps
    from grpo_api.run_argument import open_run

    fmt = args.format or ("jsonl" if args.output and Path(args.output).suffix in (".jsonl", ".json") else "parquet")
    out = Path(args.output or f"rollouts.{fmt}")
    image_mode = args.images or ("inline" if fmt == "parquet" else "files")
    if image_mode == "inline" and fmt == "jsonl":
        raise ValueError("--images inline: JSONL can't hold image bytes; use --images files or uris, or --format "
                         "parquet")
    first, last = parse_steps(args.steps) if args.steps else (None, None)
    filters = Filters(first_step=first, last_step=last, min_reward=args.min_reward, max_reward=args.max_reward,
                      data_sources=args.data_source, min_length=args.min_length, max_length=args.max_length)
    uri, storage = open_run(args)
    history = RolloutHistory(uri, storage)
    tokenizer = None if args.no_text else run_tokenizer(history, storage, args.tokenizer)
    schema = EXPORT_SCHEMA if tokenizer is None else EXPORT_SCHEMA.append(
        pa.field("prompt_text", pa.string())).append(pa.field("response_text", pa.string()))
    images = None if image_mode == "uris" else ExportImages(image_mode, history, out.with_name(f"{out.stem}-images"))
    if images is not None:
        schema = schema.set(schema.get_field_index("images"), pa.field("images", IMAGES_TYPE))

    skipped: list[int] = []
    rows = 0
    tmp = out.with_name(f".tmp-{out.name}")       # a failed export leaves no half file under the name
    writer = pq.ParquetWriter(tmp, schema) if fmt == "parquet" else None
    try:
        with open(tmp, "w") if writer is None else _nothing() as jsonl:
            for table in history.tables(filters, skipped):
                if images is not None:
                    table = table.set_column(table.schema.get_field_index("images"), "images",
                                             images.column(table["images"]))
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
    if images is not None and images.copied:
        note += f"; {len(images.copied)} images in {images.folder}"
    print(f"Exported {rows} samples of {history.layout.root} to {out}{note}")
    return 0


IMAGES_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
"""A row's images in verl's dataset layout (Hugging Face datasets' Image: {bytes, path})."""


class ExportImages:
    """The images column as --images asks (inline or files), from the run's stored images
    (RunLayout.image): the run being exported is read, whatever URI its records hold (a run copied
    from S3 to a folder still exports), and each image's bytes are checked against its name."""

    def __init__(self, mode: str, history, folder: Path):
        self.mode, self.history, self.folder = mode, history, folder
        self.copied: dict[str, str] = {}       # files: image name -> the copy's path

    def column(self, uris: pa.ChunkedArray) -> pa.Array:
        read: dict[str, bytes] = {}            # a shard's groups repeat their prompt's image n times
        return pa.array([None if row is None else [self._entry(uri, read) for uri in row]
                         for row in uris.to_pylist()], IMAGES_TYPE)

    def _entry(self, uri: str, read: dict[str, bytes]) -> dict:
        from grpo_api.images import image_name
        name = image_name(uri)
        if name is None:
            raise ValueError(f"{uri}: a record names an image that is not one of the run's (images/<sha256>)")
        if name in self.copied:
            return {"bytes": None, "path": self.copied[name]}
        if name not in read:
            read[name] = self._read(name)
        if self.mode == "inline":
            return {"bytes": read[name], "path": uri}
        self.copied[name] = str(self._copy(name, read[name]))
        return {"bytes": None, "path": self.copied[name]}

    def _read(self, name: str) -> bytes:
        import hashlib
        uri = self.history.layout.image(name)
        try:
            data = self.history.storage.read_bytes(uri)
        except FileNotFoundError:
            raise ValueError(f"{uri}: an image the rollout records name is missing from the run") from None
        if hashlib.sha256(data).hexdigest() != name:
            raise ValueError(f"{uri}: its bytes don't hash to its name (a damaged copy of the run)")
        return data

    def _copy(self, name: str, data: bytes) -> Path:
        from grpo_api.images import image_kind
        path = (self.folder / f"{name}{image_kind(data)[1]}").resolve()
        if not path.exists():                  # named by its hash: one there already is this image
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".tmp-{path.name}")
            tmp.write_bytes(data)
            tmp.replace(path)
        return path


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


class NoModelYet(ValueError):
    """The run records no model yet: a job's run has none before its first checkpoint (only
    `grpo run` writes <run>/job.yaml)."""


def run_tokenizer(history, storage, path: str | None):
    """--tokenizer, else the run's model: `grpo run` keeps the job in <run>/job.yaml; every
    checkpoint records the model it trained (trainer_state.json). A model in object storage is
    fetched with the run's storage settings (--endpoint)."""
    from transformers import AutoTokenizer

    from grpo_api.model_cache import local_model
    from grpo_api.spec import ModelSpec
    if path is None:
        model = _run_model(history, storage, ModelSpec)
        if model is None:
            raise NoModelYet(f"{history.layout.root}: the run records no model (no job.yaml, no checkpoint): pass "
                             "--tokenizer PATH, or --no-text")
        model = local_model(model, storage.spec, log=lambda *a, **k: print(*a, file=sys.stderr, **k))
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
    try:
        job = yaml.safe_load(storage.read_bytes(history.layout.job_file))
        return model_spec_cls.model_validate(job["spec"]["model"])
    except (FileNotFoundError, StorageError, KeyError, TypeError):
        pass
    checkpoints = sorted((int(u.rsplit("-", 1)[1]), u) for u in storage.list(history.layout.checkpoints)
                         if u.rsplit("/", 1)[-1].startswith("step-") and u.rsplit("-", 1)[1].isdigit())
    for _, uri in reversed(checkpoints):
        try:
            model = TrainerState.from_json(storage.read_bytes(f"{uri}/{STATE_FILE}")).trainer.model
        except FileNotFoundError:
            continue
        if model is not None:
            return model_spec_cls.model_validate(model)
    return None
