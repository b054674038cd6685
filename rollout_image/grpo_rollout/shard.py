"""Prompt shard in, rollout shard out: the record conversions of one Generate request, as pure
functions over arrow tables (grpo_api.records holds the schemas)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from grpo_api.records import PROMPT_OPTIONAL, PROMPT_SCHEMA, ROLLOUT_SCHEMA
from grpo_rollout.engine import Sample


@dataclass(frozen=True)
class Prompt:
    uid: str
    prompt_index: int
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict
    messages: tuple = ()
    """The prompt's chat messages (raw_prompt); empty in shards written without them."""
    images: tuple[str, ...] = ()
    """URIs of the prompt's images (a VL model's; grpo_api.records.RunLayout.image), in order."""

    @classmethod
    def rows(cls, table: pa.Table) -> list["Prompt"]:
        for name in PROMPT_OPTIONAL:
            if name not in table.column_names:
                table = table.append_column(name, pa.nulls(len(table), PROMPT_SCHEMA.field(name).type))
        table = table.select(PROMPT_SCHEMA.names).cast(PROMPT_SCHEMA)
        out = []
        for row in table.to_pylist():
            try:
                extra = json.loads(row["extra_info"]) if row["extra_info"] else {}
            except json.JSONDecodeError:
                raise ValueError(f"prompt {row['uid']}: extra_info is not JSON") from None
            if not row["prompt_ids"]:
                raise ValueError(f"prompt {row['uid']}: empty prompt_ids")
            messages = json.loads(row["raw_prompt"]) if row["raw_prompt"] else []
            out.append(cls(row["uid"], row["prompt_index"], row["prompt_ids"], row["data_source"] or "",
                           row["ground_truth"] or "", extra if isinstance(extra, dict) else {"value": extra},
                           tuple(messages) if isinstance(messages, list) else (), tuple(row["images"] or ())))
        return out


@dataclass(frozen=True)
class Scored:
    """A sample with its final reward (after shaping) and the reward function's extra fields."""

    sample: Sample
    reward: float
    reward_extra: dict
    reward_error: str | None = None     # how the reward function failed (rewards.ERROR_KINDS), None: it didn't


def rollout_table(prompts: list[Prompt], scored: list[list[Scored]], *, policy_version: int, worker: str) -> pa.Table:
    """One row per sample, prompts in order, samples of a prompt in order (ROLLOUT_SCHEMA)."""
    if len(prompts) != len(scored):
        raise ValueError(f"{len(prompts)} prompts but {len(scored)} groups of samples")
    cols: dict[str, list] = {name: [] for name in ROLLOUT_SCHEMA.names}
    for prompt, group in zip(prompts, scored):
        for i, s in enumerate(group):
            cols["uid"].append(prompt.uid)
            cols["prompt_index"].append(prompt.prompt_index)
            cols["sample_index"].append(i)
            cols["prompt_ids"].append(prompt.prompt_ids if s.sample.prompt_ids is None else s.sample.prompt_ids)
            cols["response_ids"].append(s.sample.token_ids)
            cols["response_logprobs"].append(s.sample.logprobs)
            cols["reward"].append(s.reward)
            cols["reward_extra"].append(json.dumps(s.reward_extra, default=repr))
            cols["reward_error"].append(s.reward_error)
            cols["finish_reason"].append(s.sample.finish_reason)
            cols["policy_version"].append(policy_version)
            cols["data_source"].append(prompt.data_source)
            cols["ground_truth"].append(prompt.ground_truth)
            cols["images"].append(list(prompt.images))
            cols["worker"].append(worker)
            agent = s.sample.agent
            cols["response_mask"].append(s.sample.response_mask)
            cols["num_turns"].append(None if agent is None else agent["num_turns"])
            cols["agent"].append(None if agent is None else json.dumps(agent, default=repr))
    return pa.Table.from_pydict(cols, schema=ROLLOUT_SCHEMA)
