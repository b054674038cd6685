"""Multi-turn, tool-using GRPO end to end (issue 32): real `grpo rollout` servers running the
agent loop (hf engine), the torchrun trainer masking the tool tokens, on the lookup task
(grpo_rollout.tool_task): the digit to answer is only in the `lookup` tool's answer, and a guess
without looking it up scores 0.

- the reward rises beyond an lr ~0 control: the tiny random-init model learns to call the tool
  and copy its answer;
- the rollout records hold whole trajectories: model tokens (mask 1, behaviour log-probs) and
  the tool turn's tokens (mask 0), the turns and the calls;
- a tool that raises or hangs answers with an error, the run goes on, and the errors are in
  the records.
"""

from __future__ import annotations

import json
import secrets
import statistics

import pytest

from integration_helpers import read_metrics, read_step_tables, run_root, run_trainer, start_rollout_servers, write_job

pytestmark = pytest.mark.integration

LEARN_STEPS = 30
K = 8                      # steps averaged at each end
CONTROL_STEPS = K
CONTROL_LR = 1e-12


@pytest.fixture(scope="module")
def lookup_task(tmp_path_factory):
    from grpo_rollout import tool_task
    tmp = tmp_path_factory.mktemp("lookup")
    model = tool_task.build_model(tmp / "model")
    train, _ = tool_task.write_dataset(tmp / "data")
    return model, train


def lookup_job(tmp, name, model, train, *, lr, steps, tools=("grpo_rollout.tool_task:lookup",), timeout=30.0):
    return write_job(
        tmp / f"{name}.yaml", name=name, model=model, train=train, storage=tmp / "store",
        data={"trainBatchSize": 64, "maxPromptLength": 24, "maxResponseLength": 14},
        algorithm={"useKLLoss": False},
        reward={"function": "grpo_rollout.tool_task:compute_score"},
        # calculateLogProbs: the records keep the behaviour log-probs (test_records_hold_the_whole_trajectory...)
        rollout={"n": 8, "replicas": 1, "calculateLogProbs": True,
                 "multiTurn": {"enable": True, "tools": list(tools), "maxAssistantTurns": 3,
                               "toolTimeoutSeconds": timeout}},
        trainer={"nprocPerNode": 1, "miniBatchSize": 64, "microBatchSizePerGPU": 256, "lr": lr, "totalSteps": steps})


def run_job(job, tmp, name):
    token = secrets.token_hex(16)
    [server] = start_rollout_servers(job, token, 1, tmp, ready=False)
    try:
        result = run_trainer(job, rollout=server.address, token=token, nproc=1, timeout=1500)
        assert result.returncode == 0, result.output[-8000:]
    finally:
        server.stop()
    return run_root(tmp / "store", name)


@pytest.fixture(scope="module")
def runs(lookup_task, tmp_path_factory):
    model, train = lookup_task
    tmp = tmp_path_factory.mktemp("lookup-runs")
    learn = run_job(lookup_job(tmp, "learn", model, train, lr=2e-3, steps=LEARN_STEPS), tmp, "learn")
    control = run_job(lookup_job(tmp, "control", model, train, lr=CONTROL_LR, steps=CONTROL_STEPS), tmp, "control")
    return learn, control


def rewards(root):
    return [r["critic/score/mean"] for r in read_metrics(root)]


def test_the_model_learns_to_look_the_answer_up(runs):
    learn, control = runs
    learned, frozen = rewards(learn), rewards(control)
    assert len(learned) == LEARN_STEPS and len(frozen) == CONTROL_STEPS
    first, last, ctrl = statistics.fmean(learned[:K]), statistics.fmean(learned[-K:]), statistics.fmean(frozen)
    detail = f"learning run {first:.3f} -> {last:.3f}; control (lr={CONTROL_LR}) {ctrl:.3f}"
    print(detail)
    # Measured (bench-like run of this task, 30 steps): 0.002 -> ~0.07, the control ~0.005.
    assert last > ctrl + 0.03 and last > 3 * ctrl + 0.01, detail

    # It scores by calling the tool: the calls grow (measured: 30% of the samples at step 1,
    # 95% at step 30), the control's stay where they started.
    def call_rate(root, step):
        rows = read_step_tables(root, "rollouts", step).to_pylist()
        return sum(bool(json.loads(r["agent"])["tool_calls"]) for r in rows) / len(rows)
    start, end = call_rate(learn, 1), call_rate(learn, LEARN_STEPS)
    ctrl_start, ctrl_end = call_rate(control, 1), call_rate(control, CONTROL_STEPS)
    assert end > start + 0.3, (start, end)
    assert abs(ctrl_end - ctrl_start) < 0.15, (ctrl_start, ctrl_end)


def test_records_hold_the_whole_trajectory_and_its_mask(runs):
    learn, _ = runs
    rows = read_step_tables(learn, "rollouts", LEARN_STEPS).to_pylist()
    called = [r for r in rows if 0 in r["response_mask"]]
    assert called
    for r in rows:
        agent = json.loads(r["agent"])
        assert len(r["response_mask"]) == len(r["response_ids"]) == len(r["response_logprobs"])
        mask = r["response_mask"]
        tool_turns = sum(1 for i, m in enumerate(mask) if m == 0 and (i == 0 or mask[i - 1] == 1))
        assert r["num_turns"] == agent["assistant_turns"] + tool_turns
        tool_positions = [i for i, m in enumerate(mask) if m == 0]
        assert all(r["response_logprobs"][i] == 0.0 for i in tool_positions)
        assert all(r["response_logprobs"][i] <= 0.0 for i, m in enumerate(mask) if m == 1)
        if tool_positions:
            assert r["response_mask"][-1] == 1       # a trajectory ends on the model's tokens
    step = read_metrics(learn)[-1]
    assert step["num_turns/max"] == 3 and 1 < step["num_turns/mean"] <= 3
    # up to 2 calls: the second one runs, but its answer may not fit maxResponseLength
    assert 0 < step["tool_calls/mean"] <= 2 and step["tool_calls/errors"] == 0


def test_failing_tools_do_not_stop_the_run(lookup_task, tmp_path):
    """A `lookup` that raises (odd digits) or never answers (even digits; timeout 1 s), in one run:
    every step completes, each call carries its own error, and the reward is 0 for them (the
    lookup never succeeded)."""
    model, train = lookup_task
    path = tmp_path / "broken_tools.py"
    path.write_text("import time\n\n\ndef lookup(*, digit: str) -> str:\n    \"\"\"Broken.\"\"\"\n"
                    "    if int(digit) % 2:\n        raise RuntimeError('down')\n    time.sleep(60)\n    return ''\n")
    job = lookup_job(tmp_path, "broken", model, train, lr=2e-3, steps=2, tools=(f"{path}:lookup",), timeout=1.0)
    root = run_job(job, tmp_path, "broken")
    assert [r["step"] for r in read_metrics(root)] == [1, 2]
    rows = read_step_tables(root, "rollouts", 1).to_pylist()
    # the tool's digit is the row's (its tools_kwargs), which is also the row's ground truth
    calls = [(c, "crash" if int(r["ground_truth"]) % 2 else "timeout")
             for r in rows for c in json.loads(r["agent"])["tool_calls"]]
    assert {"crash", "timeout"} <= {want for _, want in calls}, calls
    assert [c["error"] for c, _ in calls] == [want for _, want in calls]
    calls = [c for c, _ in calls]
    assert all(r["reward"] == 0.0 for r in rows if json.loads(r["agent"])["tool_calls"])
    assert read_metrics(root)[0]["tool_calls/errors"] == len(calls)


def test_filter_overlong_prompts_counts_the_tools_the_rollout_servers_report(lookup_task, tmp_path):
    """The trainer asks a rollout server (Info) for the tools it renders a tool agent's prompt with,
    and measures each prompt with them, as verl's dataset does: with a chat template that writes a
    tools block, the rows that fit only without it are filtered, exactly those."""
    import shutil

    import yaml
    from transformers import AutoTokenizer

    from grpo_api.spec import MultiTurnSpec
    from grpo_rollout import tiny, tool_task
    from grpo_rollout.tools import load_tools
    model, train = lookup_task
    model = shutil.copytree(model, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = ("{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for t in tools %}"
                         "{{- t.function.name + ' ' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}" + tiny.CHAT_TEMPLATE)
    tok.save_pretrained(model)
    schemas = [t.schema for _, t in sorted(load_tools(MultiTurnSpec(tools=["grpo_rollout.tool_task:lookup"])).items())]

    def length(messages, tools=None):
        return len(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)["input_ids"])
    rows = tool_task.make_rows(1024, "train", 0)          # what write_dataset wrote
    limit = max(length(r["prompt"]) for r in rows)        # every row fits without the tools
    expected = sum(length(r["prompt"], schemas) > limit for r in rows)
    assert 0 < expected < len(rows) - 64

    job = lookup_job(tmp_path, "tool-filter", model, train, lr=2e-3, steps=1)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["data"].update(maxPromptLength=limit, filterOverlongPrompts=True)
    job.write_text(yaml.safe_dump(doc))
    token = secrets.token_hex(16)
    [server] = start_rollout_servers(job, token, 1, tmp_path, ready=False)
    try:
        result = run_trainer(job, rollout=server.address, token=token, nproc=1, timeout=900)
    finally:
        server.stop()
    assert result.returncode == 0, result.output[-6000:]
    assert f"Filtered {expected} overlong prompts (data.filterOverlongPrompts)" in result.output, result.output[-6000:]
