"""Where the 256 x 512 generation time of the vLLM rollout engine goes (issue 19: 6.1-7.0 s in our
server against <= 3 s). One vLLM engine built with our adapter's arguments (llm_kwargs, 35 % of
the GPU as the bench server), the issue-14 workload (32 prompts of 256 random tokens x n=8, 512
new tokens, temperature 1), timed in variants that each remove one suspect:

- ours: SamplingParams as the adapter makes them (logprobs=0), then the adapter's conversion
  of the outputs (samples_from_output);
- no logprobs: logprobs=None (vLLM then builds no per-token Logprob objects);
- 256 distinct prompts x n=1 instead of 32 x n=8 (vLLM fans n out into child requests);
- prefill only (max_tokens=1): what is left is 511 decode steps, reported per step.

    PYTHONPATH=~/site:... python bench/vllm_gen_breakdown.py MODEL_DIR [--repeats 2]

Prints one RESULT JSON line per variant (seconds, median of the repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    from grpo_rollout.engine import SamplingParams
    from grpo_rollout.vllm_engine import environment_defaults, llm_kwargs, sampling_kwargs, samples_from_output

    environment_defaults()
    started = time.perf_counter()
    llm = LLM(**llm_kwargs(args.model, dtype="bfloat16", seed=1, tokenizer_path=None, trust_remote_code=False,
                           tensor_parallel_size=1, gpu_memory_utilization=args.gpu_memory_utilization,
                           max_model_len=768, enforce_eager=False, max_num_batched_tokens=None))
    print(f"engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    ids32 = torch.randint(100, 20000, (32, 256), generator=g).tolist()
    ids256 = torch.randint(100, 20000, (256, 256), generator=g).tolist()
    ours = VSamplingParams(**sampling_kwargs(SamplingParams(n=8, max_tokens=512, temperature=1.0, top_p=1.0)))

    def variant(name: str, prompts, sampling, convert: bool = False) -> None:
        times, convert_times, tokens = [], [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            if convert:
                t1 = time.perf_counter()
                [samples_from_output(o) for o in outputs]
                convert_times.append(time.perf_counter() - t1)
        row = {"bench": "vllm_gen_breakdown", "variant": name, "seconds": round(statistics.median(times), 3),
               "all_s": [round(t, 3) for t in times], "tokens": tokens}
        if convert_times:
            row["convert_s"] = round(statistics.median(convert_times), 3)
        print("RESULT " + json.dumps(row), flush=True)

    variant("warm-up", ids32, ours)
    variant("ours (logprobs=0, 32 x n=8)", ids32, ours, convert=True)
    variant("no logprobs", ids32, VSamplingParams(**{**sampling_kwargs(
        SamplingParams(n=8, max_tokens=512, temperature=1.0, top_p=1.0)), "logprobs": None}))
    variant("256 prompts x n=1, logprobs=0", ids256, VSamplingParams(**sampling_kwargs(
        SamplingParams(n=1, max_tokens=512, temperature=1.0, top_p=1.0))))
    variant("prefill only (max_tokens=1)", ids32, VSamplingParams(**sampling_kwargs(
        SamplingParams(n=8, max_tokens=1, temperature=1.0, top_p=1.0))))


if __name__ == "__main__":
    main()
