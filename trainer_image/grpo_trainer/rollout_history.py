"""A run's rollout history read back from its object storage (`grpo rollouts export`, issue 35).

Every training step keeps its rollout shards under `<run>/rollouts/step-N/` (records.py). Only
accepted shards count: trainer rank 0 records the ones it trains on in `accepted.json` beside
them before the update (`AcceptedRollouts`). Runs written before that record existed fall back
to the dispatcher's rule (grpo_trainer.rollout_client): a shard is tried again, as
`<shard>-attempt-<K+1>`, only after attempt K failed, and a failed attempt may still write its
file late; so of each shard the highest attempt is the one the trainer read. That rule is wrong
after a restart, whose attempts count from 1 again below a killed trainer's higher ones: the
record is why. A step counts once the trainer has trained it (progress.json's `step`): the
shards of a step still in progress may be a failed attempt whose retry is under way, so they are
skipped, never an error.

Steps that storage.keepRolloutsSteps deleted are named in rollouts/retention.json
(`RetentionRecord`) and never read. Reads one shard at a time (bounded memory). No torch or transformers here: the command that
decodes the ids lives in grpo_trainer.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from grpo_api.records import ROLLOUT_OPTIONAL, ROLLOUT_SCHEMA, RunLayout
from grpo_api.run_argument import RunNotFound, run_uri
from grpo_api.spec import Progress
from grpo_api.storage import Storage

# train-shard-000-attempt-2.parquet; dynamic sampling's extra rounds are train-r0-shard-...;
# validation's shards (val0-...) are not training history.
_TRAIN_SHARD = re.compile(r"^(?P<shard>train(-r\d+)?-.+)-attempt-(?P<attempt>\d+)\.parquet$")
_STEP_DIR = re.compile(r"^step-(\d+)$")

EXPORT_SCHEMA = pa.schema([
    ("step", pa.int64()),
    ("shard", pa.string()),
    *[ROLLOUT_SCHEMA.field(name) for name in ("uid", "prompt_index", "sample_index", "data_source", "reward",
                                               "reward_extra", "policy_version", "finish_reason", "worker",
                                               "ground_truth")],
    ("prompt_length", pa.int64()),
    ("response_length", pa.int64()),
    *[ROLLOUT_SCHEMA.field(name) for name in ("prompt_ids", "response_ids", "response_logprobs",
                                               *ROLLOUT_OPTIONAL)],
])
"""One row per sample. `grpo rollouts export` adds prompt_text and response_text after it."""


@dataclass
class AcceptedRollouts:
    """What one step trained on, as trainer rank 0 records it before the update
    (`RunLayout.accepted_rollouts`): enough to read the same samples again and to know how they
    were trained (`grpo replay`)."""

    step: int
    shards: list[str]              # rollout shard file names in rollouts/step-N/, in the order read
    keep: list[int] | None         # dynamic sampling: the prompts trained on (None: all)
    off_policy: bool               # the PPO ratio's old policy was the engine's log-probs
    world_size: int                # trainer ranks (each trains its share of every mini-batch)
    spec_sha256: str               # spec_digest of the trainer's resolved spec

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> AcceptedRollouts:
        try:
            record = cls(**json.loads(data))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: not an accepted-rollouts record: {exc}") from None
        if any("/" in name for name in record.shards):
            raise ValueError(f"{where}: a shard outside its step's folder: {record.shards}")
        return record


@dataclass
class RetentionRecord:
    """The rollout steps storage.keepRolloutsSteps deleted (`RunLayout.rollouts_retention`), as
    inclusive [first, last] ranges. The trainer writes it before it deletes, so a step being
    deleted already reads as gone."""

    keep_rollouts_steps: int
    deleted: list[list[int]] = field(default_factory=list)

    def with_deleted(self, steps: list[int]) -> RetentionRecord:
        return RetentionRecord(self.keep_rollouts_steps, step_ranges(sorted(
            {s for a, b in self.deleted for s in range(a, b + 1)} | set(steps))))

    def __contains__(self, step: int) -> bool:
        return any(a <= step <= b for a, b in self.deleted)

    def describe(self, first: int | None = None, last: int | None = None) -> str:
        """"steps 1-40 deleted by storage.keepRolloutsSteps (2)" for the ranges within [first, last]; "" if none."""
        lo, hi = first if first is not None else -1, last if last is not None else 1 << 62
        ranges = [[max(a, lo), min(b, hi)] for a, b in self.deleted if b >= lo and a <= hi]
        if not ranges:
            return ""
        word = "step" if len(ranges) == 1 and ranges[0][0] == ranges[0][1] else "steps"
        return f"{word} {format_ranges(ranges)} deleted by storage.keepRolloutsSteps ({self.keep_rollouts_steps})"

    def to_json(self) -> bytes:
        return json.dumps({"keepRolloutsSteps": self.keep_rollouts_steps, "deleted": self.deleted}).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> RetentionRecord:
        try:
            record = json.loads(data)
            return cls(int(record["keepRolloutsSteps"]), [[int(a), int(b)] for a, b in record["deleted"]])
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{where}: not a rollout retention record: {exc}") from None


def step_ranges(steps: list[int]) -> list[list[int]]:
    """Sorted steps as inclusive [first, last] runs: [1, 2, 3, 7] -> [[1, 3], [7, 7]]."""
    ranges: list[list[int]] = []
    for s in steps:
        if ranges and s == ranges[-1][1] + 1:
            ranges[-1][1] = s
        else:
            ranges.append([s, s])
    return ranges


def format_ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def spec_digest(spec: dict) -> str:
    """sha256 of a resolved spec (GRPOJobSpec.model_dump(mode="json", by_alias=True)): the same
    spec, the same digest, whichever process dumped it."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


@dataclass
class Filters:
    """Inclusive bounds; None: no bound."""
    first_step: int | None = None
    last_step: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    data_sources: list[str] = field(default_factory=list)
    min_length: int | None = None      # response tokens
    max_length: int | None = None

    def wants_step(self, step: int) -> bool:
        return ((self.first_step is None or step >= self.first_step)
                and (self.last_step is None or step <= self.last_step))

    def mask(self, table: pa.Table) -> pa.ChunkedArray | None:
        conditions = []
        if self.min_reward is not None:
            conditions.append(pc.greater_equal(table["reward"], self.min_reward))
        if self.max_reward is not None:
            conditions.append(pc.less_equal(table["reward"], self.max_reward))
        if self.data_sources:
            conditions.append(pc.is_in(table["data_source"], value_set=pa.array(self.data_sources)))
        if self.min_length is not None:
            conditions.append(pc.greater_equal(table["response_length"], self.min_length))
        if self.max_length is not None:
            conditions.append(pc.less_equal(table["response_length"], self.max_length))
        if not conditions:
            return None
        out = conditions[0]
        for c in conditions[1:]:
            out = pc.and_(out, c)
        return pc.fill_null(out, False)


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """`A:B` (both inclusive), `A:`, `:B` or `N`."""
    first, sep, last = text.partition(":")
    try:
        a = int(first) if first.strip() else None
        b = (int(last) if last.strip() else None) if sep else a
    except ValueError:
        raise ValueError(f"--steps: {text!r} is not A:B, A:, :B or N (step numbers)") from None
    if a is not None and b is not None and a > b:
        raise ValueError(f"--steps: {text!r}: the first step is after the last")
    return a, b


class RolloutHistory:
    def __init__(self, run: str, storage: Storage):
        self.layout, self.storage = RunLayout(run_uri(run)), storage
        root = self.layout.root
        if not storage.exists(self.layout.progress) and not storage.exists(self.layout.rollouts):
            raise RunNotFound(f"{root}: not a run (neither progress.json nor rollouts/ under it)")

    def trained_step(self) -> int:
        """The last step the trainer trained (0: none yet)."""
        try:
            progress = Progress.from_json(self.storage.read_bytes(self.layout.progress))
        except FileNotFoundError:
            return 0
        return progress.step if progress else 0

    def steps(self) -> list[int]:
        """Steps with a rollouts folder, in order."""
        steps = []
        for uri in self.storage.list(self.layout.rollouts):
            m = _STEP_DIR.match(uri.rsplit("/", 1)[-1])
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def retention(self) -> RetentionRecord | None:
        """The steps storage.keepRolloutsSteps deleted; None when it deleted none."""
        where = self.layout.rollouts_retention
        try:
            return RetentionRecord.from_json(self.storage.read_bytes(where), where)
        except FileNotFoundError:
            return None

    def accepted(self, step: int) -> AcceptedRollouts | None:
        """The step's record of what it trained on; None for a run written before it existed."""
        where = self.layout.accepted_rollouts(step)
        try:
            return AcceptedRollouts.from_json(self.storage.read_bytes(where), where)
        except FileNotFoundError:
            return None

    def accepted_shards(self, step: int) -> dict[str, str]:
        """{shard: URI} of the step's accepted training shards: those its record names, else (an
        older run) each shard's highest attempt."""
        if (record := self.accepted(step)) is not None:
            folder = self.layout.step_dir("rollouts", step)
            return {_shard_name(name): f"{folder}/{name}" for name in record.shards}
        best: dict[str, tuple[int, str]] = {}
        for uri in self.storage.list(self.layout.step_dir("rollouts", step)):
            m = _TRAIN_SHARD.match(uri.rsplit("/", 1)[-1])
            if m and (m["shard"] not in best or int(m["attempt"]) > best[m["shard"]][0]):
                best[m["shard"]] = (int(m["attempt"]), uri)
        return {shard: uri for shard, (_, uri) in sorted(best.items())}

    def tables(self, filters: Filters, skipped: list[int] | None = None) -> Iterator[pa.Table]:
        """The accepted shards' samples that pass `filters`, one table (EXPORT_SCHEMA) per shard,
        step by step. Steps not trained yet are appended to `skipped`."""
        trained, retention = self.trained_step(), self.retention()
        for step in self.steps():
            if not filters.wants_step(step) or (retention is not None and step in retention):
                continue        # a step being deleted may be half gone
            if step > trained:
                if skipped is not None:
                    skipped.append(step)
                continue
            for shard, uri in self.accepted_shards(step).items():
                table = export_table(self.storage.read_table(uri), step, shard)
                mask = filters.mask(table)
                yield table if mask is None else table.filter(mask)


def _shard_name(file_name: str) -> str:
    m = _TRAIN_SHARD.match(file_name)
    return m["shard"] if m else file_name.removesuffix(".parquet")


def export_table(shard: pa.Table, step: int, shard_name: str) -> pa.Table:
    """A rollout shard as EXPORT_SCHEMA rows (the optional columns null where the shard has none)."""
    n = shard.num_rows
    columns = {"step": pa.array([step] * n, pa.int64()), "shard": pa.array([shard_name] * n, pa.string()),
               "prompt_length": pc.list_value_length(shard["prompt_ids"]).cast(pa.int64()),
               "response_length": pc.list_value_length(shard["response_ids"]).cast(pa.int64())}
    arrays = []
    for f in EXPORT_SCHEMA:
        if f.name in columns:
            arrays.append(columns[f.name])
        elif f.name in shard.column_names:
            arrays.append(shard[f.name].cast(f.type))
        else:
            arrays.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(arrays, schema=EXPORT_SCHEMA)
