"""Issue 18 item 3: the hf engine on the GPU, against the engine it replaced, in one process.

Needs the bench model and data (`bench/h200_run.sh build`). Measures, on the Qwen3-1.7B shape in
bf16 (EOS suppressed, so every response is max_tokens long):
  - 256 x 512 generation, each engine: its first call, a warm call, and a warm call with prompts
    of different lengths (left-padded). The previous engine is a file given with --previous, e.g.
    `git show 049cb35:rollout_image/grpo_rollout/hf_engine.py > bench/.prev_hf_engine.py`;
  - greedy agreement: 64 left-padded prompts (64-256 tokens) x 128 tokens with both engines:
    rows identical, the first position where the others diverge (bf16 kernels differ), and each
    engine's behaviour logprobs against the trainer-style recompute (mean and max |delta|);
  - peak GPU memory of each engine's call.

  python bench/hf_engine_check.py --workdir /tmp/grpo-bench --previous /tmp/prev_hf_engine.py
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import bench_parser  # noqa: E402
import h200_bench as hb  # noqa: E402  (the bench's workload, prompts and results format)


def load_engine_class(path: str | None):
    if path is None:
        from grpo_rollout.hf_engine import HFEngine
        return HFEngine
    spec = importlib.util.spec_from_file_location("previous_hf_engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HFEngine


def timed(engine, prompts, params, dev) -> tuple[float, list]:
    import torch
    hb.sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    groups = engine.generate(prompts, params)
    hb.sync(dev)
    return time.perf_counter() - t, groups


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--previous", default=None, help="the previous engine's hf_engine.py")
    p.add_argument("--previous-greedy-only", action="store_true",
                   help="the previous engine only in the greedy comparison (its timings are known)")
    args = p.parse_args()
    import torch
    from grpo_rollout.engine import SamplingParams

    w, dev = hb.workload(args), hb.device()
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    model_dir = str(Path(args.workdir) / "model")
    prompts = hb.bench_prompts(args, w["prompts"])
    full = SamplingParams(n=w["n"], max_tokens=w["response_len"], seed=100)
    gib = (lambda: torch.cuda.max_memory_allocated(dev) / 2**30) if dev.type == "cuda" else (lambda: 0.0)

    # Real prompts differ in length: the same batch with prompts cut to half to all of their length
    # (left padding, so attention needs a mask).
    lengths = [w["prompt_len"] // 2 + (i * 7) % (w["prompt_len"] // 2 + 1) for i in range(len(prompts))]
    padded = [p[-n:] for p, n in zip(prompts, lengths)]
    engines = {}
    for name, path in (("current", None), ("previous", args.previous)):
        if name == "previous" and path is None:
            continue
        engine = load_engine_class(path)(model_dir, dtype=dtype, device=dev.type, seed=0)
        engine._eos = {-1}      # every response max_tokens long
        engines[name] = engine
        if name == "previous" and args.previous_greedy_only:
            continue
        first = timed(engine, prompts, full, dev)[0]          # the first call of this engine
        warm = timed(engine, prompts, full, dev)[0]
        peak = gib()
        pad = timed(engine, padded, full, dev)[0]
        hb.log(f"{name}: {len(prompts) * w['n']} x {w['response_len']}: first call {first:.2f}s, warm {warm:.2f}s, "
               f"padded prompts {pad:.2f}s, peak {peak:.1f} GiB")
        hb.emit(args, "hf_engine", variant=name, first_s=first, warm_s=warm, padded_s=pad,
                sequences=len(prompts) * w["n"], max_tokens=w["response_len"], peak_gib=peak)

    if len(engines) == 2:
        rows = padded + [p[-n // 2:] for p, n in zip(prompts, lengths)]      # 64 left-padded prompts
        greedy = SamplingParams(n=1, max_tokens=min(128, w["response_len"]), temperature=0.0)
        out = {name: [g[0] for g in e.generate(rows, greedy)] for name, e in engines.items()}
        same, diverge, lp_delta = 0, [], 0.0
        for a, b in zip(out["current"], out["previous"]):
            if a.token_ids == b.token_ids:
                same += 1
                lp_delta = max(lp_delta, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
            else:
                diverge.append(next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y))
        # Each engine's logprobs against a recompute as the trainer does it (one forward over prompt
        # + response, no padding, no cache; the previous engine's model, plain sdpa).
        parity = {}
        for name, samples in out.items():
            deltas = []
            with torch.no_grad():
                for row, s in zip(rows, samples):
                    logits = engines["previous"].model(torch.tensor([row + s.token_ids], device=dev)).logits[0].float()
                    lp = logits[len(row) - 1:-1].log_softmax(-1).gather(-1, torch.tensor(s.token_ids, device=dev)[:, None])
                    deltas.extend((lp[:, 0].cpu() - torch.tensor(s.logprobs)).abs().tolist())
            parity[name] = {"mean": sum(deltas) / len(deltas), "max": max(deltas)}
        hb.log(f"greedy: {same}/{len(rows)} rows identical; others diverge at {sorted(diverge)}; "
               f"max |logprob delta| on identical rows {lp_delta:.3g}; against the recompute: {parity}")
        hb.emit(args, "hf_engine_greedy", rows=len(rows), identical=same, diverge_at=sorted(diverge),
                max_logprob_delta=lp_delta, tokens=greedy.max_tokens, recompute_parity=parity)
    return 0


if __name__ == "__main__":
    sys.exit(main())
