"""Issue 35 item 1, `grpo rollouts export RUN`, on a real run: torchrun (2 ranks, gloo), 2 `grpo
rollout` servers, file:// storage, the tiny model; then the same run's files in a real S3 server.

- one row per sample of the accepted shards only (those the step's accepted.json names; in a run
  written before it, each shard's highest attempt: a late orphaned attempt is left out), with the
  ids and rewards the shards hold and the text the tokenizer decodes from the ids;
- the filters select what a hand filter of the full export selects;
- parquet and JSONL both load (pyarrow and json; Hugging Face `datasets` too where installed);
- a step still in progress (not trained, a half-written shard) is skipped without error;
- a bad RUN is one `error:` line and exit 2.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from integration_helpers import child_env, grpo_cli, run_root, run_trainer, start_rollout_servers, write_job

pytestmark = pytest.mark.integration

STEPS, BATCH, N = 3, 4, 4


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model, quickstart_data, dense_reward) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    token = secrets.token_hex(16)
    job = write_job(tmp / "export.yaml", name="export", model=tiny_model, train=quickstart_data[0],
                    storage=tmp / "store", reward={"function": dense_reward},
                    trainer={"totalSteps": STEPS, "saveFreq": 2})
    servers = start_rollout_servers(job, token, 2, tmp, ready=False)
    try:
        result = run_trainer(job, rollout=",".join(s.address for s in servers), token=token)
        assert result.returncode == 0, result.output[-8000:]
    finally:
        for s in servers:
            s.stop()
    return run_root(tmp / "store", "export")


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """A copy of the run to plant files in."""
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*grpo_cli(), "rollouts", "export", *map(str, args)], capture_output=True, text=True,
                          env=child_env(), timeout=300)


def exported(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    return pq.read_table(path).to_pylist()


def shard_rows(run: Path) -> list[dict]:
    """Every row of the accepted shards, read by hand: one attempt per shard in a finished run."""
    rows = []
    for step in range(1, STEPS + 1):
        for f in sorted((run / "rollouts" / f"step-{step}").glob("train-*.parquet")):
            rows += [{**r, "step": step} for r in pq.read_table(f).to_pylist()]
    return rows


def key(row: dict) -> tuple:
    return row["step"], row["prompt_index"], row["sample_index"]


def orphan_of(shard: Path, attempt: int) -> None:
    """A failed attempt's late write beside `shard`: its rows, rewards 99."""
    table = pq.read_table(shard)
    table = table.set_column(table.schema.get_field_index("reward"), "reward",
                             pa.array([99.0] * table.num_rows, pa.float32()))
    name = re.sub(r"-attempt-\d+\.parquet$", f"-attempt-{attempt}.parquet", shard.name)
    pq.write_table(table, shard.with_name(name))


def test_export_is_every_accepted_sample_with_its_decoded_text(run, tiny_model, tmp_path):
    from transformers import AutoTokenizer
    truth = {key(r): r for r in shard_rows(run)}
    # Step 3: the trainer recorded the shards it read (accepted.json); a higher attempt beside
    # them is a killed trainer's, from before a restart counted attempts from 1 again.
    record = json.loads((run / "rollouts" / "step-3" / "accepted.json").read_text())
    assert len(record["shards"]) == 2 and record["world_size"] == 2 and record["keep"] is None, record
    orphan_of(run / "rollouts" / "step-3" / record["shards"][0], attempt=5)
    # Step 2 as a run written before that record: the highest attempt is the accepted one, so the
    # trainer read the retry (attempt 2), and attempt 1 is a late write of the failed one.
    step2 = run / "rollouts" / "step-2"
    (step2 / "accepted.json").unlink()
    accepted = sorted(step2.glob("train-*-attempt-1.parquet"))[0]
    retry = accepted.with_name(accepted.name.replace("-attempt-1", "-attempt-2"))
    accepted.rename(retry)
    orphan_of(retry, attempt=1)

    out = tmp_path / "all.parquet"
    res = export(run, "-o", out)
    assert res.returncode == 0, res.stderr
    rows = exported(out)
    assert len(rows) == STEPS * BATCH * N == len(truth)
    assert 99.0 not in {r["reward"] for r in rows}
    tok = AutoTokenizer.from_pretrained(tiny_model)     # the run's model, found from its checkpoint
    for r in rows:
        t = truth[key(r)]
        assert (r["uid"], r["prompt_ids"], r["response_ids"], r["reward"], r["policy_version"], r["finish_reason"],
                r["data_source"]) == (t["uid"], t["prompt_ids"], t["response_ids"], t["reward"], t["policy_version"],
                                      t["finish_reason"], t["data_source"])
        assert r["response_length"] == len(t["response_ids"]) and r["prompt_length"] == len(t["prompt_ids"])
        assert r["prompt_text"] == tok.decode(t["prompt_ids"])
        assert r["response_text"] == tok.decode(t["response_ids"])
    assert len({key(r) for r in rows}) == len(rows)

    jsonl = tmp_path / "all.jsonl"
    res = export(run, "-o", jsonl)
    assert res.returncode == 0, res.stderr
    as_json = exported(jsonl)
    assert [key(r) for r in as_json] == [key(r) for r in rows]
    assert [r["response_text"] for r in as_json] == [r["response_text"] for r in rows]
    assert [r["reward"] for r in as_json] == pytest.approx([r["reward"] for r in rows])
    try:
        import datasets
    except ImportError:         # not a dependency; pyarrow and json read the files above
        return
    for fmt, path in (("parquet", out), ("json", jsonl)):
        loaded = datasets.load_dataset(fmt, data_files=str(path), split="train",
                                       cache_dir=str(tmp_path / "hf-cache"))
        assert loaded.num_rows == len(rows)
        assert loaded["response_ids"] == [r["response_ids"] for r in rows]
        assert loaded["response_text"] == [r["response_text"] for r in rows]


def test_filters_select_what_a_hand_filter_selects(finished_run, tmp_path):
    full = tmp_path / "full.jsonl"
    assert export(finished_run, "-o", full, "--no-text").returncode == 0
    rows = exported(full)
    assert "response_text" not in rows[0]
    rewards = sorted(r["reward"] for r in rows)
    lo, hi = rewards[len(rewards) // 4], rewards[3 * len(rewards) // 4]
    lengths = sorted(r["response_length"] for r in rows)
    min_len = lengths[len(lengths) // 2]
    source = rows[0]["data_source"]
    cases = [
        (["--steps", "2:3"], lambda r: 2 <= r["step"] <= 3),
        (["--steps", "2"], lambda r: r["step"] == 2),
        (["--min-reward", lo, "--max-reward", hi], lambda r: lo <= r["reward"] <= hi),
        (["--data-source", source], lambda r: r["data_source"] == source),
        (["--data-source", "no-such-source"], lambda r: False),
        (["--min-length", min_len, "--max-length", 5, "--steps", "1:"],
         lambda r: min_len <= r["response_length"] <= 5),
    ]
    for args, wanted in cases:
        out = tmp_path / "filtered.jsonl"
        res = export(finished_run, "-o", out, "--no-text", *args)
        assert res.returncode == 0, (args, res.stderr)
        assert [key(r) for r in exported(out)] == [key(r) for r in rows if wanted(r)], args


def test_a_step_in_progress_is_skipped(run, tmp_path):
    # Step 4 of a running job: generated, not trained yet; one shard half-written, one being written.
    step4 = run / "rollouts" / f"step-{STEPS + 1}"
    step4.mkdir()
    (step4 / "train-shard-000-attempt-1.parquet").write_bytes(b"PAR1 half a file")
    (step4 / ".tmp-train-shard-001-attempt-1.parquet.1234").write_bytes(b"PAR1")
    (run / "rollouts" / "step-2" / ".tmp-train-shard-000-attempt-2.parquet.99").write_bytes(b"PAR1")
    out = tmp_path / "running.parquet"
    res = export(run, "-o", out, "--no-text")
    assert res.returncode == 0, res.stderr
    assert f"steps {STEPS + 1} not trained yet, skipped" in res.stdout
    assert len(exported(out)) == STEPS * BATCH * N


def test_a_bad_run_is_one_error_line(tmp_path, finished_run):
    for run, says in [(tmp_path / "nowhere", "not a run"), ("ftp://host/run", "unsupported URI")]:
        res = export(run, "-o", tmp_path / "x.parquet", "--no-text")
        assert res.returncode == BAD_INPUT_EXIT_CODE, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], res.stderr
        assert not (tmp_path / "x.parquet").exists()
    res = export(finished_run, "--steps", "3:1", "-o", tmp_path / "x.parquet")
    assert res.returncode == BAD_INPUT_EXIT_CODE and res.stderr.startswith("error: --steps"), res.stderr
    res = export(finished_run, "--tokenizer", tmp_path / "no-tokenizer", "-o", tmp_path / "x.parquet")
    assert res.returncode == BAD_INPUT_EXIT_CODE and res.stderr.startswith("error: can't load a tokenizer"), res.stderr
    assert not (tmp_path / "x.parquet").exists()


def test_the_tokenizer_comes_from_the_runs_job_file_else_is_asked_for(run, tiny_model, tmp_path):
    shutil.rmtree(run / "checkpoints")
    out = tmp_path / "x.jsonl"
    res = export(run, "-o", out, "--steps", "1")
    assert res.returncode == BAD_INPUT_EXIT_CODE and "records no model" in res.stderr and "--tokenizer" in res.stderr, res.stderr
    assert not out.exists()
    # `grpo run` keeps the resolved job in <run>/job.yaml.
    (run / "job.yaml").write_text(json.dumps({"spec": {"model": {"path": str(tiny_model)}}}))
    res = export(run, "-o", out, "--steps", "1")
    assert res.returncode == 0, res.stderr
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = exported(out)
    assert len(rows) == BATCH * N and all(r["response_text"] == tok.decode(r["response_ids"]) for r in rows)
    res = export(run, "-o", out, "--steps", "1", "--tokenizer", tiny_model)
    assert res.returncode == 0 and [r["prompt_text"] for r in exported(out)] == [r["prompt_text"] for r in rows]


def test_export_from_s3(finished_run, s3_server, tmp_path):
    fs = s3_server.filesystem()
    prefix = f"{s3_server.bucket}/ns/export/uid-1"
    for f in finished_run.rglob("*"):
        rel = f.relative_to(finished_run)
        if f.is_file() and rel.parts[0] in ("rollouts", "progress.json", "checkpoints"):
            with fs.open_output_stream(f"{prefix}/{rel}") as out:
                out.write(f.read_bytes())
    out = tmp_path / "s3.parquet"
    res = subprocess.run([*grpo_cli(), "rollouts", "export", f"s3://{prefix}", "--endpoint", s3_server.endpoint,
                          "-o", str(out)], capture_output=True, text=True, env=child_env(**s3_server.env()),
                         timeout=300)
    assert res.returncode == 0, res.stderr
    local = tmp_path / "local.parquet"
    assert export(finished_run, "-o", local).returncode == 0
    assert pq.read_table(out).drop(["shard"]).equals(pq.read_table(local).drop(["shard"]))
    res = subprocess.run([*grpo_cli(), "rollouts", "export", f"s3://{prefix}", "--endpoint", s3_server.endpoint,
                          "--no-text", "-o", str(out)], capture_output=True, text=True,
                         env={k: v for k, v in child_env().items() if not k.startswith("AWS_")}, timeout=300)
    assert res.returncode == BAD_INPUT_EXIT_CODE and res.stderr.count("\n") == 1 and "AWS_ACCESS_KEY_ID" in res.stderr, res.stderr
