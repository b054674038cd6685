"""Loading the model for training (grpo_trainer.model): only rank 0 reads the checkpoint, the
other ranks receive their shards from it. Real torchrun processes (2 ranks, gloo) and a model
big enough that its copies show in the process's peak host memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from integration_helpers import write_job

pytestmark = pytest.mark.integration

HIDDEN, LAYERS, VOCAB = 512, 12, 8192


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory) -> tuple[Path, int]:
    """A Qwen3-shaped model of ~44M parameters (176 MB in float32), saved in bfloat16 as real
    checkpoints are."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from grpo_rollout.tiny import build_tiny_model
    path = build_tiny_model(tmp_path_factory.mktemp("medium") / "model", seed=0)
    tiny = Qwen3Config.from_pretrained(path)
    config = Qwen3Config(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=VOCAB,
                         tie_word_embeddings=True, pad_token_id=tiny.pad_token_id, eos_token_id=tiny.eos_token_id,
                         bos_token_id=tiny.bos_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def test_only_rank_0_reads_the_checkpoint_and_the_models_compute_what_it_holds(medium_model, tmp_path):
    from transformers import AutoModelForCausalLM
    path, params = medium_model
    job = write_job(tmp_path / "job.yaml", name="loading", model=path, train=tmp_path / "unused.parquet",
                    storage=tmp_path / "run")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(Path(__file__).with_name("model_loading_rank.py")), str(job), str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = {r["rank"]: r for r in (json.loads(f.read_text()) for f in tmp_path.glob("rank-*.json"))}
    assert sorted(ranks) == [0, 1]

    full_fp32 = 4 * params
    # Rank 1 never holds the whole model: its float32 half plus one tensor in flight. Before,
    # every rank loaded the whole model in float32 (>= 1.0 x full_fp32).
    assert ranks[1]["policy_load_bytes"] < 0.75 * full_fp32, (ranks[1]["policy_load_bytes"], full_fp32)
    # Rank 0 reads the checkpoint in its own dtype (bfloat16: half of float32) beside its shard.
    assert ranks[0]["policy_load_bytes"] < 1.25 * full_fp32, (ranks[0]["policy_load_bytes"], full_fp32)

    # Gathering the weights for the rollout servers (issue 23): rank 0 writes them into its one
    # cache buffer, which fills once (the first gather: one copy of the weights) and is then
    # rewritten in place; a gather holds one full tensor in flight beside it. Before, the cache
    # and the next gather were two full copies (>= 2 x weights at the peak).
    r0 = ranks[0]
    first, second = r0["gather_peak_bytes"]
    in_flight = 2 * r0["largest_tensor_bytes"] + (16 << 20)
    assert first < r0["weights_bytes"] + in_flight, r0
    assert second < in_flight < 0.5 * r0["weights_bytes"], r0
    # rank 1 only sends its shards: no cache
    assert max(ranks[1]["gather_peak_bytes"]) < in_flight, ranks[1]

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(input_ids=torch.arange(1, 17).reshape(2, 8)).logits.flatten()[:64]
    for r in ranks.values():
        assert r["tied"] and r["dtypes"] == ["torch.float32"]
        torch.testing.assert_close(torch.tensor(r["logits"]), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(r["ref_logits"]), expected, rtol=1e-4, atol=1e-4)
