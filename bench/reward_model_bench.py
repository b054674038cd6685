"""Throughput of reward models (issue 31), as `grpo reward` scores 256 responses of 512 tokens.

- classifier (default): a Qwen3-1.7B-shaped sequence classifier (random weights, one label, bf16),
  grpo_rollout.reward_models.ClassifierScorer (rendered with the RM's chat template, batched by
  tokens), directly and through the gRPC server and client (token auth, plaintext on loopback).
- `--judge`: a Qwen3-1.7B-shaped causal LM as an LLM judge, JudgeScorer on the vLLM engine (hf
  with --tiny): the template filled, greedy decoding of `--judge-new-tokens`, the tag parser.
  Random weights write no score, so every answer counts as unparsed: only the time means something.

One JSON line per result on stdout (and appended to --results); bench/RESULTS.md has the numbers.

    python bench/reward_model_bench.py [--judge] [--tiny]     # --tiny: CPU check at a tiny size
"""

from __future__ import annotations

import random
import tempfile
import time

import bench_common
from bench_common import bench_parser

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def build(out: str, size: dict, vocab_size: int, device: str, *, causal_lm: bool = False) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    from grpo_rollout.tiny import IM_END, PAD, build_tokenizer
    tok = build_tokenizer()
    ids = tok.convert_tokens_to_ids
    config = Qwen3Config(vocab_size=max(vocab_size, len(tok)), pad_token_id=ids(PAD), eos_token_id=ids(IM_END),
                         num_labels=1, dtype="bfloat16", **size)
    torch.manual_seed(0)
    with torch.device(device):
        model = (Qwen3ForCausalLM if causal_lm else Qwen3ForSequenceClassification)(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def items(n: int, response_tokens: int, seed: int = 0):
    from grpo_rollout.reward_client import ScoreItem
    from grpo_rollout.tiny import VOCAB_WORDS
    rng = random.Random(seed)
    words = [w for w in VOCAB_WORDS if w.isalnum()]
    return [ScoreItem([{"role": "user", "content": " ".join(rng.choices(words, k=20))}],
                      " ".join(rng.choices(words, k=response_tokens)), "") for _ in range(n)]


def main() -> None:
    global _ARGS
    p = bench_parser(__doc__)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=512)
    p.add_argument("--judge", action="store_true")
    p.add_argument("--judge-new-tokens", type=int, default=64)
    args = _ARGS = p.parse_args()     # --workdir is not used: the model goes to a temp dir
    if args.judge:
        return judge(args)
    import torch

    from grpo_api.spec import RewardModelSpec
    from grpo_rollout.reward_client import RewardModelClient
    from grpo_rollout.reward_models import ClassifierScorer, ScoreInput
    from grpo_rollout.reward_server import RewardServerMetrics, RewardServicer, start_server

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    n = 16 if args.tiny else args.n
    folder = tempfile.mkdtemp(prefix="rm-bench-")
    t0 = time.perf_counter()
    build(folder, TINY if args.tiny else QWEN3_1_7B, 0 if args.tiny else 151936, device)
    batch = items(n, 64 if args.tiny else args.response_tokens)
    inputs = [ScoreInput(i.messages, i.response, i.ground_truth) for i in batch]
    for budget in (16384, 65536, 131072):
        spec = RewardModelSpec(name="rm", path=folder, max_length=4096, max_tokens_per_batch=budget)
        scorer = ClassifierScorer(spec, device=device)
        scorer.score(inputs[:8])                                   # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            out = scorer.score(inputs)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        best = min(times)
        row = {"what": "classifier direct", "device": device, "responses": n, "tokens": out.tokens,
               "max_tokens_per_batch": budget, "seconds": round(best, 4),
               "responses_per_s": round(n / best, 1), "tokens_per_s": round(out.tokens / best),
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None}
        print_row(row)
        if budget == 65536:
            server, port = start_server(RewardServicer("rm", scorer, RewardServerMetrics("b", "b", "rm")), "tok",
                                        host="127.0.0.1", port=0)
            client = RewardModelClient(spec, [f"127.0.0.1:{port}"], "tok")
            client.score("warm", batch[:8])
            t = time.perf_counter()
            client.score("bench", batch)
            served = time.perf_counter() - t
            print_row({"what": "classifier served (gRPC, loopback)", "device": device, "responses": n,
                              "max_tokens_per_batch": budget, "seconds": round(served, 4),
                              "responses_per_s": round(n / served, 1),
                              "overhead_vs_direct_s": round(served - best, 4)})
            client.close()
            server.stop(0)
        scorer.close()
        del scorer
        if device == "cuda":
            torch.cuda.empty_cache()
    print_row({"what": "total", "seconds": round(time.perf_counter() - t0, 1)})


_ARGS = None     # main's arguments: where print_row's results go


def print_row(row: dict) -> None:
    bench_common.emit(_ARGS, "reward_model", **row)


JUDGE_TEMPLATE = ("Rate how well the response answers the question, from 0 to 10.\n\nQuestion: {prompt}\n\n"
                  "Response: {response}\n\nAnswer with <score>N</score>.")


def judge(args) -> None:
    import torch

    from grpo_api.spec import RewardModelSpec
    from grpo_rollout.reward_models import JudgeScorer, ScoreInput

    gpu = torch.cuda.is_available() and not args.tiny
    n = 16 if args.tiny else args.n
    folder = tempfile.mkdtemp(prefix="rm-judge-bench-")
    t0 = time.perf_counter()
    build(folder, TINY if args.tiny else QWEN3_1_7B, 0 if args.tiny else 151936, "cuda" if gpu else "cpu",
          causal_lm=True)
    inputs = [ScoreInput(i.messages, i.response, i.ground_truth)
              for i in items(n, 64 if args.tiny else args.response_tokens)]
    spec = RewardModelSpec(name="judge", kind="judge", path=folder, engine="vllm" if gpu else "hf",
                           prompt_template=JUDGE_TEMPLATE, max_new_tokens=8 if args.tiny else args.judge_new_tokens,
                           max_length=2048, max_tokens_per_batch=65536, gpu_memory_utilization=0.5)
    t = time.perf_counter()
    scorer = JudgeScorer(spec, device="cuda" if gpu else "cpu")
    start_s = time.perf_counter() - t
    scorer.score(inputs[:8])                                       # warm-up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        out = scorer.score(inputs)
        times.append(time.perf_counter() - t)
    best = min(times)
    print_row({"what": f"judge direct ({spec.engine})", "responses": n, "prompt_tokens": out.tokens,
               "new_tokens_max": spec.max_new_tokens, "seconds": round(best, 3), "all_s": [round(x, 3) for x in times],
               "responses_per_s": round(n / best, 1), "prompt_tokens_per_s": round(out.tokens / best),
               "unparsed": out.unparsed, "engine_start_s": round(start_s, 1),
               })     # no peak memory: vLLM's engine core runs in a process of its own
    scorer.close()
    print_row({"what": "total", "seconds": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
