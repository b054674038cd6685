"""The agent loop on the hf engine with the lookup task's tiny model: token-in/token-out, the
response mask, turn limits, and tools that fail without failing the rollout."""

import copy
import json
import os
from dataclasses import replace

import pytest

from grpo_api.spec import MultiTurnSpec
from grpo_rollout import tiny, tool_task
from grpo_rollout.agent_loop import ToolAgentLoop
from grpo_rollout.engine import SamplingParams
from grpo_rollout.hf_engine import HFEngine
from grpo_rollout.shard import Prompt, Scored, rollout_table
from grpo_rollout.tools import ToolRunner, load_tools

FIXTURES = "tests.rollout.tool_fixtures.tools"
MAX_LEN = 24


@pytest.fixture(scope="module")
def lookup_model(tmp_path_factory):
    return tool_task.build_model(tmp_path_factory.mktemp("lookup-model"))


@pytest.fixture(scope="module")
def engine(lookup_model):
    """hf here; GRPO_TEST_ENGINE=vllm runs the same tests on vLLM (on a GPU: bench/h200_run.sh
    agent-loop-vllm), whose path continues from token ids too (TokensPrompt)."""
    model = lookup_model
    if os.environ.get("GRPO_TEST_ENGINE") == "vllm":
        from grpo_rollout.vllm_engine import VLLMEngine
        return VLLMEngine(str(model), dtype="float32", seed=0, gpu_memory_utilization=0.2, enforce_eager=True)
    return HFEngine(model)


class RecordingEngine:
    """The real engine, with a record of every call's input ids and sampled ids (a spy)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.tokenizer = engine.tokenizer

    def generate(self, prompt_ids, params):
        groups = self.engine.generate(prompt_ids, params)
        self.calls.extend((list(p), list(g[0].token_ids)) for p, g in zip(prompt_ids, groups))
        return groups

    def decode(self, ids):
        return self.engine.decode(ids)


def prompt_ids(tok, text="answer #### and the digit"):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])


def make_loop(engine, tools=("tool_task",), timeout=5.0, **spec):
    refs = ["grpo_rollout.tool_task:lookup" if t == "tool_task" else t for t in tools]
    mt = MultiTurnSpec(enable=True, tools=refs, **spec)
    runner = ToolRunner(load_tools(mt), timeout_seconds=timeout, max_response_length=mt.max_tool_response_length,
                        truncate_side=mt.tool_response_truncate_side)
    return ToolAgentLoop(mt, engine, engine.tokenizer, runner, MAX_LEN)


def lookup_prompt(tok, digit="7", **extra):
    return Prompt("0-0", 0, prompt_ids(tok), "openai/gsm8k", digit,
                  {"tools_kwargs": {"lookup": {"create_kwargs": {"digit": digit}}}, **extra})


def test_token_in_token_out(engine):
    """The trajectory is exactly the engine's inputs and samples, and the tool turns' ids; a
    decode + re-encode of the same trajectory would give other ids."""
    spy = RecordingEngine(engine)
    loop = make_loop(spy)
    tok = engine.tokenizer
    [group] = loop.generate([lookup_prompt(tok)], SamplingParams(n=64, max_tokens=MAX_LEN, seed=3))
    prompt = prompt_ids(tok)
    with_calls = [s for s in group if s.agent["tool_calls"]]
    assert with_calls, "the random policy made no tool call in 64 samples"
    unmatched = list(spy.calls)      # each engine sample explains one model turn, once
    for s in group:
        ids, mask = s.token_ids, s.response_mask
        assert len(ids) == len(mask) == len(s.logprobs) <= MAX_LEN
        # Walk the trajectory turn by turn: each model turn is what the engine sampled from
        # exactly the ids before it; each tool turn is the template's rendering of the answers.
        pos = 0
        while pos < len(ids):
            given = prompt + ids[:pos]
            match = next((c for c in unmatched if c[0] == given and c[1][:len(ids) - pos] == ids[pos:pos + len(c[1])]),
                         None)
            assert match is not None, f"tokens {ids[pos:]} at {pos} are no sample the engine made from {given}"
            unmatched.remove(match)
            sampled = match[1]
            assert mask[pos:pos + len(sampled)] == [1] * len(sampled[:len(ids) - pos])
            pos += len(sampled)
            tool_len = 0
            while pos + tool_len < len(ids) and mask[pos + tool_len] == 0:
                tool_len += 1
            if tool_len:
                assert ids[pos:pos + tool_len] == loop.tool_turn_ids(
                    [type("R", (), {"text": "7"})()], ids[pos - 1])
                assert all(lp == 0.0 for lp in s.logprobs[pos:pos + tool_len])
            pos += tool_len
    answered = [s for s in with_calls if 0 in s.response_mask]    # else the tool turn didn't fit
    assert answered
    for s in answered:
        assert tok.convert_ids_to_tokens(s.token_ids[s.response_mask.index(0):][:3]) == ["<|im_end|>", "<|im_start|>", "tool"]
    # A text-based loop keeps the model's turns as message text (decoded as the rewards see it)
    # and encodes the conversation again: the ids drift (tokens dropped or merged).
    reencoded = [tok.encode(engine.decode(s.token_ids), add_special_tokens=False) for s in group]
    assert any(r != s.token_ids for r, s in zip(reencoded, group)), "no sample where re-encoding would drift"


def test_turn_limits(engine):
    tok = engine.tokenizer
    loop = make_loop(engine, max_assistant_turns=1)
    [group] = loop.generate([lookup_prompt(tok)], SamplingParams(n=32, max_tokens=MAX_LEN, seed=5))
    assert all(s.agent["assistant_turns"] == 1 and s.agent["tool_calls"] == [] for s in group)
    assert all(set(s.response_mask) <= {1} for s in group)
    loop = make_loop(engine, max_user_turns=1)
    [group] = loop.generate([lookup_prompt(tok)], SamplingParams(n=64, max_tokens=MAX_LEN, seed=5))
    assert max(len(s.agent["tool_calls"]) for s in group) == 1


def test_trajectories_without_logprobs_are_the_same_and_carry_none(engine):
    # An on-policy step asks for no behaviour logprobs (issue 47): the trajectories, tool turns
    # included, are those the same seed draws with them, and carry None (the records' null).
    tok = engine.tokenizer
    params = SamplingParams(n=32, max_tokens=MAX_LEN, seed=3)
    [with_lp] = make_loop(engine).generate([lookup_prompt(tok)], params)
    [without] = make_loop(engine).generate([lookup_prompt(tok)], replace(params, logprobs=False))
    assert any(0 in s.response_mask for s in without), "no tool turn in 32 samples"
    assert [(s.token_ids, s.response_mask) for s in without] == [(s.token_ids, s.response_mask) for s in with_lp]
    assert all(s.logprobs is None for s in without) and all(len(s.logprobs) == len(s.token_ids) for s in with_lp)


def test_single_turn_agent_rows_run_no_tools(engine):
    tok = engine.tokenizer
    loop = make_loop(engine)
    prompt = lookup_prompt(tok, agent_name="single_turn_agent")
    [group] = loop.generate([prompt], SamplingParams(n=32, max_tokens=MAX_LEN, seed=3))
    assert all(s.agent["tool_calls"] == [] and s.agent["assistant_turns"] == 1 for s in group)
    with pytest.raises(ValueError, match="extra_info.agent_name 'chess'"):
        loop.generate([lookup_prompt(tok, agent_name="chess")], SamplingParams(n=1, max_tokens=4))


@pytest.mark.parametrize("tool, error, says", [("explode", "crash", "RuntimeError: the tool broke"),
                                               ("hang", "timeout", "timed out after 0.5s")])
def test_a_failing_tool_is_an_error_message_and_the_rollout_goes_on(engine, tool, error, says):
    """The lookup call reaches a tool that raises or hangs: every sample still completes, the
    call is recorded with its error, and the model reads the error as the tool's answer."""
    tok = engine.tokenizer
    loop = make_loop(engine, tools=(f"{FIXTURES}:{tool}",), timeout=0.5)
    loop.runner.tools["lookup"] = loop.runner.tools.pop(tool)    # the model can only call "lookup"
    [group] = loop.generate([lookup_prompt(tok)], SamplingParams(n=48, max_tokens=MAX_LEN, seed=3))
    failed = [s for s in group if s.agent["tool_calls"]]
    assert failed and all(c["error"] == error for s in failed for c in s.agent["tool_calls"])
    assert all(s.agent["tool_errors"] == len(s.agent["tool_calls"]) for s in failed)
    answer = engine.tokenizer.encode(f"Error: {says}", add_special_tokens=False)
    assert any(answer[0] in s.token_ids for s in failed)


def test_records_keep_the_mask_and_the_turns(engine):
    tok = engine.tokenizer
    prompt = lookup_prompt(tok)
    [group] = make_loop(engine).generate([prompt], SamplingParams(n=32, max_tokens=MAX_LEN, seed=3))
    table = rollout_table([prompt], [[Scored(s, 0.0, {}) for s in group]], policy_version=0, worker="w")
    rows = table.to_pylist()
    for row, s in zip(rows, group):
        assert row["response_ids"] == s.token_ids and row["response_mask"] == s.response_mask
        assert row["num_turns"] == s.agent["num_turns"]
        assert json.loads(row["agent"])["tool_calls"] == s.agent["tool_calls"]


# The tiny template with a tools block, as Qwen3's renders one before the conversation.
TOOLS_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for t in tools %}{{- t.function.name + ' ' }}"
                  "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}" + tiny.CHAT_TEMPLATE)


def test_a_tool_agent_is_prompted_with_the_tools_schemas_and_the_records_keep_that_prompt(engine):
    """A tool_agent row's messages are rendered again with the tools (the chat template's tools
    block); the engine is given exactly that, and the records keep it for the trainer to score.
    A single_turn_agent row keeps the trainer's ids. Schemas that push a prompt over
    data.maxPromptLength are an error naming it."""
    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    spy = RecordingEngine(engine)
    mt = MultiTurnSpec(enable=True, tools=["grpo_rollout.tool_task:lookup"])
    runner = ToolRunner(load_tools(mt), timeout_seconds=5.0, max_response_length=mt.max_tool_response_length,
                        truncate_side=mt.tool_response_truncate_side)
    loop = ToolAgentLoop(mt, spy, tok, runner, MAX_LEN, max_prompt_length=32)
    messages = ({"role": "user", "content": "answer #### and the digit"},)
    plain = prompt_ids(engine.tokenizer)
    tool_row = replace(lookup_prompt(tok), messages=messages)
    single_row = replace(lookup_prompt(tok, agent_name="single_turn_agent"), uid="0-1", prompt_index=1,
                         messages=messages)
    groups = loop.generate([tool_row, single_row], SamplingParams(n=2, max_tokens=MAX_LEN, seed=1))

    with_tools = tok.apply_chat_template(list(messages), tools=loop.schemas, add_generation_prompt=True,
                                         tokenize=True)
    with_tools = with_tools if isinstance(with_tools, list) else list(with_tools["input_ids"])
    assert tok.convert_ids_to_tokens(with_tools[:2]) == ["<|im_start|>", "system"]
    assert with_tools[-len(plain):] == plain
    first_turn_inputs = [given for given, _ in spy.calls[:4]]   # turn 1: two samples per row
    assert sorted(first_turn_inputs) == sorted([with_tools] * 2 + [plain] * 2)
    table = rollout_table([tool_row, single_row], [[Scored(s, 0.0, {}) for s in g] for g in groups],
                          policy_version=0, worker="w")
    assert table.column("prompt_ids").to_pylist() == [with_tools] * 2 + [plain] * 2

    loop.max_prompt_length = len(with_tools) - 1
    with pytest.raises(ValueError, match=r"with the tools' schemas the prompt is \d+ tokens, over data.maxPromptLength"):
        loop.generate([tool_row], SamplingParams(n=1, max_tokens=4))


AGENTS = "tests.rollout.tool_fixtures.agents"


def _spec(tmp_path, model, **rollout):
    from grpo_api.jobfile import load_job
    from tests.rollout.conftest import write_job as write_rollout_job
    return load_job(write_rollout_job(tmp_path / "job.yaml", model, rollout={"n": 2, **rollout})).spec


def test_a_custom_agent_loop_runs_in_place_of_the_tool_loop(engine, lookup_model, tmp_path):
    """rollout.agentLoop (issue 32, item 6): the user's class gets the engine and the request's
    prompts; its trajectories are recorded with their mask (the simulated user's turn masked
    out) and turns, and its environment's facts."""
    from grpo_rollout.agent_loop import CustomAgentLoop, build_agent_loop
    from tests.rollout.tool_fixtures.agents import USER_TURN
    spy = RecordingEngine(engine)
    loop = build_agent_loop(_spec(tmp_path, lookup_model, agentLoop=f"{AGENTS}:SimulatedUser"), spy)
    assert isinstance(loop, CustomAgentLoop)
    tok = engine.tokenizer
    prompt = lookup_prompt(tok)
    # A request for no logprobs (an on-policy step, issue 47) still gives the user's code lists: it adds to them.
    [group] = loop.generate([prompt], SamplingParams(n=2, max_tokens=4, seed=1, logprobs=False))
    user = tok.convert_tokens_to_ids(USER_TURN)
    for s in group:
        assert len(s.logprobs) == len(s.token_ids)
        first = len(s.response_mask) - s.response_mask[::-1].index(0)     # after the user's turn
        assert s.response_mask == [1] * (first - len(user)) + [0] * len(user) + [1] * (len(s.token_ids) - first)
        assert s.token_ids[first - len(user):first] == user
        assert any(given == prompt.prompt_ids + s.token_ids[:first] for given, _ in spy.calls)   # continued from ids
    table = rollout_table([prompt], [[Scored(s, 0.0, {}) for s in group]], policy_version=0, worker="w")
    rows = table.to_pylist()
    assert [r["num_turns"] for r in rows] == [3, 3]
    assert json.loads(rows[0]["agent"]) == {"num_turns": 3, "env": "simulated-user", "tool_calls": []}


def test_a_custom_agent_loops_overlong_response_is_cut_to_max_response_length(engine, lookup_model, tmp_path):
    # as verl's agent loops cut theirs to response_length: never trained on beyond it (issue 48)
    from grpo_rollout.agent_loop import build_agent_loop
    loop = build_agent_loop(_spec(tmp_path, lookup_model, agentLoop=f"{AGENTS}:Rambler"), engine)
    [group] = loop.generate([lookup_prompt(engine.tokenizer)], SamplingParams(n=2, max_tokens=2, seed=1))
    for s in group:
        assert len(s.token_ids) == len(s.logprobs) == len(s.response_mask) == 12     # data.maxResponseLength
        assert s.finish_reason == "length"
        answered = s.response_mask.index(0)          # the model's own tokens, then the environment's
        assert s.response_mask == [1] * answered + [0] * (12 - answered)
    assert loop.truncated == 2


def test_a_contract_break_fails_the_step_at_once_and_is_never_dispatched_again(engine, lookup_model, token, tmp_path):
    """Issue 48: the server answers INVALID_ARGUMENT naming the loop; the trainer's dispatcher stops
    with that message after one try (every server would refuse it again, each try a whole generation)."""
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpo_api.proto import rollout_pb2 as pb
    from grpo_api.records import PROMPT_SCHEMA, RunLayout
    from grpo_api.storage import Storage
    from grpo_trainer.rollout_client import RolloutDispatcher, RolloutRefused
    from grpo_trainer.rollout_servers import RolloutServers
    from tests.rollout.conftest import start_server

    class AtEveryVersion:     # the VersionKeeper of a server that needs no new weights here
        def ensure_version(self, worker: str, version: int) -> None:
            pass

    repo = Path(__file__).resolve().parents[2]
    server = start_server(tmp_path, lookup_model, token, env={"PYTHONPATH": str(repo)},
                          rollout={"agentLoop": f"{AGENTS}:OneGroupShort"})
    try:
        dispatcher = RolloutDispatcher(RolloutServers(lambda: [server.address], token), weights=AtEveryVersion(),
                                       layout=RunLayout(f"file://{tmp_path}/run"), storage=Storage(), timeout=120)
        ids = lookup_prompt(engine.tokenizer).prompt_ids
        sink = pa.BufferOutputStream()
        rows = [{"uid": f"0-{i}", "prompt_index": i, "prompt_ids": ids, "data_source": "openai/gsm8k",
                 "ground_truth": "7", "extra_info": "{}"} for i in range(2)]
        pq.write_table(pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA), sink)
        with pytest.raises(RolloutRefused, match=r"rollout shard s0: 127\.0\.0\.1:\d+ refused it: spec\.rollout\."
                                                 r"agentLoop .*generate returned list of 1 groups for 2 prompts"):
            dispatcher.generate(1, "train", {"s0": sink.getvalue().to_pybytes()},
                                pb.SamplingParams(n=2, max_tokens=2), version=0)
        assert server.metric("grpo_rollout_requests_total", outcome="INVALID_ARGUMENT") == 1
        assert dispatcher.redispatched == 0
    finally:
        server.stop()


def test_a_custom_agent_loop_that_breaks_the_contract_is_refused_by_name(engine, lookup_model, tmp_path):
    from grpo_rollout.agent_loop import build_agent_loop
    loop = build_agent_loop(_spec(tmp_path, lookup_model, agentLoop=f"{AGENTS}:OneGroupShort"), engine)
    tok = engine.tokenizer
    with pytest.raises(ValueError, match=r"spec.rollout.agentLoop .*: generate returned list of 1 groups for 2"):
        loop.generate([lookup_prompt(tok), replace(lookup_prompt(tok), uid="0-1")], SamplingParams(n=1, max_tokens=2))
    with pytest.raises(ValueError, match=r"spec.rollout.agentLoop .*has no class 'Nope'"):
        build_agent_loop(_spec(tmp_path, lookup_model, agentLoop=f"{AGENTS}:Nope"), engine)
    with pytest.raises(ValueError, match=r"spec.rollout.agentLoop: .*exclude each other"):
        _spec(tmp_path, lookup_model, agentLoop=f"{AGENTS}:SimulatedUser",
              multiTurn={"enable": True, "tools": ["grpo_rollout.tool_task:lookup"]})
