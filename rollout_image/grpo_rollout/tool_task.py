"""The lookup task: the quickstart's "answer #### and the digit", except that the prompt doesn't
show the digit: only the `lookup` tool knows it (from the row's tools_kwargs). A policy scores
only by calling the tool and copying its answer, so the reward rises only if it learns to use
the tool (tests/integration/test_multi_turn.py; examples/multi-turn-lookup.yaml).

Learnable from random init by design: the tiny vocabulary holds the whole call,
`<tool_call>{"name": "lookup", "arguments": {}}</tool_call>`, as one (non-special) token, so a
random policy writes a well-formed call about once in 30 tokens, as it writes `####`. The
model then has to learn two things GRPO finds separately: call, and copy the digit the tool
answered after `####`. The agent loop is the same as for a real model: stop at `</tool_call>`,
Hermes parse, the tool turn rendered by the chat template (role "tool").
"""

from __future__ import annotations

import random
from pathlib import Path

from grpo_rollout import tiny

CALL_TOKEN = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
PYTHON_CALL_TOKEN = '<tool_call>{"name": "python", "arguments": {"code": "import os; print(len(os.listdir()))"}}</tool_call>'
"""A call of the built-in `python` tool, for models that should also run code (the sandbox tests):
it prints 1, the program's fresh folder holding only itself."""
DATA_SOURCE = "openai/gsm8k"        # scored by verl's GSM8K rule, as the quickstart
PROMPTS = ["answer #### and the digit", "the digit is hidden answer with #### then the digit",
           "copy the digit then answer ####"]
WORDS = [*tiny.VOCAB_WORDS, "tool", "hidden"]


def lookup(*, digit: str) -> str:
    """Look up the hidden digit of this question."""
    return str(digit)


def build_model(out_dir: str | Path, seed: int = 0, calls: tuple[str, ...] = (CALL_TOKEN,)) -> Path:
    """tiny's model with the call tokens (`calls`) and the tool role in its vocabulary."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tiny.build_tiny_model(out_dir, vocab=WORDS, seed=seed)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens([AddedToken(call, special=False, normalized=False, single_word=False) for call in calls])
    model = AutoModelForCausalLM.from_pretrained(out)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for f in Path(out).iterdir():
        f.chmod(f.stat().st_mode | 0o044)
    return Path(out)


def make_rows(n: int, split: str, seed: int) -> list[dict]:
    rng = random.Random(f"lookup-{seed}-{split}")
    rows = []
    for i in range(n):
        d = str(rng.randrange(10))
        question = rng.choice(PROMPTS)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "ability": "tool",
            "reward_model": {"style": "rule", "ground_truth": d},
            "extra_info": {"split": split, "index": i, "agent_name": "tool_agent",
                           "tools_kwargs": {"lookup": {"create_kwargs": {"digit": d}}}},
        })
    return rows


def write_dataset(out_dir: str | Path, n_train: int = 1024, n_val: int = 32, seed: int = 0) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, split, n in (("train.parquet", "train", n_train), ("test.parquet", "test", n_val)):
        path = out / name
        pq.write_table(pa.Table.from_pylist(make_rows(n, split, seed)), path)
        paths.append(path)
    return paths[0], paths[1]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's GSM8K rule on the whole trajectory, counted only when the answer was looked up:
    a guess without a successful `lookup` call scores 0 (the tool calls reach the reward
    through extra_info, as verl's tool agent passes them). Without this rule a random policy
    learns to guess faster than to look up (a right guess pays 1 in 10 at once)."""
    from grpo_rollout.rewards.gsm8k import gsm8k_score
    calls = (extra_info or {}).get("tool_calls") or []
    looked_up = any(c.get("name") == "lookup" and not c.get("error") for c in calls)
    return gsm8k_score(solution_str, ground_truth) if looked_up else 0.0
