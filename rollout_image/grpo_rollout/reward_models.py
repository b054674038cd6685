"""Reward models as scorers (what `grpo reward` serves, docs/ARCHITECTURE.md §1): a classifier
(a sequence-classification head, as Skywork-Reward and most open RMs) or an LLM judge (a prompt
template, greedy decoding through the engine layer, a score parser).

Each (prompt, response) is rendered again with the reward model's own tokenizer and chat template,
as verl's reward loop does: the policy's tokens are not the reward model's. A rendering longer than
`maxLength` keeps its last tokens (the end of the response, and for a classifier the token the
head reads).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field

from grpo_api.spec import RewardModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoreInput:
    messages: list[dict]
    """The prompt as chat messages ({role, content})."""
    response: str
    ground_truth: str = ""


@dataclass(frozen=True)
class ItemScore:
    score: float
    parsed: bool = True
    """False when a judge's answer had no score: the score is then 0 (and counted)."""
    judge_output: str = ""


@dataclass
class ScoreBatch:
    scores: list[ItemScore]
    tokens: int = 0
    """Rendered tokens scored (after truncation)."""
    unparsed: int = field(default=0)


def token_ids(encoded) -> list[int]:
    """apply_chat_template's ids: a list, or (transformers 5) a BatchEncoding."""
    return list(encoded) if isinstance(encoded, list) else list(encoded["input_ids"])


def render_conversation(tokenizer, messages: list[dict], response: str, max_length: int) -> list[int]:
    """The prompt and the response as the reward model's chat template lays them out, cut from the left."""
    conversation = [*messages, {"role": "assistant", "content": response}]
    ids = token_ids(tokenizer.apply_chat_template(conversation, tokenize=True))
    return ids[-max_length:]


def prompt_text(messages: list[dict]) -> str:
    """{prompt} of a judge's template: the messages' contents (one user message: its content)."""
    return "\n\n".join(str(m.get("content", "")) for m in messages)


_PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth)\}")


def fill_template(template: str, item: ScoreInput) -> str:
    """Only {prompt}, {response} and {ground_truth} are replaced: other braces (a JSON example in the
    template) stay as written, which str.format would refuse."""
    values = {"prompt": prompt_text(item.messages), "response": item.response, "ground_truth": item.ground_truth}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


def parse_tag_score(text: str, tag: str) -> float | None:
    """The number in the last <tag>...</tag> of `text` (whitespace around it allowed); None without one."""
    found = re.findall(rf"<{re.escape(tag)}>\s*({_NUMBER})\s*</{re.escape(tag)}>", text)
    if not found:
        return None
    value = float(found[-1])
    return value if math.isfinite(value) else None


def parse_yes_no(first_token: str, logprob: float) -> float | None:
    """P(yes) from the first generated token and its log-probability: p when it is "yes", 1 - p
    when it is "no" (the rest of the mass taken as the other answer), None for anything else."""
    word = first_token.strip().strip(".,:;!\"'").lower()
    p = math.exp(logprob)
    if word == "yes":
        return p
    if word == "no":
        return 1.0 - p
    return None


def batches_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that each group's padded size (longest x count) stays
    within `max_tokens`; a sequence longer than the budget is a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and lengths[out[-1][0]] * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class ClassifierScorer:
    """AutoModelForSequenceClassification: the head's (last label's) logit at the last token."""

    kind = "classifier"

    def __init__(self, spec: RewardModelSpec, *, device: str, path: str | None = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.spec = spec
        self.device = torch.device(device)
        dtype = getattr(torch, spec.dtype.value) if self.device.type == "cuda" else torch.float32
        model_path = path or spec.path
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path or model_path,
                                                       trust_remote_code=spec.trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, torch_dtype=dtype, trust_remote_code=spec.trust_remote_code).to(self.device).eval()
        self.head = getattr(self.model, "score", None) or getattr(self.model, "classifier", None)
        if self.head is None:
            raise ValueError(f"spec.reward.rewardModels {spec.name}: {model_path} has no `score` or `classifier` head")

    def score(self, items: list[ScoreInput]) -> ScoreBatch:
        import torch

        rendered = [render_conversation(self.tokenizer, it.messages, it.response, self.spec.max_length) for it in items]
        scores = [0.0] * len(items)
        with torch.inference_mode():
            for batch in batches_by_tokens([len(r) for r in rendered], self.spec.max_tokens_per_batch):
                longest = max(len(rendered[i]) for i in batch)
                ids = torch.zeros(len(batch), longest, dtype=torch.long)
                mask = torch.zeros(len(batch), longest, dtype=torch.long)
                for row, i in enumerate(batch):
                    ids[row, :len(rendered[i])] = torch.tensor(rendered[i])
                    mask[row, :len(rendered[i])] = 1
                # Right padding and our own pooling at each row's last real token: the model's own
                # pooling looks for the pad token id, which may also be a real token (the EOS).
                hidden = self.model.base_model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))[0]
                last = hidden[torch.arange(len(batch)), mask.sum(dim=1).to(self.device) - 1]
                logits = self.head(last).float()
                for row, i in enumerate(batch):
                    scores[i] = float(logits[row, -1])
        return ScoreBatch([ItemScore(s) for s in scores], tokens=sum(map(len, rendered)))

    def close(self) -> None:
        self.model = None


class JudgeScorer:
    """An LLM asked `promptTemplate` through the engine layer (hf or vllm), greedy, parsed."""

    kind = "judge"

    def __init__(self, spec: RewardModelSpec, *, device: str, path: str | None = None):
        from transformers import AutoTokenizer

        self.spec = spec
        model_path = path or spec.path
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path or model_path,
                                                       trust_remote_code=spec.trust_remote_code)
        common = dict(dtype=spec.dtype.value if device != "cpu" else "float32", seed=0,
                      tokenizer_path=spec.tokenizer_path, trust_remote_code=spec.trust_remote_code)
        if spec.engine == "hf":
            from grpo_rollout.hf_engine import HFEngine
            self.engine = HFEngine(model_path, device=device, **common)
        else:
            from grpo_rollout.vllm_engine import VLLMEngine
            self.engine = VLLMEngine(model_path, tensor_parallel_size=max(spec.gpus, 1),
                                     gpu_memory_utilization=spec.gpu_memory_utilization,
                                     max_model_len=spec.max_length, enforce_eager=False,
                                     max_num_batched_tokens=max(spec.max_tokens_per_batch, spec.max_length), **common)

    def render(self, item: ScoreInput) -> list[int]:
        question = [{"role": "user", "content": fill_template(self.spec.prompt_template, item)}]
        ids = token_ids(self.tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True))
        return ids[-max(self.spec.max_length - self.spec.max_new_tokens, 1):]

    def score(self, items: list[ScoreInput]) -> ScoreBatch:
        from grpo_rollout.engine import SamplingParams

        prompts = [self.render(it) for it in items]
        params = SamplingParams(n=1, max_tokens=self.spec.max_new_tokens, temperature=0.0, seed=0)
        groups = self.engine.generate(prompts, params)
        out, unparsed = [], 0
        for group in groups:
            sample = group[0]
            text = self.engine.decode(sample.token_ids)
            if self.spec.parser == "tag":
                value = parse_tag_score(text, self.spec.score_tag)
            else:
                first = self.engine.decode(sample.token_ids[:1]) if sample.token_ids else ""
                value = parse_yes_no(first, sample.logprobs[0]) if sample.token_ids else None
            if value is None:
                unparsed += 1
            out.append(ItemScore(0.0 if value is None else value, parsed=value is not None, judge_output=text))
        return ScoreBatch(out, tokens=sum(map(len, prompts)), unparsed=unparsed)

    def close(self) -> None:
        self.engine.close()


def build_scorer(spec: RewardModelSpec, *, device: str, path: str | None = None):
    return (ClassifierScorer if spec.kind == "classifier" else JudgeScorer)(spec, device=device, path=path)
