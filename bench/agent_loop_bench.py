"""Issue 32 item 8: multi-turn generation through the agent loop against single-turn generation of
the same number of model tokens, on the rollout engine (vLLM on the GPU, hf with --tiny).

The model is bench/h200_bench.py's (`build`: Qwen3-1.7B shape, random bf16 weights) with the
lookup task's tokenizer (grpo_rollout.tool_task: its vocabulary holds the whole Hermes call
`<tool_call>{"name": "lookup", ...}</tool_call>` as one token) in a sibling folder. Random
weights never sample a tool call, so the model's side of a call is scripted here, and named so:
`ScriptedCallEngine` (a bench-only stand-in for a policy that calls a tool) ends each of the first
`turns - 1` turns after `--turn-tokens` sampled tokens with the call token appended (logprob 0).
Everything else is what a rollout server runs: grpo_rollout.agent_loop.ToolAgentLoop (parse,
ToolRunner, the tool turn rendered by the chat template, continuation from token ids) on the
real engine, and the real `lookup` tool. Measured: wall time of 32 prompts x n=8 with
`turns x turn-tokens` model tokens each, against one turn of the same length.

    python bench/agent_loop_bench.py --workdir /tmp/grpo-bench --results OUT.jsonl [--tiny]
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import bench_common
from bench_common import bench_parser


def model_with_tool_tokenizer(model_dir: Path, out: Path) -> Path:
    """The bench model's files with tool_task's tokenizer (the call token, the tool role)."""
    from tokenizers import AddedToken

    from grpo_rollout import tiny, tool_task
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if "tokenizer" not in f.name and f.name != "special_tokens_map.json" and not (out / f.name).exists():
            os.symlink(f.resolve(), out / f.name)
    tok = tiny.build_tokenizer(words=tool_task.WORDS)
    # The call as one token (tool_task's), and Qwen3's own single tokens for the tags, so that the
    # agent loop's stop `</tool_call>` is one token, as with a real Qwen3 tokenizer.
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False)
                    for t in (tool_task.CALL_TOKEN, "<tool_call>", "</tool_call>")])
    tok.model_max_length = 4096
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return out


class ScriptedCallEngine:
    """Bench-only: the real engine, with a tool call appended to each of the first `turns - 1`
    turns (a random-weight model never writes one). Stop strings are passed on (vLLM then
    detokenizes as it does in a real multi-turn job, unless the stop is one token: grpo_rollout.vllm_engine's
    single_token_stops) unless `keep_stops` is False."""

    def __init__(self, engine, call_id: int, turn_tokens: int, turns: int, keep_stops: bool):
        self.engine, self.call_id, self.turn_tokens, self.turns = engine, call_id, turn_tokens, turns
        self.keep_stops = keep_stops
        self.tokenizer = engine.tokenizer
        self.turn = 0

    def decode(self, ids):
        return self.engine.decode(ids)

    def generate(self, prompt_ids, params):
        self.turn += 1
        last = self.turn >= self.turns
        p = replace(params, max_tokens=min(params.max_tokens, self.turn_tokens),
                    stop=params.stop if self.keep_stops else ())
        groups = self.engine.generate(prompt_ids, p)
        if not last:
            for [s] in groups:
                s.token_ids = s.token_ids[:self.turn_tokens] + [self.call_id]
                s.logprobs = s.logprobs[:self.turn_tokens] + [0.0]
                s.finish_reason = "stop"
        return groups


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = ap.parse_args(argv)

    import torch

    from grpo_api.spec import MultiTurnSpec
    from grpo_rollout import tool_task
    from grpo_rollout.agent_loop import ToolAgentLoop
    from grpo_rollout.engine import SamplingParams
    from grpo_rollout.shard import Prompt
    from grpo_rollout.tools import ToolRunner, load_tools

    work = Path(args.workdir)
    model = model_with_tool_tokenizer(work / "model", work / "model-tools")
    gpu = torch.cuda.is_available() and not args.tiny
    if gpu:
        from grpo_rollout.vllm_engine import VLLMEngine
        engine = VLLMEngine(str(model), dtype="bfloat16", seed=0, gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        from grpo_rollout.hf_engine import HFEngine
        engine = HFEngine(str(model), dtype="float32", device="cpu", seed=0)
    tok = engine.tokenizer
    call_id = tok.convert_tokens_to_ids(tool_task.CALL_TOKEN)
    prompts_n, n, prompt_len = (4, 2, 24) if args.tiny else (32, 8, 256)
    turns, turn_tokens = (2, 8) if args.tiny else (args.turns, args.turn_tokens)
    words = [w for w in tool_task.WORDS if w.isalnum()]
    prompts = []
    for i in range(prompts_n):
        ids = [tok.convert_tokens_to_ids(words[(i + k) % len(words)]) for k in range(prompt_len)]
        prompts.append(Prompt(f"p{i}", i, ids, "bench", str(i % 10),
                              {"tools_kwargs": {"lookup": {"create_kwargs": {"digit": str(i % 10)}}}}))
    spec = MultiTurnSpec(enable=True, tools=["grpo_rollout.tool_task:lookup"], max_assistant_turns=turns)
    runner = ToolRunner(load_tools(spec), timeout_seconds=spec.tool_timeout_seconds,
                        max_response_length=spec.max_tool_response_length,
                        truncate_side=spec.tool_response_truncate_side)
    model_tokens = turns * turn_tokens
    max_response = model_tokens + 64 * turns          # room for the calls and the tool turns
    rows = []

    def emit(row):
        rows.append(bench_common.emit(args, "agent_loop", engine="vllm" if gpu else "hf", prompts=prompts_n, n=n,
                                      prompt_len=prompt_len, **row))

    params = SamplingParams(n=n, max_tokens=model_tokens, temperature=1.0)
    engine.generate([p.prompt_ids for p in prompts[:2]], replace(params, max_tokens=4))      # warm-up
    for rep in range(args.reps):
        t = time.perf_counter()
        groups = engine.generate([p.prompt_ids for p in prompts], params)
        secs = time.perf_counter() - t
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        emit({"variant": "single-turn", "rep": rep, "seconds": round(secs, 3), "model_tokens": tokens,
              "model_tokens_per_s": round(tokens / secs)})
    for keep_stops in (False, True):     # with stop strings last: if vLLM's detokenizer fails, it fails last
        variant = f"{turns}-turn, {turn_tokens} tokens a turn" + ("" if keep_stops else ", no stop strings")
        for rep in range(args.reps):
            scripted = ScriptedCallEngine(engine, call_id, turn_tokens, turns, keep_stops)
            loop = ToolAgentLoop(spec, scripted, tok, runner, max_response)
            t = time.perf_counter()
            try:
                groups = loop.generate(prompts, params)
            except Exception as exc:        # one variant's failure (vLLM's detokenizer) keeps the others
                emit({"variant": variant, "rep": rep, "error": f"{type(exc).__name__}: {exc}"[:500]})
                break
            secs = time.perf_counter() - t
            samples = [s for g in groups for s in g]
            sampled = sum(sum(s.response_mask) for s in samples)
            emit({"variant": variant, "rep": rep, "seconds": round(secs, 3), "model_tokens": sampled,
                  "tool_tokens": sum(len(s.token_ids) for s in samples) - sampled,
                  "model_tokens_per_s": round(sampled / secs),
                  "turns_mean": sum(s.agent["num_turns"] for s in samples) / len(samples),
                  "tool_calls": sum(len(s.agent["tool_calls"]) for s in samples),
                  "tool_errors": sum(s.agent["tool_errors"] for s in samples),
                  "engine_calls": scripted.turn})
    single = [r["seconds"] for r in rows if r["variant"] == "single-turn"]
    for r in rows:
        if r["variant"] != "single-turn" and "seconds" in r:
            r_ratio = r["seconds"] / min(single)
            print(f"RATIO {r['variant']} / single-turn: {r['seconds']:.2f}s / {min(single):.2f}s = {r_ratio:.2f}")
    engine.close()
    if not args.tiny:
        shutil.rmtree(work / "model-tools", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
