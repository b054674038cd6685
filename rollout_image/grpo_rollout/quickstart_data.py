"""The quickstart task: "copy the digit", scored by the real GSM8K rule.

Each prompt states one digit; the right answer is that digit after GSM8K's `####` marker
(`#### 7`). Rows use `data_source = "openai/gsm8k"`, so `reward.function: auto` scores them
with verl's strict GSM8K rule: 1.0 for the right number after the last `#### `, the format
score for a well-formed but wrong `#### d`, else 0. The quickstart keeps verl's default
format score, 0.0: with grpo_rollout.tiny's 26-token vocabulary and 3-token responses, a
random-init policy writes the right `#### d` often enough (1-3 in 100 samples) for GRPO to
find it. (A format score of 0.1 was slower: the policy learns the format first, then
settles on one digit for every prompt before it learns to copy; bench/RESULTS.md.)

The task is solvable from the prompt alone (attend to the one digit in the prompt and copy
it), starts near chance (mean reward ~0.01-0.03), and GRPO teaches it to the tiny
random-init model (~77k parameters) in ~55-90 steps, well under a minute of CPU compute
(bench/quickstart_learnability.py; the runs are in bench/RESULTS.md).

Files follow verl's parquet layout exactly (as verl's examples/data_preprocess/gsm8k.py
writes them): data_source, prompt (chat messages), ability, reward_model {style,
ground_truth}, extra_info {split, index, answer, question}.
"""

from __future__ import annotations

import random
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
FORMAT_SCORE = 0.0  # the quickstart's reward format score: verl's default (see above)

# A few phrasings with the digit in different places, so the policy must find the digit by
# content rather than by position. Every word is in grpo_rollout.tiny's vocabulary.
PROMPT_TEMPLATES = [
    "copy the digit {d} then answer #### and the digit",
    "the digit is {d} answer with #### then the digit",
    "answer #### and the digit {d}",
    "{d} is the digit copy the digit then answer with ####",
]


def make_rows(n: int, split: str, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        d = rng.randrange(10)
        question = rng.choice(PROMPT_TEMPLATES).format(d=d)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(d)},
            "extra_info": {"split": split, "index": i, "answer": f"#### {d}", "question": question},
        })
    return rows


def write_quickstart_dataset(out_dir: str | Path, n_train: int = 2048, n_val: int = 64,
                             seed: int = 0) -> tuple[Path, Path]:
    """Write `train.parquet` and `test.parquet` under `out_dir`; return their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # The GSM8K layout, field for field as verl's preprocessing writes it: the quickstart is
    # scored by the GSM8K rule, and a verl user's reader sees the same types.
    from grpo_rollout.gsm8k_data import SCHEMA as schema

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, split, n in (("train.parquet", "train", n_train), ("test.parquet", "test", n_val)):
        table = pa.Table.from_pylist(make_rows(n, split, seed), schema=schema)
        path = out / name
        pq.write_table(table, path)
        paths.append(path)
    return paths[0], paths[1]
