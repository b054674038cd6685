"""Issue 6, the trainer end to end on CPU with real processes: torchrun (2 ranks, gloo), real
`grpo rollout` servers over gRPC, file:// storage, the tiny Qwen3 model.

- a few steps: finite losses, weights that move, rollout workers that follow the trainer's
  policy version (Health/Info over gRPC, and the version recorded in every rollout row);
  micro-batches by a token budget on both ranks, the reference's log-probs on larger ones of
  their own (trainer.logProbMaxTokensPerGPU) that meet the policy's at step 1;
- resume: 4 steps straight == 2 steps, then a resumed run of 2 more (same prompts and samples
  per step, same final weights, bit for bit on CPU);
- a fresh trainer facing rollout servers at a later policy version (a restart before the first
  checkpoint) and a rollout server down for a few steps (faults): the run goes on;
- `data.truncation: error` stops before step 1 naming the file and row;
- trainer.saveBest on a real run: progress.json's bestStep, the best step's checkpoint kept, hf/best
  (which step is the best, rotation and hf/best's weights: tests/unit/test_save_best.py);
- algorithm.rolloutCorrection: the weights between the trainer's old policy and the engine's;
- the exported model, and `grpo export` of a checkpoint, load with from_pretrained and generate.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from integration_helpers import (RolloutServer, child_env, descendants, grpo_cli, load_safetensors, read_metrics,
                                 read_step_tables, run_root, run_trainer, start_rollout_servers, trainer_argv,
                                 wait_until, write_job)

pytestmark = pytest.mark.integration

STEPS = 3


# --- a 2-rank run with 2 rollout servers, the collective weight sync (gloo on CPU) -------------

@dataclass
class Run:
    root: Path                  # the run's files (metrics.jsonl, rollouts/, checkpoints/, hf/)
    servers: list               # the rollout servers, still up (at the final policy version)
    result: object              # the trainer's exit code and output


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, tiny_model, quickstart_data, dense_reward):
    tmp = tmp_path_factory.mktemp("two-rank")
    token = secrets.token_hex(16)
    job = write_job(tmp / "job.yaml", name="two-rank", model=tiny_model, train=quickstart_data[0],
                    storage=tmp / "store", reward={"function": dense_reward},
                    trainer={"totalSteps": STEPS, "saveFreq": 2,
                             "saveBest": {"metric": "critic/score/mean", "mode": "max"},
                             # micro-batches by tokens (the ranks' shares can make different numbers
                             # of them), the reference's forward on larger ones of its own
                             "maxTokensPerGPU": 38, "logProbMaxTokensPerGPU": 76},
                    weightSync={"backend": "nccl"})
    servers = start_rollout_servers(job, token, 2, tmp, ready=False)
    try:
        result = run_trainer(job, rollout=",".join(s.address for s in servers), token=token)
        assert result.returncode == 0, result.output[-8000:]
        yield Run(run_root(tmp / "store", "two-rank"), servers, result)
    finally:
        for s in servers:
            s.stop()


def test_losses_are_finite_and_every_step_ran(two_rank_run):
    rows = read_metrics(two_rank_run.root)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
    # the dense reward gives every step a learning signal: the policy gradient is never zero
    assert all(r["actor/grad_norm"] > 0 for r in rows), [r["actor/grad_norm"] for r in rows]
    assert all(r["perf/total_num_tokens"] > 0 and r["response_length/mean"] > 0 for r in rows)
    assert "world size 2" in two_rank_run.result.output
    # step 1's policy is the reference: their log-probs, from micro-batches of different sizes,
    # must meet at the same tokens (a misplaced one reads O(1))
    assert abs(rows[0]["actor/kl_loss"]) < 1e-6, rows[0]["actor/kl_loss"]


def test_weights_change(two_rank_run, tiny_model):
    import torch
    initial = load_safetensors(tiny_model)
    final = load_safetensors(two_rank_run.root / "hf" / f"step-{STEPS}")
    assert set(final) == set(initial)
    changed = [name for name in initial if not torch.equal(initial[name], final[name])]
    assert all(torch.isfinite(t).all() for t in final.values())
    # every trainable tensor gets a gradient (and AdamW's decay) except the embedding rows of
    # tokens never seen; the decoder layers' weights must all move
    layer_params = [n for n in initial if n.startswith("model.layers.")]
    assert set(layer_params) <= set(changed), sorted(set(layer_params) - set(changed))[:5]


def test_rollout_workers_follow_the_policy_version(two_rank_run):
    root = two_rank_run.root
    rows = read_metrics(root)
    assert [r["training/policy_version"] for r in rows] == list(range(1, STEPS + 1))
    # rollout.maxStaleness 0 (the default): each step generates on the latest weights, then
    # trains on policy: with one mini-batch the PPO ratio is exactly 1
    assert all(r["rollout/staleness"] == 0 and "timing_s/generate_overlapped" not in r for r in rows)
    assert all(r["actor/ppo_kl"] == 0 for r in rows), [r["actor/ppo_kl"] for r in rows]
    # the step's phases, each timed on its own (verl's names, and the micro-batches' collation),
    # add up to no more than the step
    phases = ("timing_s/rollout", "timing_s/collate", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
              "timing_s/update_actor", "timing_s/weight_sync")
    assert all(r["timing_s/collate"] > 0 and r["timing_s/adv"] > 0 for r in rows), rows[-1]
    assert all(sum(r.get(k, 0.0) for k in phases) <= r["timing_s/step"] for r in rows), rows[-1]
    for step in range(1, STEPS + 1):
        table = read_step_tables(root, "rollouts", step)
        # step N is generated by the policy after N-1 updates
        assert set(table.column("policy_version").to_pylist()) == {step - 1}, step
        # one shard per worker, 2 prompts x n=4 samples each, each accepted at its first attempt
        assert table.num_rows == 4 * 4
        shards = sorted(p.name for p in (root / "rollouts" / f"step-{step}").glob("train-*.parquet"))
        assert shards == ["train-shard-000-attempt-1.parquet", "train-shard-001-attempt-1.parquet"]
    # after the run both servers hold the final policy, as Health and Info report it
    for server in two_rank_run.servers:
        health = server.health()
        assert health.ready and health.policy_version == STEPS, health
        assert health.weight_sync_error == ""
        info = server.rpc_info()
        assert info.policy_version == STEPS and info.worker_id == server.worker_id and info.engine == "hf"
        # weightSync.backend nccl: the collective path (gloo between CPU processes)
        assert f"weights at version {STEPS} (collective" in server.log()
    progress = (root / "progress.json").read_text()
    assert f'"policyVersion": {STEPS}' in progress


def _generate(model_dir: Path) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "copy the digit 7 then answer #### and the digit"}],
                                  add_generation_prompt=True, tokenize=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def test_exported_model_loads_and_generates(two_rank_run):
    new_tokens = _generate(two_rank_run.root / "hf" / f"step-{STEPS}")
    assert 1 <= len(new_tokens) <= 4


def test_grpo_export_of_a_checkpoint(two_rank_run, tmp_path):
    import torch
    ckpt = two_rank_run.root / "checkpoints" / "step-2"
    assert (ckpt / "manifest.json").exists()
    out = tmp_path / "exported"
    proc = subprocess.run([*grpo_cli(), "export", str(ckpt), "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Exported step 2" in proc.stdout
    assert 1 <= len(_generate(out)) <= 4
    # the checkpoint's weights, not the final ones: step 3 updated them again
    at2, at3 = load_safetensors(out), load_safetensors(two_rank_run.root / "hf" / f"step-{STEPS}")
    assert any(not torch.equal(at2[k], at3[k]) for k in at3)


def test_a_fresh_trainer_brings_workers_ahead_of_it_back(two_rank_run, tmp_path, tiny_model, quickstart_data,
                                                         dense_reward):
    """A trainer that starts over (a pod restarted before its first checkpoint) while the rollout
    servers still hold a later policy: it must publish its weights as version 0, not fail."""
    servers = two_rank_run.servers
    assert all(s.health().policy_version == STEPS for s in servers)
    job = write_job(tmp_path / "job.yaml", name="restart", model=tiny_model, train=quickstart_data[0],
                    storage=tmp_path / "store", reward={"function": dense_reward}, trainer={"totalSteps": 1},
                    weightSync={"backend": "nccl"})
    result = run_trainer(job, rollout=",".join(s.address for s in servers), token=servers[0].token)
    assert result.returncode == 0, result.output[-8000:]
    table = read_step_tables(run_root(tmp_path / "store", "restart"), "rollouts", 1)
    assert set(table.column("policy_version").to_pylist()) == {0}
    assert "rollout shard" not in result.output               # no failed dispatch on the way
    assert all(s.health().policy_version == 1 for s in servers)


def test_grpo_export_refuses_an_incomplete_checkpoint(tmp_path):
    (tmp_path / "ckpt").mkdir()
    proc = subprocess.run([*grpo_cli(), "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "manifest.json" in proc.stderr


# --- a rollout server down through a dispatch and a weight update, then back ---------------------

@pytest.mark.faults
def test_a_worker_down_for_a_while_loses_its_shards_and_is_resynced(tmp_path, tiny_model, quickstart_data,
                                                                    dense_reward, token):
    """Server B is SIGKILLed mid-run and comes back (same port) some steps later: meanwhile its
    shards go to A and the weight updates miss it (the run goes on); once back it is brought to
    the current version and serves the last steps. Steps take ~0.1s here, so the trainer is
    paused (SIGSTOP of torchrun and its ranks) around each change to place it between steps."""
    steps = 10
    job = write_job(tmp_path / "job.yaml", name="worker-down", model=tiny_model, train=quickstart_data[0],
                    storage=tmp_path / "store", reward={"function": dense_reward}, trainer={"totalSteps": steps},
                    weightSync={"backend": "grpc"})
    root = run_root(tmp_path / "store", "worker-down")
    a, b = start_rollout_servers(job, token, 2, tmp_path)
    port_b = b.info["port"]
    log_path = tmp_path / "trainer.log"
    with open(log_path, "wb") as out:
        trainer = subprocess.Popen(trainer_argv(job, f"{a.address},{b.address}", 1), stdout=out,
                                   stderr=subprocess.STDOUT, env=child_env(GRPO_RPC_TOKEN=token), cwd=tmp_path,
                                   start_new_session=True)
    try:
        wait_until(lambda: _logged_steps(root) >= 1 or trainer.poll() is not None, 300, what="step 1")
        with _paused(trainer):
            killed_after = _logged_steps(root)
            b.proc.kill()
            b.stop()
        # with B down every step waits >= 0.5s before re-dispatching B's shard. Wait for what is
        # asserted below (the pause may land mid-step, so a count of steps is not enough).
        wait_until(lambda: (_redispatched(root) >= 2 and "did not reach every rollout worker" in
                            log_path.read_text(errors="replace")) or trainer.poll() is not None, 300,
                   what="B's shards re-dispatched twice and an update that missed B")
        with _paused(trainer):
            back_after = _logged_steps(root)
            b = RolloutServer(job, tmp_path / "rollout-1b.log", token, "rollout-1", port=port_b)
        code = trainer.wait(300)
        final = b.health()
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        a.stop()
        b.stop()
    out = log_path.read_text(errors="replace")
    assert code == 0, out[-8000:]
    assert back_after < steps, "the run ended before B was back: nothing left to test"
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["rollout/redispatched_shards"] >= 2, out[-8000:]
    assert "did not reach every rollout worker" in out          # updates while B was down
    # B back at the current version: by a re-sync before a Generate, or by the next update
    assert final.ready and final.policy_version == steps
    for step in range(1, steps + 1):
        table = read_step_tables(root, "rollouts", step)
        assert set(table.column("policy_version").to_pylist()) == {step - 1}, step
        assert table.num_rows == 4 * 4
    # a step while B was down: its shard was generated again elsewhere (a later attempt accepted)
    down = root / "rollouts" / f"step-{killed_after + 2}"
    assert any(not p.name.endswith("-attempt-1.parquet") for p in down.glob("*.parquet"))
    # the last step: both shards at their first attempt again (attempt 1 of shard k goes to
    # worker k: B generated shard 1, at the right version)
    last = sorted(p.name for p in (root / "rollouts" / f"step-{steps}").glob("*.parquet"))
    assert last == ["train-shard-000-attempt-1.parquet", "train-shard-001-attempt-1.parquet"]


@contextlib.contextmanager
def _paused(proc: subprocess.Popen):
    """SIGSTOP `proc` and its descendants (torchrun starts its ranks in their own process
    groups) for the duration."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _logged_steps(root: Path) -> int:
    return len(read_metrics(root)) if (root / "metrics.jsonl").exists() else 0


def _redispatched(root: Path) -> int:
    rows = read_metrics(root) if (root / "metrics.jsonl").exists() else []
    return rows[-1].get("rollout/redispatched_shards", 0) if rows else 0


# Resume (policy, optimizer, schedules, sampler, PPO's critic and KL controller, LoRA's adapters
# and RNG) is tested by one kill-and-resume run per algorithm family:
# tests/faults/test_fault_trainer.py::test_trainer_killed_mid_step_resumes_from_the_last_complete_checkpoint.

# --- trainer.saveBest on the two-rank run (its logic: tests/unit/test_save_best.py) -------------------

def test_the_best_steps_checkpoint_is_kept_and_exported_as_hf_best(two_rank_run):
    """Ranked by the step's mean reward (a metric every step has); the status reports the best step."""
    import torch
    root = two_rank_run.root
    rewards = [r["critic/score/mean"] for r in read_metrics(root)]
    best = 1 + rewards.index(max(rewards))             # the first step to reach the maximum
    progress = json.loads((root / "progress.json").read_text())
    assert (progress["bestStep"], progress["bestScore"]) == (best, pytest.approx(max(rewards)))
    assert progress["rewardErrorFraction"] == 0.0 and "toolErrorFraction" not in progress   # no failure, no tool
    # keepCheckpoints 2 (the default): the last two, and the best whatever its age
    kept = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert kept == sorted({f"step-{best}", "step-2", f"step-{STEPS}"}), (kept, rewards)
    hf_best, final = load_safetensors(root / "hf" / "best"), load_safetensors(root / "hf" / f"step-{STEPS}")
    assert hf_best.keys() == final.keys()
    # the final policy is the best's only if the last step is the best (every step moves the weights)
    assert all(torch.equal(hf_best[k], final[k]) for k in final) == (best == STEPS)


# --- one rollout server shared by the runs below (they change only what the trainer does) --------

@pytest.fixture(scope="module")
def one_server(tmp_path_factory, tiny_model, quickstart_data, dense_reward):
    """A rollout server for runs of the tiny model with the dense reward; each run's trainer
    brings it to its own policy first (a fresh trainer publishes version 0 to a server ahead)."""
    tmp = tmp_path_factory.mktemp("one-server")
    job = write_job(tmp / "server.yaml", name="server", model=tiny_model, train=quickstart_data[0],
                    storage=tmp / "store", reward={"function": dense_reward})
    (server,) = start_rollout_servers(job, secrets.token_hex(16), 1, tmp)
    yield server
    server.stop()


def _run_on(server, job: Path) -> None:
    """The job to the end on 2 ranks, against the shared rollout server."""
    result = run_trainer(job, rollout=server.address, token=server.token)
    assert result.returncode == 0, result.output[-8000:]


def test_val_only_validates_the_loaded_policy_and_exits_without_training(one_server, tmp_path, tiny_model,
                                                                        quickstart_data, dense_reward):
    """trainer.valOnly (verl: trainer.val_only): one validation over the whole val set, its score
    logged and in progress.json; no step, no checkpoint, no export."""
    job = write_job(tmp_path / "job.yaml", name="val-only", model=tiny_model, train=quickstart_data[0],
                    val=quickstart_data[1], storage=tmp_path / "store", reward={"function": dense_reward},
                    trainer={"valOnly": True, "saveFreq": 1})
    _run_on(one_server, job)
    root = run_root(tmp_path / "store", "val-only")
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == [0] and "val/score" in rows[0]
    assert rows[0]["val/reward_errors/exception"] == 0          # validation counts its reward failures too
    assert not any(k.startswith("actor/") for k in rows[0])
    assert read_step_tables(root, "rollouts", 0, prefix="val0").num_rows == 8     # the whole val set, once
    progress = json.loads((root / "progress.json").read_text())
    assert progress["step"] == 0 and progress["validationScore"] == pytest.approx(rows[0]["val/score"])
    assert not list((root / "checkpoints").glob("step-*")) and not (root / "hf").exists()


# --- algorithm.rolloutCorrection: TIS / MIS weights between the trainer's old policy and the engine's --

CORRECTION = {"rolloutIs": "token", "rolloutIsThreshold": 2.0, "rolloutRs": ["token_k1"], "rolloutRsThreshold": 1.5}


@pytest.mark.parametrize("staleness, correction", [(0, CORRECTION), (1, CORRECTION), (0, {"bypassMode": True})],
                         ids=["sync", "one-step-off", "bypass"])
def test_rollout_correction_weights_the_tokens_by_the_engines_mismatch(one_server, tmp_path, tiny_model,
                                                                        quickstart_data, dense_reward, staleness,
                                                                        correction):
    """On CPU the engine and the trainer compute in float32: synchronously their log-probs agree
    (weights 1, nothing rejected); one step off-policy the engine's policy is one update behind."""
    job = write_job(tmp_path / "job.yaml", name="corr", model=tiny_model, train=quickstart_data[0],
                    storage=tmp_path / "store", reward={"function": dense_reward},
                    algorithm={"rolloutCorrection": correction},
                    trainer={"totalSteps": 3, "miniBatchSize": 2, "microBatchSizePerGPU": 4},   # two updates a step
                    rollout={"maxStaleness": staleness})
    _run_on(one_server, job)
    rows = read_metrics(run_root(tmp_path / "store", "corr"))
    if "bypassMode" in correction:      # the engine's log-probs are the old policy: nothing recomputed
        assert all(r["timing_s/old_log_prob"] == 0 and "rollout_corr/rollout_is_mean" not in r for r in rows)
        return
    assert all(r["timing_s/old_log_prob"] > 0 for r in rows)
    if staleness == 0:
        for r in rows:
            assert r["rollout_corr/log_ratio_abs_mean"] < 1e-4, r
            assert r["rollout_corr/rollout_is_mean"] == pytest.approx(1, abs=1e-4)
            assert r["rollout_corr/rollout_rs_masked_fraction"] == 0
    else:
        moved = rows[1:]   # step 1 was generated by the very weights it trains
        assert all(r["rollout_corr/log_ratio_abs_mean"] > 1e-5 for r in moved), moved
        assert all(r["rollout_corr/rollout_is_max"] > r["rollout_corr/rollout_is_min"] for r in moved)
        assert all(r["rollout_corr/rollout_is_max"] <= 2.0 for r in rows)      # truncated


# --- data.truncation: error ------------------------------------------------------------------------

def test_truncation_error_names_file_and_row(tmp_path, tiny_model, quickstart_data):
    table = pq.read_table(quickstart_data[0]).slice(0, 8)
    rows = table.to_pylist()
    rows[5]["prompt"] = [{"role": "user", "content": " ".join(["copy the digit"] * 20)}]
    bad = tmp_path / "overlong.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), bad)
    job = write_job(tmp_path / "job.yaml", name="overlong", model=tiny_model, train=bad, storage=tmp_path / "store",
                    data={"truncation": "error", "filterOverlongPrompts": False, "maxPromptLength": 32})
    # no rollout server: the trainer must stop while loading the data, before talking to any
    result = run_trainer(job, rollout="127.0.0.1:9", token="t", timeout=300)
    assert result.returncode != 0
    assert str(bad) in result.output and "row 5" in result.output, result.output[-4000:]
    assert "maxPromptLength=32" in result.output
    assert "Step 1" not in result.output
    assert not (run_root(tmp_path / "store", "overlong") / "prompts").exists()


# --- the log-probs through the trainer's sharded models (logprobs_rank.py, one gloo rank) ------

def test_fused_lm_head_and_packed_rows_give_the_logits_paths_logprobs_and_gradients(tmp_path, tiny_model):
    """model.useFusedKernels (issue 34): the trainer's forward_logprobs on FSDP2-sharded models
    (gradient checkpointing on) equals the logits path to float32 rounding, and both equal a
    float64 copy: log-probs and entropies on the responses' tokens (padding, a tool turn), and
    every gradient of a loss with both, for tied and untied heads, LoRA, the reference; under
    bf16 mixed precision the fused head is as close to float64 as the logits path. And
    model.useRemovePadding: the samples packed in one row give the padded rows' numbers (the
    critic's values too), which positions that don't restart at each sample would not. And
    model.sharePrompts: each prompt once in the row with its responses after it (48 tokens, not
    66) gives the padded rows' numbers for the policy, the reference and the critic, and equals
    float64; positions that run on through the row instead of each response's after its prompt
    would not."""
    from grpo_rollout.tiny import build_tiny_model
    tied = build_tiny_model(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("logprobs_rank.py")), str(tied),
                          str(tiny_model)], capture_output=True, text=True, env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report.pop("tied/head-is-embedding") is True
    assert report.pop("untied/run-on-positions-differ") > 1e-3
    assert report.pop("shared/run-on-positions-differ") > 1e-3
    assert report.pop("shared/row-tokens") == [7 + 4 + 9 + 5 + 12 + 3 + 8, 3 * 7 + 2 * 4 + 9 + 5 + 12 + 3 + 8]
    bf16 = {k: report.pop(k) for k in list(report) if k.startswith("bf16/")}
    for check, diffs in report.items():
        assert max(diffs.values()) < 1e-5, (check, diffs)
    for key in ("logp", "entropy", "grads"):
        assert bf16["bf16/fused-vs-float64"][key] < 1.5 * bf16["bf16/logits-vs-float64"][key] + 1e-3, bf16
