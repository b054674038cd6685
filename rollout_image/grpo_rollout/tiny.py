"""A tiny random-weight model of a real architecture, with a tokenizer built locally.

Used by the quickstart (the embedded default job: a real GRPO run on a CPU laptop) and by the
integration tests. Nothing is downloaded: the config is written from code, the weights are a
seeded random init, and the tokenizer is a word-level vocabulary built with `tokenizers`.

The vocabulary covers exactly what the quickstart task needs (ChatML specials and role names,
the task's words, the digits and GSM8K's `####` answer marker). A small vocabulary matters:
the random-init policy samples close to uniformly over it, so 26 tokens keep the chance of a
right `#### d` answer (1-3 in 100 samples) high enough for GRPO to find a signal at once.
`decode(ids, skip_special_tokens=True)` joins words with spaces, so a response
`#### 7 <|im_end|>` decodes to `#### 7`, which verl's GSM8K rule parses.

torch/transformers are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, UNK]

# Qwen's ChatML, without the <think> handling (the tiny vocabulary has no such tokens).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Role names, GSM8K's answer marker, the digits, then the quickstart task's words
# (grpo_rollout.quickstart_data.PROMPT_TEMPLATES uses only these).
TASK_WORDS = ["copy", "the", "digit", "is", "then", "answer", "and", "with"]
VOCAB_WORDS = ["system", "user", "assistant", "####", *[str(d) for d in range(10)], *TASK_WORDS]

# Default size: ~77k parameters. Big enough to learn "find the digit in the prompt and copy
# it after ####" from random init in ~55-90 GRPO steps, small enough that a step (64 prompts x
# 8 samples) takes ~0.2 s on two CPU cores. Overridable with **size (any Qwen3Config field).
DEFAULT_SIZE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # Untied (as Qwen3-8B). With tied embeddings GRPO runs in the benchmark sometimes fell into
    # "#### #### ####" for good (reward 0 everywhere, so no gradient left): likely because
    # learning to emit "####" grows the shared "####" row, which then predicts itself.
    tie_word_embeddings=False,
)


def build_tokenizer(words: list[str] | None = None):
    """A `PreTrainedTokenizerFast`: word-level, split on whitespace and punctuation runs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = VOCAB_WORDS if words is None else words
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [w for w in words if w not in SPECIAL_TOKENS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Whitespace = `\w+|[^\w\s]+`: "####7" and "#### 7" both give ["####", "7"].
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # No decoder: decoding joins the words with single spaces ("#### 7").
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,          # what a chat response ends with (as Qwen's instruct models)
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEFAULT_SIZE["max_position_embeddings"],
        padding_side="left",       # decoder-only generation pads on the left
    )
    return fast


def build_tiny_model(out_dir: str | Path, arch: str = "qwen3", vocab: list[str] | None = None,
                     seed: int = 0, **size) -> Path:
    """Write a random-init model + tokenizer to `out_dir` (loadable offline with Auto*.from_pretrained).

    arch: only "qwen3" (Qwen3Config / Qwen3ForCausalLM). vocab: the words of the tokenizer
    (specials are added); default is the quickstart vocabulary. seed: the weight init seed.
    size: Qwen3Config overrides, e.g. hidden_size=128, num_hidden_layers=4.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if arch != "qwen3":
        raise ValueError(f"unknown arch {arch!r}: only 'qwen3' is supported")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab)
    ids = tokenizer.convert_tokens_to_ids
    cfg = dict(DEFAULT_SIZE)
    cfg.update(size)
    config = Qwen3Config(
        vocab_size=len(tokenizer),  # exactly the vocabulary: no never-used rows to sample at init
        pad_token_id=ids(PAD),
        bos_token_id=None,
        eos_token_id=ids(IM_END),
        dtype="float32",
        **cfg,
    )
    # Seed the init so the same seed writes the same weights (fork_rng: leave the caller's RNG be).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=ids(IM_END), pad_token_id=ids(PAD), bos_token_id=None,
        do_sample=True, temperature=1.0, top_p=1.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 writes its own class name ("TokenizersBackend"); the 4.x name loads in both.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    # transformers writes model.safetensors 0600: pods running as another uid (the images'
    # 1000) and other users of a shared cache could not read the weights.
    for f in out.iterdir():
        f.chmod(f.stat().st_mode | 0o044)
    return out


def build_tiny_reward_model(out_dir: str | Path, vocab: list[str] | None = None, seed: int = 1, **size) -> Path:
    """A tiny random-init classifier reward model (Qwen3ForSequenceClassification, one label) and the
    same word-level tokenizer and chat template: a random RM's score is a fixed, learnable function
    of the text (tests, the reward-model quickstart)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab)
    ids = tokenizer.convert_tokens_to_ids
    cfg = dict(DEFAULT_SIZE, max_position_embeddings=1024)
    cfg.update(size)
    config = Qwen3Config(vocab_size=len(tokenizer), pad_token_id=ids(PAD), bos_token_id=None,
                         eos_token_id=ids(IM_END), dtype="float32", num_labels=1, **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForSequenceClassification(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    for f in out.iterdir():
        f.chmod(f.stat().st_mode | 0o044)
    return out
