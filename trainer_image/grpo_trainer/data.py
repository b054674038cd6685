"""Datasets in verl's parquet layout, tokenized with the model's chat template, and the seeded,
epoch-aware sampler whose position is part of every checkpoint.

verl layout: `prompt` (list of {role, content}), `data_source`, `ability`,
`reward_model` ({style, ground_truth}), `extra_info` (struct). verl users bring their files
unchanged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from grpo_api.spec import DataSpec
from grpo_api.storage import Storage

log = logging.getLogger("grpo.trainer")

REQUIRED_COLUMNS = ("data_source", "reward_model")


class DataError(ValueError):
    """A dataset that can't be trained on; the message names the file, row or column."""


@dataclass
class PromptRow:
    index: int                # row in the (filtered) dataset
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: str           # JSON
    raw_prompt: str = "[]"    # JSON: the chat messages (reward models render them with their own template)


@dataclass
class PromptDataset:
    rows: list[PromptRow]
    filtered: int = 0         # rows dropped by filterOverlongPrompts


def _read_table(uri: str, storage: Storage) -> pa.Table:
    try:
        return storage.read_table(uri)
    except FileNotFoundError:
        raise DataError(f"{uri}: dataset file not found") from None
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"{uri}: can't read as parquet: {exc}") from None


def _ground_truth(reward_model) -> str:
    if isinstance(reward_model, dict):
        gt = reward_model.get("ground_truth")
        return gt if isinstance(gt, str) else json.dumps(gt)
    return "" if reward_model is None else str(reward_model)


def _render(tokenizer, messages, tools=None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])    # transformers 5 may return a BatchEncoding


def _tool_agent(rec: dict) -> bool:
    """A row the tool agent loop prompts with the tools (grpo_rollout.agent_loop.row_agent: the
    default agent)."""
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    return (rec.get("agent_name") or extra.get("agent_name") or "tool_agent") == "tool_agent"


def load_prompts(files: list[str], spec: DataSpec, tokenizer, storage: Storage,
                 tool_schemas: list[dict] | None = None) -> PromptDataset:
    """Read, apply the chat template, tokenize; filter or truncate overlong prompts per the spec.
    With `tool_schemas` (the tool agent loop's tools), a tool agent's prompt is measured as the
    rollout servers render it, with the tools; it can't be truncated (they render it again)."""
    rows: list[PromptRow] = []
    filtered = 0
    for uri in files:
        table = _read_table(uri, storage)
        missing = [c for c in (spec.prompt_key, *REQUIRED_COLUMNS) if c not in table.column_names]
        if missing:
            raise DataError(f"{uri}: missing column(s) {', '.join(missing)} "
                            f"(verl layout: {spec.prompt_key}, data_source, reward_model.ground_truth)")
        records = table.to_pylist()
        for row_number, rec in enumerate(records):
            messages = rec[spec.prompt_key]
            if isinstance(messages, str):
                messages = [{"role": "user", "content": messages}]
            ids = _render(tokenizer, messages)
            with_tools = len(_render(tokenizer, messages, tool_schemas)) if tool_schemas and _tool_agent(rec) else None
            if (with_tools or len(ids)) > spec.max_prompt_length:
                if spec.filter_overlong_prompts:
                    filtered += 1
                    continue
                if with_tools:
                    raise DataError(
                        f"{uri}: row {row_number} has a {with_tools}-token prompt with the tools' schemas, longer "
                        f"than data.maxPromptLength={spec.max_prompt_length} (set data.filterOverlongPrompts or raise "
                        f"data.maxPromptLength; a tool agent's prompt is not truncated)")
                if spec.truncation == "error":
                    raise DataError(
                        f"{uri}: row {row_number} has a {len(ids)}-token prompt, longer than "
                        f"data.maxPromptLength={spec.max_prompt_length} (set data.filterOverlongPrompts "
                        f"or data.truncation left/right)")
                ids = ids[-spec.max_prompt_length:] if spec.truncation == "left" else ids[:spec.max_prompt_length]
            if rec.get("agent_name"):    # verl's tool-agent layout: the agent loop reads it from extra_info
                rec["extra_info"] = {**(rec.get("extra_info") or {}), "agent_name": rec["agent_name"]}
            rows.append(PromptRow(len(rows), ids, rec["data_source"] or "", _ground_truth(rec["reward_model"]),
                                  json.dumps(rec.get("extra_info") or {}, default=str),
                                  json.dumps(messages, default=str)))
    if not rows:
        raise DataError(f"{', '.join(files)}: no usable prompts (empty files, or all filtered as overlong)")
    return PromptDataset(rows, filtered)


@dataclass
class EpochSampler:
    """Yields batches of dataset indices: a fresh seeded permutation per epoch, the incomplete
    tail dropped (as verl's dataloader with drop_last). Its state is (epoch, position)."""

    size: int
    batch_size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0          # batches already taken in this epoch
    _order: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.batches_per_epoch == 0:
            raise DataError(f"the training set has {self.size} prompts, fewer than "
                            f"data.trainBatchSize={self.batch_size}")

    @property
    def batches_per_epoch(self) -> int:
        return self.size // self.batch_size

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            order = np.arange(self.size)
            if self.shuffle:
                np.random.default_rng([self.seed, self.epoch]).shuffle(order)
            self._order = order
        return self._order

    def next_batch(self) -> tuple[int, list[int]]:
        """(epoch, indices) of the next batch, moving to the next epoch when this one is done."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        start = self.position * self.batch_size
        self.position += 1
        return self.epoch, self._epoch_order()[start:start + self.batch_size].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


@dataclass
class Datasets:
    train: PromptDataset
    val: PromptDataset | None
    sampler: EpochSampler


def load_datasets(spec: DataSpec, tokenizer, storage: Storage, tool_schemas: list[dict] | None = None) -> Datasets:
    """data.trainFiles (and valFiles), and the epoch sampler over the training prompts."""
    train = load_prompts(spec.train_files, spec, tokenizer, storage, tool_schemas)
    val = load_prompts(spec.val_files, spec, tokenizer, storage, tool_schemas) if spec.val_files else None
    if train.filtered:
        log.info("Filtered %d overlong prompts (data.filterOverlongPrompts)", train.filtered)
    return Datasets(train, val, EpochSampler(len(train.rows), spec.train_batch_size, spec.seed, spec.shuffle))


def prompt_shard_table(rows: list[PromptRow], epoch: int, first_index: int = 0) -> pa.Table:
    """The prompt shard a rollout server reads (grpo_api.records.PROMPT_SCHEMA)."""
    from grpo_api.records import PROMPT_SCHEMA
    return pa.Table.from_pylist([
        {"uid": f"{epoch}-{r.index}", "prompt_index": first_index + i, "prompt_ids": r.prompt_ids,
         "data_source": r.data_source, "ground_truth": r.ground_truth, "extra_info": r.extra_info,
         "raw_prompt": r.raw_prompt}
        for i, r in enumerate(rows)], schema=PROMPT_SCHEMA)
