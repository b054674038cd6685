"""Bad input (issue 12): each refused with a message naming what is wrong, and nothing created,
written or lost. Through the commands a user runs: `grpo validate`, `grpo run`, and the trainer
as the launcher and the operator start it (`grpo trainer` under torchrun). The same invalid
specs at `kubectl apply` are in test_bad_input_crd.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from integration_helpers import child_env, grpo_cli, run_root, trainer_argv, write_job
from unit.test_spec import INVALID_SPECS, job_with

pytestmark = [pytest.mark.faults]


def _grpo(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*grpo_cli(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=child_env(GRPO_CACHE=str(cwd / ".cache")))


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


# --- the job file ----------------------------------------------------------------------------------

POD_TEMPLATE_ERRORS = {     # what the spec accepts and the operator refuses (issue 36)
    "reserved-env": {"trainer.template": {"spec": {"containers": [{"env": [{"name": "GRPO_RPC_TOKEN", "value": "x"}]}]}}},
    "operator-mount": {"rollout.template": {"spec": {"containers": [
        {"volumeMounts": [{"name": "data", "mountPath": "/etc/grpo"}]}]}}},
    "host-network": {"trainer.template": {"spec": {"hostNetwork": True}}},
}


@pytest.mark.parametrize("case", list(POD_TEMPLATE_ERRORS))
def test_grpo_validate_refuses_the_pod_templates_the_operator_refuses(case, tmp_path):
    """The same check in both places: `spec.trainer` is immutable, so a template error found only
    after `kubectl apply` means deleting and re-creating the job."""
    from grpo_operator.settings import OperatorSettings
    from grpo_operator.validation import parse_grpojob
    doc = {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "tpl"},
           **job_with(**{"storage.uri": "s3://b/runs", **POD_TEMPLATE_ERRORS[case]})}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = _grpo("validate", str(path), cwd=tmp_path)
    assert out.returncode == 1, out.stdout
    said = [ln.removeprefix("  - ") for ln in out.stderr.splitlines() if ln.startswith("  - ")]
    obj = {**doc, "metadata": {"name": "tpl", "namespace": "default", "uid": "u-1"}}
    _, operator_says = parse_grpojob(obj, OperatorSettings())
    assert said == operator_says and said and said[0].startswith("spec."), (said, operator_says)


def test_malformed_yaml_is_refused_with_its_line_and_nothing_is_created(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("spec:\n  model: {path: x\n  data: 3\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    validate = _grpo("validate", str(bad), cwd=cwd)
    assert validate.returncode == 1 and f"{bad}: invalid GRPOJob" in validate.stderr
    assert "malformed YAML at line 3" in validate.stderr, validate.stderr
    run = _grpo("run", str(bad), cwd=cwd)
    assert run.returncode == BAD_INPUT_EXIT_CODE and "malformed YAML at line 3" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert _tree(cwd) == []


def test_every_invalid_spec_is_refused_by_grpo_validate_naming_the_field(tmp_path):
    """tests/unit/test_spec.py's table of invalid specs, through the CLI, all in one call: every
    file is reported, each with the field path and the reason."""
    assert len(INVALID_SPECS) >= 30
    files = []
    for k, (changes, _, _) in enumerate(INVALID_SPECS):
        doc = {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": f"bad-{k:02d}"},
               **job_with(**changes)}
        files.append(tmp_path / f"bad-{k:02d}.yaml")
        files[-1].write_text(yaml.safe_dump(doc))
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob",
                                    "metadata": {"name": "good"}, **job_with()}))
    out = _grpo("validate", *map(str, files), str(good), cwd=tmp_path)
    assert out.returncode == 1
    assert f"{good}: ok" in out.stdout
    # stderr: "<file>: invalid GRPOJob" then one "  - <field>: <reason>" line per problem
    blocks = dict(re.findall(r"^(\S+\.yaml): invalid GRPOJob\n((?:  - .*\n?)+)", out.stderr, flags=re.M))
    assert set(blocks) == set(map(str, files)), out.stderr[-3000:]
    for path, (changes, field, reason) in zip(files, INVALID_SPECS):
        lines = blocks[str(path)].splitlines()
        assert any(ln.startswith(f"  - {field}:") and reason in ln for ln in lines), (changes, lines)
    # and `grpo run` refuses one the same way, before creating anything
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run = _grpo("run", str(files[0]), cwd=cwd)
    assert run.returncode == BAD_INPUT_EXIT_CODE and INVALID_SPECS[0][1] in run.stderr, run.stderr
    assert _tree(cwd) == []


# --- what the trainer finds when it starts -------------------------------------------------------------

def _read_only_prefix(folder: Path) -> list[str]:
    """An argv prefix under which `folder` is read-only: chmod for a normal user; for root (who
    writes anyway) a read-only bind mount in a private mount namespace of the command alone."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return []
    probe = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -o bind,ro "$0" "$0" && ! touch "$0/x"', str(folder)],
                           capture_output=True)
    if probe.returncode:
        pytest.skip(f"running as root without a way to make {folder} read-only: {probe.stderr[-300:]!r}")
    return ["unshare", "-m", "sh", "-c", 'mount -o bind,ro "$0" "$0" && exec "$@"', str(folder)]


def _parquet(table: pa.Table, path: Path) -> Path:
    pq.write_table(table, path)
    return path


def _break(case: str, tmp: Path, train: Path) -> tuple[dict, list[str]]:
    """The job sections that break it in this way (files made under `tmp`), and an argv prefix
    for the trainer."""
    table = pq.read_table(train)
    if case == "dataset-missing":
        return {"data": {"trainFiles": [str(tmp / "nope.parquet")]}}, []
    if case == "dataset-not-parquet":
        (tmp / "t.parquet").write_text("prompt,data_source\nhi,x\n")
        return {"data": {"trainFiles": [str(tmp / "t.parquet")]}}, []
    if case == "dataset-without-columns":
        return {"data": {"trainFiles": [str(_parquet(table.drop(["data_source"]), tmp / "t.parquet"))]}}, []
    if case == "dataset-empty":
        return {"data": {"trainFiles": [str(_parquet(table.slice(0, 0), tmp / "t.parquet"))]}}, []
    if case == "dataset-smaller-than-a-batch":
        return {"data": {"trainFiles": [str(_parquet(table.slice(0, 3), tmp / "t.parquet"))]}}, []
    if case == "validation-set-missing":
        return {"data": {"valFiles": [str(tmp / "val.parquet")]}}, []
    if case == "prompt-overlong-truncation-error":
        rows = table.slice(0, 8).to_pylist()
        rows[5]["prompt"] = [{"role": "user", "content": " ".join(["copy the digit"] * 20)}]
        bad = _parquet(pa.Table.from_pylist(rows, schema=table.schema), tmp / "t.parquet")
        return {"data": {"trainFiles": [str(bad)], "truncation": "error", "filterOverlongPrompts": False}}, []
    if case == "model-path-missing":
        return {"model": {"path": str(tmp / "no-model")}}, []
    if case == "lora-target-modules-name-no-layer":
        return {"model": {"lora": {"rank": 8, "targetModules": ["q_proj", "qkv_proj"]}}}, []
    if case == "lora-adapter-path-not-an-adapter":
        (tmp / "adapter").mkdir()
        return {"model": {"lora": {"adapterPath": str(tmp / "adapter")}}}, []
    if case == "resume-from-an-incomplete-checkpoint":
        (tmp / "runs" / "default" / "bad" / "checkpoints" / "step-3").mkdir(parents=True)   # DCP files, no manifest
        return {"storage": {"uri": f"file://{tmp}/runs"},
                "resume": f"file://{tmp}/runs/default/bad/checkpoints/step-3"}, []
    if case == "resume-from-outside-the-job":
        (tmp / "elsewhere" / "step-3").mkdir(parents=True)
        (tmp / "elsewhere" / "step-3" / "manifest.json").write_text("{}")
        return {"storage": {"uri": f"file://{tmp}/runs"}, "resume": f"file://{tmp}/elsewhere/step-3"}, []
    if case == "storage-read-only":
        (tmp / "ro").mkdir()
        return {"storage": {"uri": f"file://{tmp}/ro/runs"}}, _read_only_prefix(tmp / "ro")
    if case == "storage-under-a-file":
        (tmp / "ro").write_text("a file in the way")
        return {"storage": {"uri": f"file://{tmp}/ro/runs"}}, []
    raise AssertionError(case)


# What the one error line starts with (`tmp` is where _break made its files).
MESSAGES = {
    "dataset-missing": "error: {tmp}/nope.parquet: dataset file not found",
    "dataset-not-parquet": "error: {tmp}/t.parquet: can't read as parquet",
    "dataset-without-columns": "error: {tmp}/t.parquet: missing column(s) data_source",
    "dataset-empty": "error: {tmp}/t.parquet: no usable prompts",
    "dataset-smaller-than-a-batch": "error: the training set has 3 prompts, fewer than data.trainBatchSize=4",
    "validation-set-missing": "error: {tmp}/val.parquet: dataset file not found",
    "prompt-overlong-truncation-error": "error: {tmp}/t.parquet: row 5 has a ",
    "model-path-missing": "error: spec.model.path: '{tmp}/no-model' does not exist",
    "lora-target-modules-name-no-layer": "error: spec.model.lora.targetModules: 'qkv_proj' names no linear layer of "
                                         "Qwen3ForCausalLM (its linear layers: down_proj, gate_proj, k_proj, lm_head, "
                                         "o_proj, q_proj, up_proj, v_proj; or all-linear)",
    "lora-adapter-path-not-an-adapter": "error: spec.model.lora.adapterPath: {tmp}/adapter/adapter_config.json not "
                                        "found (a PEFT adapter folder has adapter_config.json and "
                                        "adapter_model.safetensors)",
    "resume-from-an-incomplete-checkpoint":
        "error: spec.resume: file://{tmp}/runs/default/bad/checkpoints/step-3 is not a complete checkpoint "
        "(no manifest.json)",
    "resume-from-outside-the-job":
        "error: spec.resume: file://{tmp}/elsewhere/step-3 is not one of this job's checkpoints "
        "(file://{tmp}/runs/default/bad/checkpoints/step-N): a job resumes only from its own checkpoints",
    "storage-read-only": "error: spec.storage.uri: can't write the run's files under file://{tmp}/ro/runs/default/bad: "
                         "write file://{tmp}/ro/runs/default/bad/",
    "storage-under-a-file": "error: spec.storage.uri: can't write the run's files under file://{tmp}/ro/runs/default/bad",
}
CASES = list(MESSAGES)


@dataclass
class _Launch:
    work: Path                      # where _break made the case's files
    watched: dict[Path, list[str]]  # each folder the trainer must leave as it was, before the launch
    result: Future                  # the trainer's CompletedProcess


def _launch(case: str, tmp: Path, tiny_model: Path, train_data: Path, pool: ThreadPoolExecutor) -> _Launch:
    work = tmp / "in"
    work.mkdir()
    model = tmp / "model"
    shutil.copytree(tiny_model, model)
    sections, prefix = _break(case, work, train_data)
    # write_job takes model and storage as arguments and merges other sections: set these after
    replaced = {key: sections.pop(key) for key in ("model", "storage", "resume") if key in sections}
    storage = tmp / "store"
    job = write_job(tmp / "job.yaml", name="bad", model=model, train=train_data, storage=storage,
                    trainer={"nprocPerNode": 1}, **sections)
    doc = yaml.safe_load(job.read_text())
    for key, value in replaced.items():
        doc["spec"][key] = {**doc["spec"][key], **value} if isinstance(value, dict) else value
    job.write_text(yaml.safe_dump(doc))
    watched = {p: _tree(p) for p in (work, model, storage)}
    nproc = 2 if case == "dataset-empty" else 1            # one case with 2 ranks: rank 1 stops cleanly too
    argv = [*prefix, *trainer_argv(job, "127.0.0.1:9", nproc, (f"trainer.nprocPerNode={nproc}",))]
    # no rollout server at 127.0.0.1:9: the trainer must stop before it talks to one
    result = pool.submit(subprocess.run, argv, capture_output=True, text=True, timeout=600, cwd=tmp,
                         env=child_env(GRPO_RPC_TOKEN="t"))
    return _Launch(work, watched, result)


@pytest.fixture(scope="module")
def refusals(request, tmp_path_factory, tiny_model, train_data):
    """The selected cases' trainers, started up front three at a time: each launch is a torchrun
    and a worker that import torch (~6 s, mostly one core), so side by side they take half as
    long. Each case stays a test of its own, reading its launch's result."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.originalname == "test_the_trainer_refuses_bad_input_before_writing_anything"]
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {case: _launch(case, tmp_path_factory.mktemp(case), tiny_model, train_data, pool) for case in selected}


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES)
def test_the_trainer_refuses_bad_input_before_writing_anything(case, refusals):
    launch = refusals[case]
    proc = launch.result.result()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert re.search(r"exitcode\s*: 2 ", out), out[-4000:]        # the trainer's own code: a usage error
    expected = MESSAGES[case].format(tmp=launch.work)
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert errors and errors[0].startswith(expected), (expected, errors, out[-3000:])
    assert len(errors) == 1, errors                                 # said once, by rank 0
    assert not re.search(r"^\[rank\d+\]:", out, flags=re.M), out[-4000:]     # no rank's traceback
    assert "Connection closed by peer" not in out and "Step 1" not in out
    assert {p: _tree(p) for p in launch.watched} == launch.watched  # nothing written, nothing lost


@pytest.mark.integration
def test_in_a_pod_the_trainers_error_is_the_exit_code_and_termination_message(tmp_path, tiny_model, train_data):
    """Issue 36, bug 2: the trainer pod's command, `grpo trainer --torchrun ...` (torchrun in
    the launcher's process), exits with the worker's own code 2, where torchrun exits 1, so the
    trainer Job's pod failure policy can fail the job at once; the `error: ...` line is the
    termination message (the kubelet's /dev/termination-log, here GRPO_TERMINATION_LOG); and no
    torchrun report page ends the log."""
    model = tmp_path / "no-model"
    job = write_job(tmp_path / "job.yaml", name="bad", model=tiny_model, train=train_data, storage=tmp_path / "store",
                    trainer={"nprocPerNode": 1})
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["model"]["path"] = str(model)
    job.write_text(yaml.safe_dump(doc))
    termination_log = tmp_path / "termination-log"
    termination_log.touch()                               # the kubelet creates it, empty
    pod_argv = [*grpo_cli(), "trainer", "--torchrun", *trainer_argv(job, "127.0.0.1:9", 1)[3:]]
    proc = subprocess.run(pod_argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=child_env(GRPO_RPC_TOKEN="t", GRPO_TERMINATION_LOG=str(termination_log)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == BAD_INPUT_EXIT_CODE, out[-4000:]
    said = termination_log.read_text().strip()
    assert said.startswith(f"error: spec.model.path: '{model}' does not exist"), said
    assert "ChildFailedError" not in out and "Root Cause" not in out, out[-3000:]

    # A worker killed by a signal: 128+N, as a shell says it, and one line naming the signal.
    killed = subprocess.run([*grpo_cli(), "trainer", "--torchrun", "--standalone", "--nproc-per-node=1",
                             "--no-python", sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=child_env())
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert killed.stderr.strip().splitlines()[-1].endswith("was killed by signal 9 (SIGKILL)"), killed.stderr[-3000:]


# --- `grpo run`: what can be checked before anything starts ----------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"model": {"path": "/nonexistent/model"}}, "error: spec.model.path: '/nonexistent/model' does not exist "
                                                "(give a local model folder, or a Hugging Face model id such as "
                                                "Qwen/Qwen3-8B)"),
    ({"data": {"trainFiles": ["/nonexistent/train.parquet"]}},
     "error: spec.data.trainFiles[0]: /nonexistent/train.parquet not found"),
])
def test_grpo_run_checks_local_paths_before_starting_anything(tmp_path, tiny_model, train_data, change, message):
    change = dict(change)
    job = write_job(tmp_path / "job.yaml", name="bad", model=change.pop("model", {}).get("path", tiny_model),
                    train=train_data, storage=tmp_path / "store", **change)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = _grpo("run", str(job), cwd=cwd)
    assert out.returncode == BAD_INPUT_EXIT_CODE and out.stderr.strip().splitlines()[-1] == message, out.stderr[-3000:]
    assert _tree(cwd) == [] and not (tmp_path / "store").exists()


@pytest.mark.parametrize("case", ["null-prompt", "no-ground-truth"])
def test_grpo_run_refuses_a_bad_dataset_row_before_any_server_starts(tmp_path, tiny_model, train_data, case):
    """Issue 48: a bad row was a traceback from the trainer after the rollout servers had loaded the
    model; now one line naming the file, row and column, exit 2, no server started (no run folder,
    so no rollout log). The same check in the trainer: tests/unit/test_dataset_rows.py."""
    rows = pq.read_table(train_data).slice(0, 8).to_pylist()
    if case == "null-prompt":
        rows[6]["prompt"] = None
    else:
        for row in rows:
            row["reward_model"]["ground_truth"] = None
    bad = _parquet(pa.Table.from_pylist(rows, schema=pq.read_schema(train_data)), tmp_path / "bad.parquet")
    job = write_job(tmp_path / "job.yaml", name="bad-row", model=tiny_model, train=bad, storage=tmp_path / "store")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = _grpo("run", str(job), cwd=cwd)
    said = {"null-prompt": f"error: {bad}: row 6: prompt: null, not a list of chat messages {{role, content}} or a "
                           f"string",
            "no-ground-truth": f"error: {bad}: column reward_model: none of its 8 rows has a ground_truth, so every "
                               f"sample would score 0 under the reward.function auto rule for data_source "
                               f"'openai/gsm8k' (add the answers, or set spec.reward.function to a function that "
                               f"needs none)"}[case]
    assert out.returncode == BAD_INPUT_EXIT_CODE and out.stderr.strip().splitlines()[-1] == said, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Launching" not in out.stderr, out.stderr[-3000:]
    assert _tree(cwd) == [] and not (tmp_path / "store").exists()


@pytest.mark.integration
def test_grpo_run_names_a_rollout_server_that_cannot_start(tmp_path, tiny_model, train_data):
    job = write_job(tmp_path / "job.yaml", name="bad-reward", model=tiny_model, train=train_data,
                    storage=tmp_path / "store", reward={"function": f"{tmp_path}/missing.py:score"})
    out = _grpo("run", str(job), cwd=tmp_path, timeout=300)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and last.startswith("error: rollout-0 exited with 2: grpo rollout: "), out.stderr[-3000:]
    assert "missing.py" in last and "(full log: " in last
    assert "Traceback" not in out.stderr
    root = run_root(tmp_path / "store", "bad-reward")
    assert not (root / "prompts").exists() and not (root / "checkpoints").exists()


@pytest.mark.integration
def test_grpo_run_ends_with_the_trainers_own_error_and_exit_code(tmp_path, tiny_model, train_data):
    """Issue 48: under `grpo run` the trainer's one `error:` line is the last line and its code (2: bad
    input) the exit code; no torchrun report or launcher line follows it."""
    job = write_job(tmp_path / "job.yaml", name="bad-lora", model=tiny_model, train=train_data,
                    storage=tmp_path / "store", lora={"rank": 8, "targetModules": ["q_proj", "qkv_proj"]},
                    rollout={"replicas": 1})
    out = _grpo("run", str(job), cwd=tmp_path, timeout=300)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == BAD_INPUT_EXIT_CODE, out.stderr[-3000:]
    assert last.startswith("error: spec.model.lora.targetModules: 'qkv_proj' names no linear layer"), out.stderr[-3000:]
    for noise in ("ChildFailedError", "Traceback", "failed (exitcode", "exited with code"):
        assert noise not in out.stderr, out.stderr[-3000:]


def test_grpo_validate_names_a_missing_file(tmp_path):
    """`grpo validate` of a file that isn't there: the path and the reason."""
    out = subprocess.run([sys.executable, "-m", "grpo_api.cli", "validate", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"{tmp_path}/missing.yaml: invalid GRPOJob" in out.stderr
    assert "can't read file: No such file or directory" in out.stderr
