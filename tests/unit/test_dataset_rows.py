"""Bad dataset rows (issue 48, item 5): a row that can't be a prompt is refused with its file, row and
column named, the same by `grpo run`'s check before anything starts (check_local_dataset) and by the
trainer as it loads the data (load_prompts, where a null prompt was a 40-line traceback); rows the
GSM8K rule can only score 0 (no reward_model.ground_truth) are said, a file of only those refused."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_api.dataset_rows import DataError, check_local_dataset
from grpo_api.spec import DataSpec, RewardSpec
from grpo_api.storage import Storage
from grpo_rollout import tiny
from grpo_rollout.quickstart_data import make_rows
from grpo_trainer.data import load_prompts

IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def _write(path, rows, **types) -> str:
    """`rows` as a parquet file; `types`: a column's arrow type, where inference can't tell it."""
    table = pa.Table.from_pylist(rows)
    for name, type_ in types.items():
        table = table.set_column(table.column_names.index(name), name, pa.array([r[name] for r in rows], type_))
    pq.write_table(table, path)
    return str(path)


def _load(path: str, data: DataSpec, reward: RewardSpec | None = None):
    return load_prompts([path], data, tiny.build_tokenizer(), Storage(), reward=reward)


def _bad(rows, k, **change):
    rows[k] = {**rows[k], **change}
    return rows


BAD_ROWS = {   # case: (the rows, the arrow types inference can't tell, what the error says after the file name)
    "null prompt": (lambda: _bad(make_rows(6, "train", 0), 3, prompt=None), {},
                    "row 3: prompt: null, not a list of chat messages {role, content} or a string"),
    "blank prompt": (lambda: [{**r, "prompt": "hi" if i != 1 else " "} for i, r in enumerate(make_rows(4, "t", 0))],
                     {}, "row 1: prompt: an empty prompt"),
    "empty message list": (lambda: _bad(make_rows(4, "train", 0), 2, prompt=[]), {},
                           "row 2: prompt: an empty list of messages"),
    "prompt not messages": (lambda: [{**r, "prompt": {"role": "user", "content": "hi"}} for r in make_rows(3, "t", 0)],
                            {}, "row 0: prompt: a dict, not a list of chat messages {role, content} or a string"),
    "message without role": (lambda: _bad(make_rows(5, "train", 0), 4, prompt=[{"role": None, "content": "hi"}]), {},
                             "row 4: prompt[0]: no role"),
    "message without content": (lambda: _bad(make_rows(5, "train", 0), 1, prompt=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": None}]), {},
        "row 1: prompt[1]: no content"),
    "images not a list": (lambda: [{**r, "images": "cat.png"} for r in make_rows(2, "t", 0)], {},
                          "row 0: images: a str, not a list of images {bytes, path}"),
    "image not an image": (lambda: [{**r, "images": [7] if i else []} for i, r in enumerate(make_rows(3, "t", 0))], {},
                           "row 1: images[0]: an int, not an image {bytes, path} or a path"),
    "image with neither bytes nor path": (lambda: [{**r, "images": [{"bytes": None, "path": None}] if i == 2 else None}
                                                   for i, r in enumerate(make_rows(3, "t", 0))], {"images": IMAGES},
                                          "row 2: images[0]: neither image bytes nor a path"),
    # verl reads a `videos` column by default: its rows would train on their text alone here
    "a row with videos": (lambda: [{**r, "videos": [{"video": ["f1.jpg", "f2.jpg"]}] if i == 1 else []}
                                   for i, r in enumerate(make_rows(3, "t", 0))], {},
                          "row 1: videos: videos are not supported yet (issue 45); only images (data.imageKey)"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_is_named_by_file_row_and_column_before_and_at_load(case, tmp_path):
    rows, types, said = BAD_ROWS[case]
    path = _write(tmp_path / "train.parquet", rows(), **types)
    data = DataSpec(train_files=[path], max_prompt_length=64)
    expected = f"{path}: {said}"
    with pytest.raises(DataError) as before:        # grpo run, before any server starts
        check_local_dataset(path, data, RewardSpec())
    with pytest.raises(DataError) as at_load:       # the trainer, for every file (object storage too)
        _load(path, data)
    assert str(before.value) == expected and str(at_load.value) == expected


def test_a_good_file_passes_both_and_a_string_prompt_is_one_user_message(tmp_path):
    rows = make_rows(4, "train", 0)
    rows[2]["prompt"][0]["content"] = "answer #### and the digit 5"
    path = _write(tmp_path / "train.parquet", rows)
    data = DataSpec(train_files=[path], max_prompt_length=64)
    assert check_local_dataset(path, data, RewardSpec()) is None
    text = _write(tmp_path / "text.parquet", [{**r, "prompt": r["prompt"][0]["content"]} for r in rows])
    tok = tiny.build_tokenizer()
    as_messages, as_text = _load(path, data).rows, _load(text, data).rows
    assert [r.prompt_ids for r in as_text] == [r.prompt_ids for r in as_messages]
    assert [r.ground_truth for r in as_messages] == [r["reward_model"]["ground_truth"] for r in rows]
    assert tok.decode(as_messages[2].prompt_ids).count("answer #### and the digit 5") == 1


def _without_ground_truth(n: int, lacking: set[int]) -> list[dict]:
    rows = make_rows(n, "train", 0)
    for k in lacking:
        rows[k]["reward_model"] = {"style": "rule", "ground_truth": None}
    return rows


def test_rows_without_ground_truth_are_said_under_the_rule_and_score_input_is_empty(tmp_path, caplog):
    path = _write(tmp_path / "train.parquet", _without_ground_truth(12, {1, 5, 9}))
    data = DataSpec(train_files=[path], max_prompt_length=64)
    warning = (f"3 of 12 rows of {path} have no reward_model.ground_truth: their samples score 0 under the "
               f"reward.function auto rule for data_source 'openai/gsm8k'")
    assert check_local_dataset(path, data, RewardSpec()) == warning
    with caplog.at_level(logging.WARNING, logger="grpo.trainer"):
        rows = _load(path, data, RewardSpec()).rows
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [warning]
    # the rule gets "" for them (it was the string "null"), the others their answer
    assert [k for k, r in enumerate(rows) if r.ground_truth == ""] == [1, 5, 9]
    # a custom function decides for itself; a reward model that replaces the rule needs none
    custom = RewardSpec(function="my_rewards:score")
    replaced = RewardSpec.model_validate({"rewardModels": [{"name": "rm", "path": "/models/rm"}]})
    assert check_local_dataset(path, data, custom) is None and check_local_dataset(path, data, replaced) is None
    summed = RewardSpec.model_validate({"rewardModels": [{"name": "rm", "path": "/models/rm"}], "combine": "sum"})
    assert check_local_dataset(path, data, summed) == warning


def test_a_file_without_any_ground_truth_is_refused_under_the_rule(tmp_path):
    path = _write(tmp_path / "train.parquet", _without_ground_truth(5, set(range(5))))
    data = DataSpec(train_files=[path], max_prompt_length=64)
    said = (f"{path}: column reward_model: none of its 5 rows has a ground_truth, so every sample would score 0 "
            f"under the reward.function auto rule for data_source 'openai/gsm8k' (add the answers, or set "
            f"spec.reward.function to a function that needs none)")
    with pytest.raises(DataError) as before:
        check_local_dataset(path, data, RewardSpec())
    with pytest.raises(DataError) as at_load:
        _load(path, data, RewardSpec())
    assert str(before.value) == said and str(at_load.value) == said
    assert len(_load(path, data, RewardSpec(function="my_rewards:score")).rows) == 5
