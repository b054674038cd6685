"""Fixtures for the rollout tests: a tiny random Qwen3 model built locally, GRPOJob files that
use it, and real `grpo rollout` server processes on loopback."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

import polling
from grpo_api.records import PROMPT_SCHEMA

READY_PREFIX = "GRPO_ROLLOUT_READY "  # grpo_rollout.serve.READY_PREFIX (not imported: it's the wire contract)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from grpo_rollout.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_model))


def write_job(path: Path, model: Path, **spec_overrides) -> Path:
    """A GRPOJob for the hf engine on CPU with the tiny model; overrides are merged into spec."""
    spec = {
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"trainFiles": ["file:///unused.parquet"], "trainBatchSize": 4, "maxResponseLength": 12},
        "rollout": {"engine": "hf", "n": 2, "seed": 7},
        "reward": {"function": "auto", "workers": 2, "timeoutSeconds": 5},
        "trainer": {"miniBatchSize": 4},
    }
    for key, value in spec_overrides.items():
        spec.setdefault(key, {}).update(value)
    doc = {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "rollout-test"}, "spec": spec}
    path.write_text(yaml.safe_dump(doc))
    return path


def chat_prompt(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def prompt_table(rows: list[dict]) -> pa.Table:
    """rows: prompt_ids, data_source, ground_truth, extra_info (dict); uid/prompt_index filled in."""
    cols = {name: [] for name in PROMPT_SCHEMA.names}
    for i, row in enumerate(rows):
        cols["uid"].append(row.get("uid", f"0-{i}"))
        cols["prompt_index"].append(i)
        cols["prompt_ids"].append(row["prompt_ids"])
        cols["data_source"].append(row.get("data_source", "openai/gsm8k"))
        cols["ground_truth"].append(row.get("ground_truth", "7"))
        cols["extra_info"].append(json.dumps(row.get("extra_info", {})))
        cols["raw_prompt"].append(row.get("raw_prompt"))
        cols["images"].append(row.get("images"))
    return pa.Table.from_pydict(cols, schema=PROMPT_SCHEMA)


class RolloutProcess:
    """`grpo rollout` as a child process, as the local launcher runs it."""

    def __init__(self, job_file: Path, log_path: Path, token: str, worker_id: str = "w0", timeout: float = 180.0,
                 env: dict[str, str] | None = None):
        self.token = token
        self.auth = token
        """What stub() calls with: the token, or a grpo_api.rpc.ClientAuth for a TLS server."""
        self.log_path = log_path
        env = {**os.environ, "GRPO_RPC_TOKEN": token, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_api.cli", "rollout", "--spec", str(job_file), "--port", "0",
             "--host", "127.0.0.1", "--metrics-port", "0", "--worker-id", worker_id, "--device", "cpu"],
            stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=job_file.parent)
        self.info = self._wait_ready(timeout)
        self.address = f"127.0.0.1:{self.info['port']}"
        self.metrics_url = f"http://127.0.0.1:{self.info['metrics_port']}"
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def _wait_ready(self, timeout: float) -> dict:
        found: dict = {}

        def read():
            for line in self.proc.stdout:
                text = line.decode(errors="replace")
                if text.startswith(READY_PREFIX):
                    found.update(json.loads(text[len(READY_PREFIX):]))
                    return
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            self.stop()
            raise RuntimeError(f"rollout server not ready (exit code {self.proc.returncode}): {self.log()}")
        return found

    def stub(self, token: str | None = None):
        from grpo_api.rpc import rollout_stub
        return rollout_stub(self.address, self.auth if token is None else token)

    def metric(self, name: str, **labels) -> float:
        """A sample's value from /metrics (0 when absent)."""
        import urllib.request
        text = urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=10).read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{"):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def token() -> str:
    return secrets.token_hex(16)


def start_server(tmp_path: Path, model: Path, token: str, worker_id: str = "w0", env: dict[str, str] | None = None,
                 **spec_overrides) -> RolloutProcess:
    """`env`: more environment for the server (e.g. its TLS certificate)."""
    job = write_job(tmp_path / f"{worker_id}-job.yaml", model, **spec_overrides)
    return RolloutProcess(job, tmp_path / f"{worker_id}.log", token, worker_id=worker_id, env=env)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    return polling.wait_until(predicate, timeout, interval, what)
