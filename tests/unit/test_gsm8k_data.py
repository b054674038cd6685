"""`grpo data gsm8k`: raw GSM8K parquet into verl's layout, column for column and value for value
what verl's examples/data_preprocess/gsm8k.py writes."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_rollout.data_commands import data
from grpo_rollout.gsm8k_data import SCHEMA, GSM8KDataError, extract_solution, write_gsm8k

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# Raw rows as the Hugging Face openai/gsm8k "main" files hold them: a question, and a worked
# answer with <<calculator>> annotations ending in "#### <number>".
RAW_TRAIN = [
    {"question": "Maria buys 3 boxes of pencils. Each box has 24 pencils. She gives 18 pencils to her "
                 "classmates. How many pencils does she have left?",
     "answer": "Maria buys 3 * 24 = <<3*24=72>>72 pencils.\nAfter giving some away she has 72 - 18 = "
               "<<72-18=54>>54 pencils.\n#### 54"},
    {"question": "A bakery sells 150 loaves of bread a day at $8 each. How much money does the bakery make "
                 "from bread in one day?",
     "answer": "The bakery makes 150 * 8 = $<<150*8=1200>>1,200 a day.\n#### 1,200"},
    {"question": "Tom runs 2.5 miles every morning and twice as far every evening. How many miles does he run "
                 "in a day?",
     "answer": "In the evening he runs 2.5 * 2 = <<2.5*2=5>>5 miles.\nIn total he runs 2.5 + 5 = "
               "<<2.5+5=7.5>>7.5 miles.\n#### 7.5"},
    {"question": "A company had 12,500 customers. It lost 1,250 customers and then gained 3,000 new ones. "
                 "How many customers does it have now?",
     "answer": "After the loss it had 12,500 - 1,250 = <<12500-1250=11250>>11,250 customers.\nThen it had "
               "11,250 + 3,000 = <<11250+3000=14250>>14,250 customers.\n#### 14,250"},
]
RAW_TEST = [
    {"question": "Janet has 5 apples and eats 2. How many apples are left?",
     "answer": "Janet has 5 - 2 = <<5-2=3>>3 apples left.\n#### 3"},
    {"question": "The temperature was 4 degrees and dropped by 9 degrees. What is the temperature now?",
     "answer": "The temperature is 4 - 9 = <<4-9=-5>>-5 degrees.\n#### -5"},
]
GROUND_TRUTHS = {"train": ["54", "1200", "7.5", "14250"], "test": ["3", "-5"]}


def write_raw(path, rows):
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("question", pa.string()), ("answer", pa.string())])),
                   path)
    return path


def expected_row(raw: dict, split: str, index: int, ground_truth: str) -> dict:
    # verl's process_fn, written out
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"]}}


def test_extract_solution_as_verl():
    assert extract_solution("so 1,200 in all\n#### 1,200") == "1200"
    assert extract_solution("#### -5") == "-5" and extract_solution("#### 7.5") == "7.5"
    assert extract_solution("#### 3 apples\n#### 4") == "3"                   # the first marker, as verl
    assert extract_solution("the answer is 3") is None


def test_hub_folder_converted_column_by_column(tmp_path, capsys):
    raw = tmp_path / "raw" / "main"
    raw.mkdir(parents=True)
    write_raw(raw / "train-00000-of-00001.parquet", RAW_TRAIN)
    write_raw(raw / "test-00000-of-00001.parquet", RAW_TEST)
    out = tmp_path / "gsm8k"
    assert data(["gsm8k", "--input", str(tmp_path / "raw"), "--output", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"Wrote {out}/test.parquet (2 test rows)",
                                                    f"Wrote {out}/train.parquet (4 train rows)"]
    for split, raws in (("train", RAW_TRAIN), ("test", RAW_TEST)):
        table = pq.read_table(out / f"{split}.parquet")
        assert table.schema.equals(SCHEMA)
        assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        assert table.to_pylist() == [expected_row(r, split, i, gt)
                                     for i, (r, gt) in enumerate(zip(raws, GROUND_TRUTHS[split]))]


def test_the_comma_answer(tmp_path):
    write_gsm8k([str(write_raw(tmp_path / "train.parquet", RAW_TRAIN))], tmp_path / "out")
    row = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()[1]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1200"}
    assert row["extra_info"]["answer"].endswith("#### 1,200") and row["extra_info"]["index"] == 1
    assert row["prompt"][0]["content"].endswith("in one day? " + INSTRUCTION)


def test_rows_read_by_the_trainer_and_scored_by_the_gsm8k_reward(tmp_path):
    """What the trainer takes from a converted row is what the GSM8K rule scores against."""
    rewards = pytest.importorskip("grpo_rollout.rewards")
    write_gsm8k([f"train={write_raw(tmp_path / 'raw.parquet', RAW_TRAIN)}"], tmp_path / "out")
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    score = rewards.load_reward_function("auto")
    for row, gt in zip(rows, GROUND_TRUTHS["train"]):
        assert row["reward_model"]["ground_truth"] == gt
        assert score(row["data_source"], f"Step by step...\n#### {gt}", gt, row["extra_info"]) == 1.0
    assert score(rows[1]["data_source"], "#### 1100", "1200", rows[1]["extra_info"]) == 0.0


def test_split_option_and_split_inputs(tmp_path):
    raw = write_raw(tmp_path / "gsm8k_raw.parquet", RAW_TEST)
    with pytest.raises(GSM8KDataError, match="can't tell its split"):
        write_gsm8k([str(raw)], tmp_path / "out")
    written = write_gsm8k([str(raw)], tmp_path / "out", split="test")
    assert written == {"test": (tmp_path / "out" / "test.parquet", 2)}
    rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert [r["extra_info"]["split"] for r in rows] == ["test", "test"]
    written = write_gsm8k([f"train={write_raw(tmp_path / 'a.parquet', RAW_TRAIN)}", f"test={raw}"], tmp_path / "two")
    assert {k: n for k, (_, n) in written.items()} == {"train": 4, "test": 2}


def test_bad_inputs_are_refused_with_the_row(tmp_path, capsys):
    bad = write_raw(tmp_path / "train.parquet", [*RAW_TRAIN[:2], {"question": "q?", "answer": "no marker"}])
    assert data(["gsm8k", "--input", str(bad), "--output", str(tmp_path / "out")]) == 1
    assert "row 2: the answer has no '#### <number>' final answer" in capsys.readouterr().err
    assert not (tmp_path / "out" / "train.parquet").exists()
    (tmp_path / "ok").mkdir()
    write_gsm8k([str(write_raw(tmp_path / "ok" / "train.parquet", RAW_TRAIN))], tmp_path / "verl")
    with pytest.raises(GSM8KDataError, match="already in verl's layout"):
        write_gsm8k([str(tmp_path / "verl" / "train.parquet")], tmp_path / "again")
    with pytest.raises(GSM8KDataError, match="would overwrite this input"):
        write_gsm8k([str(tmp_path / "ok" / "train.parquet")], tmp_path / "ok")
    with pytest.raises(GSM8KDataError, match="no such file"):
        write_gsm8k([str(tmp_path / "missing.parquet")], tmp_path / "x", split="train")
