"""Issue 47: the CPU side of a step's update, which the GPU waits for: the issue-14 workload's
samples (32 prompts x 8, 256 + 512 tokens) cut into micro-batches of 16 K tokens and collated,
packed rows and shared prompts, then the token rewards and advantages. Needs no GPU or model.

  python bench/collate_cpu.py [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import h200_bench  # noqa: E402  (the workload)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16384)
    args = p.parse_args()
    from grpo_trainer import batch as batching
    from grpo_trainer.algorithms import compute_advantages
    w = {"prompts": 32, "n": 8, "prompt_len": 256, "response_len": 512}
    samples = h200_bench.synthetic_samples(w, vocab=151936)
    cpu = torch.device("cpu")
    for shared in (False, True):
        best = None
        for _ in range(args.reps):
            t0 = time.perf_counter()
            groups = batching.micro_batches(list(range(len(samples))), samples, max_count=len(samples),
                                            max_tokens=args.max_tokens, packed=True, share_prompts=shared)
            mbs = [batching.collate(g, samples, None, 0, cpu, pack=True, share_prompts=shared) for g in groups]
            t1 = time.perf_counter()
            rewards, mask = batching.token_rewards(samples)
            adv, _ = compute_advantages("grpo", rewards, mask, [s.uid for s in samples], norm_adv_by_std=True,
                                        gamma=1.0)
            batching.set_response_values(mbs, samples, "advantages", adv)
            t2 = time.perf_counter()
            best = min(best or (9e9, 9e9), (t1 - t0, t2 - t1))
        print(f"{'shared prompts' if shared else 'packed rows'}: {len(mbs)} micro-batches, collate {best[0]:.3f} s, "
              f"rewards + advantages {best[1]:.3f} s (best of {args.reps})")


if __name__ == "__main__":
    main()
