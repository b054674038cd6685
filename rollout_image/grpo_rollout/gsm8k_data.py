"""`grpo data gsm8k`: raw GSM8K (the Hugging Face `openai/gsm8k` parquet: `question`, `answer`)
into verl's training layout, row for row what verl's `examples/data_preprocess/gsm8k.py` writes:

- `data_source` "openai/gsm8k" (so `reward.function: auto` scores it with the GSM8K rule),
- `prompt`: one user message, the question + " " + the step-by-step instruction,
- `ability` "math",
- `reward_model`: {style "rule", ground_truth: the number after the first `#### `, commas removed},
- `extra_info`: {split, index (row within the split), answer (the raw solution), question (raw)}.

Pure pyarrow: no `datasets`, no hub download; the raw files are the user's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_api.storage import read_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
# verl's extract_solution: the first "#### <number>", thousands separators dropped.
_SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")

# Field for field (and struct fields in their order) as verl's preprocessing writes them.
SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()),
                              ("answer", pa.string()), ("question", pa.string())])),
])


class GSM8KDataError(ValueError):
    """Input that isn't raw GSM8K; the message names the file and the row."""


def extract_solution(answer: str) -> str | None:
    m = _SOLUTION.search(answer)
    return m.group(1).replace(",", "") if m else None


def convert_rows(records: list[dict], split: str, source: str = "input") -> list[dict]:
    """Raw {question, answer} records into verl rows; `index` counts within the split."""
    rows = []
    for idx, rec in enumerate(records):
        question, answer = rec.get("question"), rec.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise GSM8KDataError(f"{source}: row {idx}: question and answer must be strings")
        solution = extract_solution(answer)
        if solution is None:
            raise GSM8KDataError(f"{source}: row {idx}: the answer has no '#### <number>' final answer: "
                                 f"{answer[-80:]!r}")
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer, "question": question},
        })
    return rows


def _read_raw(path: Path) -> list[dict]:
    try:
        table = read_parquet(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise GSM8KDataError(f"{path}: can't read as parquet: {exc}") from None
    if "question" not in table.column_names or "answer" not in table.column_names:
        hint = (" (it is already in verl's layout)" if {"prompt", "reward_model"} <= set(table.column_names)
                else "")
        raise GSM8KDataError(f"{path}: expected raw GSM8K columns question, answer; found "
                             f"{', '.join(table.column_names)}{hint}")
    return table.select(["question", "answer"]).to_pylist()


def split_of(path: Path) -> str | None:
    """train or test from a file name as the hub names them (train-00000-of-00001.parquet)."""
    found = [s for s in SPLITS if s in path.name.lower()]
    return found[0] if len(found) == 1 else None


def find_inputs(inputs: list[str], split: str | None) -> dict[str, Path]:
    """{split: raw file} from `--input` values: FILE, SPLIT=FILE, or a folder holding the
    hub's files (e.g. main/train-00000-of-00001.parquet and main/test-...)."""
    found: dict[str, Path] = {}

    def add(name: str | None, path: Path) -> None:
        if name not in SPLITS:
            raise GSM8KDataError(f"{path}: can't tell its split from the name; pass --split train|test or "
                                 f"--input train={path}")
        if name in found:
            raise GSM8KDataError(f"two inputs for the {name} split: {found[name]} and {path}")
        found[name] = path

    for item in inputs:
        name, sep, value = item.partition("=")
        if sep and name in SPLITS:
            add(name, Path(value))
            continue
        path = Path(item)
        if path.is_dir():
            files = sorted(path.rglob("*.parquet"))
            for f in files:
                add(split_of(f), f)
            if not files:
                raise GSM8KDataError(f"{path}: no parquet files in this folder")
        elif not path.is_file():
            raise GSM8KDataError(f"{path}: no such file or folder")
        else:
            add(split or split_of(path), path)
    return found


def write_gsm8k(inputs: list[str], out_dir: str | Path, split: str | None = None) -> dict[str, tuple[Path, int]]:
    """Convert each input split; returns {split: (written file, rows)}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, path in find_inputs(inputs, split).items():
        target = out / f"{name}.parquet"
        if target.exists() and target.resolve() == path.resolve():
            raise GSM8KDataError(f"{path}: the output would overwrite this input; choose another --output")
        table = pa.Table.from_pylist(convert_rows(_read_raw(path), name, str(path)), schema=SCHEMA)
        tmp = target.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, target)          # a reader never sees half a file
        written[name] = (target, table.num_rows)
    return written
