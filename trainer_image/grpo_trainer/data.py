"""Datasets in verl's parquet layout, tokenized with the model's chat template, and the seeded,
epoch-aware sampler whose position is part of every checkpoint.

verl layout: `prompt` (list of {role, content}), `data_source`, `ability`,
`reward_model` ({style, ground_truth}), `extra_info` (struct). verl users bring their files
unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

# DataError lives with the row checks `grpo run` shares before anything starts
from grpo_api.dataset_rows import DataError, check_columns, check_row, ground_truth, ground_truth_warning
from grpo_api.records import RunLayout
from grpo_api.spec import DataSpec, RewardSpec
from grpo_api.storage import Storage
from grpo_trainer import vision

log = logging.getLogger("grpo.trainer")


@dataclass
class PromptRow:
    index: int                # row in the (filtered) dataset
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: str           # JSON
    raw_prompt: str = "[]"    # JSON: the chat messages (reward models render them with their own template)
    images: list[str] = field(default_factory=list)   # URIs of the prompt's images (ImageStore), in order


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


@dataclass
class ImageStore:
    """A VL model's image side of the prompts: its image processor (token counts), and the run's
    content-addressed images (`RunLayout.image`), each written once however many rows and steps
    name it."""
    processor: object
    image_token_id: int
    merge_size: int
    storage: Storage
    layout: RunLayout
    _stored: set[str] = field(default_factory=set)

    def prompt_ids(self, tokenizer, messages: list[dict], images: list[bytes]) -> list[int]:
        ids = _render(tokenizer, vision.image_parts(messages, len(images)))
        grids = vision.pixel_inputs(self.processor, images).rows_grid_thw if images else None
        return vision.expand_image_tokens(ids, self.image_token_id, grids, self.merge_size) if images else ids

    def store(self, data: bytes) -> str:
        uri = self.layout.image(hashlib.sha256(data).hexdigest())
        if uri not in self._stored:
            if not self.storage.exists(uri):
                self.storage.write_bytes(uri, data)
            self._stored.add(uri)
        return uri


def image_store(model_spec, tokenizer, storage: Storage, layout: RunLayout,
                patch_size: int | None = None) -> ImageStore | None:
    """The ImageStore of a VL spec.model (its image processor and image token); None for others.
    `patch_size` (spec.data.imagePatchSize): must be the processor's own, which sizes the images."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_spec.path, trust_remote_code=model_spec.trust_remote_code)
    if not vision.is_vision_language(config):
        return None
    processor = vision.load_image_processor(model_spec)
    own = getattr(processor, "patch_size", None)
    if patch_size is not None and own is not None and patch_size != own:
        # verl resizes to multiples of patch_size x merge before its processor; here the processor alone does.
        raise DataError(f"spec.data.imagePatchSize: {patch_size}, but the image processor of {model_spec.path} has "
                        f"patch size {own}, which sizes the images here: set {own} or leave it out")
    return ImageStore(processor, config.image_token_id, config.vision_config.spatial_merge_size, storage, layout)


def _row_images(rec: dict, key: str, uri: str, row_number: int, storage: Storage) -> list[bytes]:
    """A row's images as encoded bytes (verl: {bytes} or {path}), each checked to open."""
    out = []
    for k, image in enumerate(rec.get(key) or []):
        where = f"{uri}: row {row_number}: {key}[{k}]"
        data = image.get("bytes") if isinstance(image, dict) else None
        path = image.get("path") if isinstance(image, dict) else image if isinstance(image, str) else None
        if not data and path:
            try:
                data = storage.read_bytes(path if "://" in path else f"file://{path}")
            except OSError as exc:
                raise DataError(f"{where}: can't read the image at {path!r}: {exc}") from None
        if not data:
            raise DataError(f"{where}: neither image bytes nor a path")
        try:
            vision.open_image(data)
        except ValueError as exc:
            raise DataError(f"{where}: {exc}") from None
        out.append(data)
    return out


def _render(tokenizer, messages, tools=None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])    # transformers 5 may return a BatchEncoding


def _tool_agent(rec: dict) -> bool:
    """A row the tool agent loop prompts with the tools (grpo_rollout.agent_loop.row_agent: the
    default agent)."""
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    return (rec.get("agent_name") or extra.get("agent_name") or "tool_agent") == "tool_agent"


def load_prompts(files: list[str], spec: DataSpec, tokenizer, storage: Storage,
                 tool_schemas: list[dict] | None = None, images: ImageStore | None = None,
                 reward: RewardSpec | None = None) -> PromptDataset:
    """Read, check every row (grpo_api.dataset_rows: a bad one is named by file, row and column),
    apply the chat template, tokenize; filter or truncate overlong prompts per the spec. With
    `reward`, rows its rule can only score 0 (no ground truth) are warned about, a file of only
    those refused.
    With `tool_schemas` (the tool agent loop's tools), a tool agent's prompt is measured as the
    rollout servers render it, with the tools; it can't be truncated (they render it again).
    With `images` (a VL model), a row's data.imageKey images fill its `<image>` placeholders, and
    their tokens count in its length."""
    rows: list[PromptRow] = []
    filtered = 0
    for uri in files:
        table = _read_table(uri, storage)
        check_columns(table.column_names, uri, spec)
        records = table.to_pylist()
        if warning := ground_truth_warning(uri, records, reward):
            log.warning("%s", warning)
        for row_number, rec in enumerate(records):
            messages = check_row(rec, row_number, uri, spec)
            row_images = _row_images(rec, spec.image_key, uri, row_number, storage)
            if row_images and images is None:
                raise DataError(f"{uri}: row {row_number} has images (data.imageKey {spec.image_key!r}) but "
                                f"spec.model.path is not a vision-language model")
            try:
                ids = images.prompt_ids(tokenizer, messages, row_images) if row_images else _render(tokenizer, messages)
            except ValueError as exc:
                raise DataError(f"{uri}: row {row_number}: {exc}") from None
            with_tools = len(_render(tokenizer, messages, tool_schemas)) if tool_schemas and _tool_agent(rec) else None
            if (with_tools or len(ids)) > spec.max_prompt_length:
                if spec.filter_overlong_prompts:
                    filtered += 1
                    continue
                if row_images:
                    raise DataError(
                        f"{uri}: row {row_number} has a {len(ids)}-token prompt with its images, longer than "
                        f"data.maxPromptLength={spec.max_prompt_length} (set data.filterOverlongPrompts or raise "
                        f"data.maxPromptLength; a prompt with images is not truncated)")
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
            rows.append(PromptRow(len(rows), ids, rec["data_source"] or "", ground_truth(rec["reward_model"]),
                                  json.dumps(rec.get("extra_info") or {}, default=str),
                                  json.dumps(messages, default=str), [images.store(b) for b in row_images]))
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


def load_datasets(spec: DataSpec, tokenizer, storage: Storage, tool_schemas: list[dict] | None = None,
                  images: ImageStore | None = None, reward: RewardSpec | None = None) -> Datasets:
    """data.trainFiles (and valFiles), and the epoch sampler over the training prompts."""
    train = load_prompts(spec.train_files, spec, tokenizer, storage, tool_schemas, images, reward)
    val = (load_prompts(spec.val_files, spec, tokenizer, storage, tool_schemas, images, reward)
           if spec.val_files else None)
    if train.filtered:
        log.info("Filtered %d overlong prompts (data.filterOverlongPrompts)", train.filtered)
    return Datasets(train, val, EpochSampler(len(train.rows), spec.train_batch_size, spec.seed, spec.shuffle))


def prompt_shard_table(rows: list[PromptRow], epoch: int, first_index: int = 0) -> pa.Table:
    """The prompt shard a rollout server reads (grpo_api.records.PROMPT_SCHEMA)."""
    from grpo_api.records import PROMPT_SCHEMA
    return pa.Table.from_pylist([
        {"uid": f"{epoch}-{r.index}", "prompt_index": first_index + i, "prompt_ids": r.prompt_ids,
         "data_source": r.data_source, "ground_truth": r.ground_truth, "extra_info": r.extra_info,
         "raw_prompt": r.raw_prompt, "images": r.images}
        for i, r in enumerate(rows)], schema=PROMPT_SCHEMA)
