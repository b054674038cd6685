"""Session fixtures of the integration tests: assets built once in temp folders, never in the
user's cache (helpers in integration_helpers.py)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from integration_helpers import REWARD_SOURCE


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
