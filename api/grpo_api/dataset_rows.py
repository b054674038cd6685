"""The rows of a dataset in verl's parquet layout, checked where they are read: by `grpo run` before
anything starts (local files: `check_local_dataset`) and by the trainer as it loads them (every
file). A row that can't be a prompt is refused with its file, row and column named (verl fails on
it later, deep in the chat template); rows whose rule reward can only be 0 (no
reward_model.ground_truth) are counted and said, and a file with none is refused.

pyarrow is imported inside `check_local_dataset`: importing grpo_api stays cheap.
"""

from __future__ import annotations

import json

from grpo_api.spec import DataSpec, RewardSpec

REQUIRED_COLUMNS = ("data_source", "reward_model")
PROMPT_SHAPE = "a list of chat messages {role, content} or a string"


class DataError(ValueError):
    """A dataset that can't be trained on; the message names the file, row or column."""


def _a(value) -> str:
    """What a value is, for an error: "null", "a dict", "an int"."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


VIDEO_COLUMN = "videos"
"""verl's default data.video_key: rows with videos there are refused (not supported yet)."""


def check_columns(names: list[str], uri: str, data: DataSpec) -> None:
    missing = [c for c in (data.prompt_key, *REQUIRED_COLUMNS) if c not in names]
    if missing:
        raise DataError(f"{uri}: missing column(s) {', '.join(missing)} "
                        f"(verl layout: {data.prompt_key}, data_source, reward_model.ground_truth)")


def row_messages(prompt, where: str) -> list[dict]:
    """A row's prompt as chat messages (a string is one user message); DataError naming `where`
    (file: row N: column) and what is wrong otherwise."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: an empty prompt")
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise DataError(f"{where}: {_a(prompt)}, not {PROMPT_SHAPE}")
    if not prompt:
        raise DataError(f"{where}: an empty list of messages")
    for k, message in enumerate(prompt):
        at = f"{where}[{k}]"
        if not isinstance(message, dict):
            raise DataError(f"{at}: {_a(message)}, not a chat message {{role, content}}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise DataError(f"{at}: no role" if role in (None, "") else f"{at}: role is {_a(role)}, not a string")
        # an assistant turn that only calls tools may have no content (the chat templates allow it)
        if content is None and not message.get("tool_calls"):
            raise DataError(f"{at}: no content")
        if content is not None and not isinstance(content, (str, list)):
            raise DataError(f"{at}: content is {_a(content)}, not a string or a list of parts")
    return prompt


def check_images_shape(images, where: str) -> None:
    """A row's data.imageKey value: null, or a list of images, each {bytes, path} or a path (verl)."""
    if images is None:
        return
    if not isinstance(images, list):
        raise DataError(f"{where}: {_a(images)}, not a list of images {{bytes, path}}")
    for k, image in enumerate(images):
        if isinstance(image, str) and image:
            continue
        if not isinstance(image, dict):
            raise DataError(f"{where}[{k}]: {_a(image)}, not an image {{bytes, path}} or a path")
        if not image.get("bytes") and not image.get("path"):
            raise DataError(f"{where}[{k}]: neither image bytes nor a path")


def ground_truth(reward_model) -> str:
    """A row's reward_model.ground_truth as the string the reward function gets; "" when it has none."""
    gt = reward_model.get("ground_truth") if isinstance(reward_model, dict) else reward_model
    if gt is None:
        return ""
    return gt if isinstance(gt, str) else json.dumps(gt)


def rule_needs_ground_truth(reward: RewardSpec) -> bool:
    """Whether the samples' reward includes a built-in rule's score (reward.function auto: GSM8K,
    math...), which compares the response with the ground truth and is 0 without one. A custom
    function decides for itself."""
    return reward.function == "auto" and (not reward.reward_models or reward.combine != "replace")


def ground_truth_warning(uri: str, records: list[dict], reward: RewardSpec | None) -> str | None:
    """The warning for the rows of a file that have no ground truth where the rule needs one;
    DataError when none has (every sample would score 0: nothing to learn)."""
    if reward is None or not rule_needs_ground_truth(reward):
        return None
    lacking = [r for r in records if not ground_truth(r.get("reward_model")).strip()]
    if not lacking:
        return None
    sources = sorted({str(r.get("data_source")) for r in lacking})
    rule = f"the reward.function auto rule for data_source {', '.join(map(repr, sources[:3]))}" + \
        (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
    if len(lacking) == len(records):
        raise DataError(f"{uri}: column reward_model: none of its {len(records)} rows has a ground_truth, so every "
                        f"sample would score 0 under {rule} (add the answers, or set spec.reward.function to a "
                        f"function that needs none)")
    return (f"{len(lacking)} of {len(records)} rows of {uri} have no reward_model.ground_truth: their samples "
            f"score 0 under {rule}")


def check_row(rec: dict, row: int, uri: str, data: DataSpec) -> list[dict]:
    """One row's prompt (its chat messages) and images, checked; DataError naming the file, row and column."""
    messages = row_messages(rec.get(data.prompt_key), f"{uri}: row {row}: {data.prompt_key}")
    check_images_shape(rec.get(data.image_key), f"{uri}: row {row}: {data.image_key}")
    if rec.get(VIDEO_COLUMN):     # verl reads them by default (data.video_key): never trained on as text alone
        raise DataError(f"{uri}: row {row}: {VIDEO_COLUMN}: videos are not supported yet (issue 45); only images "
                        f"(data.imageKey)")
    return messages


def check_local_dataset(path: str, data: DataSpec, reward: RewardSpec | None) -> str | None:
    """Every row of a local parquet file checked as the trainer will (before `grpo run` starts a
    server); returns the ground-truth warning, if any. Only the columns checked are read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpo_api.storage import read_parquet
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"{path}: can't read as parquet: {exc}") from None
    check_columns(names, path, data)
    columns = [c for c in (data.prompt_key, *REQUIRED_COLUMNS, data.image_key, VIDEO_COLUMN) if c in names]
    records = read_parquet(path, columns=columns).to_pylist()
    for row, rec in enumerate(records):
        check_row(rec, row, path, data)
    return ground_truth_warning(path, records, reward)
