"""The GPU benchmarks at tiny sizes on CPU (`TINY=1 bash bench/h200_run.sh ...`): device time is
scarce (30 minutes a session), and a bench that broke since its last run wastes a call (one
crashed on a Trainer argument renamed under it). Each phase must finish and leave its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
# The phases that run on a CPU with the project's own dependencies (not trl or vllm; vllm-check
# drives a real `grpo rollout` server with the hf engine there).
PHASES = {"build": "build", "attention": "attention", "train": "train", "train-fused": "train", "train-skewed": "train", "gen": "gen",
          "hf-check": "hf_engine", "sync": "sync", "storage": "storage", "step": "step",
          "vllm-check": "vllm_weight_update"}


def test_bench_phases_run_at_tiny_sizes_and_record_their_results(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "TINY": "1", "OUT": str(out), "WORKDIR": str(work), "PY": sys.executable,
           "DEADLINE_S": "800", "HF_HUB_OFFLINE": "1",
           # The engine of before issue 14, a plain loop kept in bench/, as the reference engine.
           "BENCH_ARGS_hf_check": f"--previous {REPO / 'bench' / 'hf_engine_baseline.py'}",
           "BENCH_ARGS_vllm_check": "--engine hf"}
    done = subprocess.run(["bash", "bench/h200_run.sh", *PHASES], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=840)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    for phase in PHASES:
        assert f"=== {phase} rc=0" in log, log[-4000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["bench"] for r in results} >= set(PHASES.values()), results
    # Issue 34's variants: both LM heads, both layouts, realistic lengths packed in fewer tokens.
    train = {(r["head"], r["layout"], r["lengths"]): r for r in results if r["bench"] == "train"}
    assert {("fused", "padded", "fixed"), ("logits", "padded", "fixed"), ("fused", "packed", "skewed")} <= set(train)
    skewed = train["fused", "packed", "skewed"]
    assert skewed["model_tokens"] == skewed["tokens"] < train["fused", "padded", "skewed"]["model_tokens"]
    # sharePrompts' attention in bf16 (CPU: sdpa per sample) against float32, forward and backward:
    # bf16 rounding, where a mask aligned to the first query reads ~1.
    attention = [r for r in results if r["bench"] == "attention"]
    assert {r["lengths"] for r in attention} == {"fixed", "skewed"}, attention
    for r in attention:
        assert max(r["out_rel"], r["dq_rel"], r["dk_rel"], r["dv_rel"]) < 2e-2 < 0.3 < r["control_out_rel"], r
    # On CPU in float32 the engine decodes greedily exactly as the plain reference loop does.
    (greedy,) = [r for r in results if r["bench"] == "hf_engine_greedy"]
    assert greedy["identical"] == greedy["rows"] > 0, greedy
    assert greedy["recompute_parity"]["current"]["max"] < 1e-4, greedy
