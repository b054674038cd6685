"""Session fixtures of the integration tests: assets built once in temp folders, never in the
user's cache (helpers in integration_helpers.py)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from integration_helpers import REWARD_SOURCE, run_root, run_trainer, start_rollout_servers, write_job


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random-init Qwen3 model and its tokenizer (what `grpo model tiny` writes)."""
    from grpo_rollout.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def quickstart_data(tmp_path_factory) -> tuple[Path, Path]:
    """(train, test) parquet of the quickstart task in verl's layout, small."""
    from grpo_rollout.quickstart_data import write_quickstart_dataset
    return write_quickstart_dataset(tmp_path_factory.mktemp("quickstart-data"), n_train=256, n_val=8, seed=0)


@pytest.fixture(scope="session")
def dense_reward(tmp_path_factory) -> str:
    """spec.reward.function for a reward with a learning signal on every step (file.py:function)."""
    path = tmp_path_factory.mktemp("reward") / "sevens.py"
    path.write_text(REWARD_SOURCE)
    return f"{path}:compute_score"


@pytest.fixture(scope="session")
def grpo_cache(tmp_path_factory) -> Path:
    """GRPO_CACHE for `grpo run`: the builtin:// model and data are built here on first use."""
    return tmp_path_factory.mktemp("grpo-cache")


@pytest.fixture
def token() -> str:
    """A fresh per-run RPC token (GRPO_RPC_TOKEN of the trainer and its rollout servers)."""
    return secrets.token_hex(16)


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory, tiny_model, dense_reward) -> Path:
    """A finished run, shared by test_replay.py and test_ui.py: torchrun (2 ranks, gloo), one `grpo
    rollout` server, file:// storage, the tiny model on 4 prompts (trainBatchSize 4: every step
    is a new epoch of the same prompts); 2 steps, then resumed to totalSteps 3 (so step 3's
    trainer has another spec than checkpoint step-2's), a checkpoint after every step, and
    storage.keepRolloutsSteps 1: step 1's rollouts are deleted after step 2, step 2's are kept
    (a resume from checkpoint 1, and replay of step 2, need them)."""
    import yaml

    from grpo_rollout.quickstart_data import write_quickstart_dataset
    tmp = tmp_path_factory.mktemp("replay")
    train, _ = write_quickstart_dataset(tmp / "data", n_train=4, n_val=1, seed=0)
    token = secrets.token_hex(16)
    job = write_job(tmp / "replay.yaml", name="replay", model=tiny_model, train=train,
                    storage=tmp / "store", reward={"function": dense_reward},
                    trainer={"totalSteps": 2, "saveFreq": 1, "keepCheckpoints": None})
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["storage"]["keepRolloutsSteps"] = 1
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    servers = start_rollout_servers(job, token, 1, tmp, ready=False)
    try:
        rollout = servers[0].address
        result = run_trainer(job, rollout=rollout, token=token)
        assert result.returncode == 0, result.output[-8000:]
        result = run_trainer(job, rollout=rollout, token=token, overrides=("trainer.totalSteps=3",),
                             log_path=tmp / "resumed.log")
        assert result.returncode == 0 and "Resumed from" in result.output, result.output[-8000:]
    finally:
        for s in servers:
            s.stop()
    return run_root(tmp / "store", "replay")
