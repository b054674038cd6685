"""Tools of the agent loop: the Hermes parser, function schemas, verl tool config files, the
ToolRunner's fault handling, and the `python` tool's sandbox."""

import os
import textwrap

import pytest

from grpo_api.records import TOOL_ERROR_KINDS
from grpo_api.spec import MultiTurnSpec, PythonSandbox
from grpo_rollout.tools import ToolCall, ToolRunner, load_tools, truncate
from grpo_rollout.tools.function_tool import FunctionTool, function_schema
from grpo_rollout.tools.hermes import parse_tool_calls
from grpo_rollout.tools.python_tool import network_isolation_available, run_python
from tests.rollout.tool_fixtures import tools as fixture_tools

FIXTURES = "tests.rollout.tool_fixtures.tools"


# --- the Hermes parser ------------------------------------------------------------------------

def test_parses_hermes_calls_in_order():
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls(text, limit=1) == [ToolCall("add", {"a": 1, "b": 2})]


def test_no_call_and_an_unclosed_call_are_not_calls():
    assert parse_tool_calls("#### 7") == []
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": {}}') == []


@pytest.mark.parametrize("body, says", [
    ('{"name": "add", "arguments": {"a": 1}', "not valid JSON"),
    ('["add"]', '{"name": ..., "arguments": {...}}'),
    ('{"arguments": {}}', '{"name": ..., "arguments": {...}}'),
    ('{"name": "add", "arguments": [1, 2]}', "arguments must be a JSON object"),
])
def test_malformed_calls_become_error_calls(body, says):
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert says in call.error


# --- function tools ---------------------------------------------------------------------------

def test_schema_from_signature_and_docstring():
    assert function_schema(fixture_tools.add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first number."},
            "b": {"type": "integer", "description": "The second number, zero if left out."}},
            "required": ["a"]}}}


def test_keyword_only_parameters_come_from_the_row_not_the_model():
    tool = FunctionTool(fixture_tools.grade)
    params = tool.schema["function"]["parameters"]
    assert params["properties"] == {"answer": {"type": "string"}, "unit": {"type": "string", "enum": ["m", "km"]},
                                    "note": {"type": "string"}}
    assert params["required"] == ["answer", "unit"]
    assert tool.call({"answer": "3", "unit": "m"}, {"truth": "3", "ignored": 1}) == "right"


def test_load_tools_by_reference_and_from_a_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text('def shout(text: str) -> str:\n    """Upper-case."""\n    return text.upper()\n')
    tools = load_tools(MultiTurnSpec(tools=[f"{FIXTURES}:add", f"{path}:shout", "python"]))
    assert sorted(tools) == ["add", "python", "shout"]
    assert tools["shout"].call({"text": "hi"}, {}) == "HI"


@pytest.mark.parametrize("ref, says", [
    ("no_such_module_xyz:f", "can't import no_such_module_xyz"),
    (f"{FIXTURES}:missing", "has no function 'missing'"),
    ("/nonexistent/tools.py:f", "no file /nonexistent/tools.py"),
])
def test_a_tool_that_does_not_load_names_its_field(ref, says):
    with pytest.raises(ValueError, match=r"rollout\.multiTurn\.tools\[0\]") as err:
        load_tools(MultiTurnSpec(tools=[ref]))
    assert says in str(err.value)


def test_verl_tool_config_file(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(textwrap.dedent(f"""
        tools:
          - class_name: {FIXTURES}.EchoTool
            config: {{type: native, prefix: "echo: "}}
            tool_schema:
              type: function
              function:
                name: echo
                description: Echo the text.
                parameters: {{type: object, properties: {{text: {{type: string}}}}, required: [text]}}
        """))
    tools = load_tools(MultiTurnSpec(tool_config_path=str(config)))
    assert tools["echo"].call({"text": "hi"}, {}) == "echo: hi"
    assert tools["echo"].instance.released == ["instance-1"]
    config.write_text("tools:\n  - class_name: nope\n")
    with pytest.raises(ValueError, match=r"toolConfigPath .*tools\[0\]\.class_name"):
        load_tools(MultiTurnSpec(tool_config_path=str(config)))


# --- the runner: failures are the model's answers, never the server's -------------------------

def test_a_tool_that_raises_hangs_or_does_not_exist_answers_with_an_error():
    tools = load_tools(MultiTurnSpec(tools=[f"{FIXTURES}:add", f"{FIXTURES}:explode", f"{FIXTURES}:hang"]))
    runner = ToolRunner(tools, timeout_seconds=1.0, max_response_length=100, truncate_side="middle")
    try:
        results = runner.run([(ToolCall("hang", {}), {}), (ToolCall("explode", {}), {}),
                              (ToolCall("add", {"a": 2, "b": 3}), {}), (ToolCall("add", {"c": 1}), {}),
                              (ToolCall("nope", {}), {}), (ToolCall("", {}, "not valid JSON"), {})])
    finally:
        runner.close()
    assert [r.error for r in results] == ["timeout", "crash", "", "tool_error", "unknown_tool", "parse"]
    assert {r.error for r in results} - {""} <= set(TOOL_ERROR_KINDS)     # the kinds the trainer counts
    assert "timed out after 1s" in results[0].text
    assert "RuntimeError: the tool broke" in results[1].text
    assert results[2].text == "5"
    assert "takes no argument(s) ['c']" in results[3].text
    assert "no tool named 'nope'" in results[4].text


@pytest.mark.parametrize("side, expected", [("left", "...(truncated)6789"), ("right", "0123...(truncated)"),
                                            ("middle", "01...(truncated)...89")])
def test_truncate_sides(side, expected):
    assert truncate("0123456789", 4, side) == expected
    assert truncate("0123", 4, side) == "0123"


# --- the python tool's sandbox ----------------------------------------------------------------

LIMITS = PythonSandbox(timeout_seconds=20, cpu_seconds=2, memory_mb=256)


def test_python_runs_code_in_a_fresh_folder_that_is_removed():
    out, failed = run_python("import os; print(os.getcwd()); print(os.listdir())", LIMITS)
    cwd, listing = out.splitlines()
    assert not failed and listing == "['main.py']" and "grpo-python-" in cwd
    assert not os.path.exists(cwd)


@pytest.mark.parametrize("code, says", [
    ("while True: pass", "SIGXCPU (CPU time limit)"),
    ("x = bytearray(2 * 1024**3)", "MemoryError"),
    ("raise SystemExit(3)", "exit status 3"),
    ("import os; os.kill(os.getpid(), 9)", "killed by SIGKILL"),
    ("open('big', 'wb').write(b'x' * (64 * 1024**2))", "exit status"),   # RLIMIT_FSIZE: 16 MiB
])
def test_python_limits_give_the_model_an_error(code, says):
    out, failed = run_python(code, LIMITS)
    assert failed and says in out


def test_python_wall_clock_timeout_kills_the_process_group():
    out, failed = run_python("import subprocess, time\nsubprocess.Popen(['sleep', '300'])\ntime.sleep(300)",
                             PythonSandbox(timeout_seconds=1, cpu_seconds=5, memory_mb=256, max_processes=4))
    assert failed and "timed out after 1s" in out


@pytest.mark.skipif(not network_isolation_available(), reason="no unprivileged user+network namespaces here")
def test_python_has_no_network():
    out, failed = run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)", LIMITS)
    assert failed and "Network is unreachable" in out


@pytest.mark.skipif(os.getuid() == 0, reason="root ignores RLIMIT_NPROC")
def test_python_cannot_fork():
    out, failed = run_python("import os; os.fork()", LIMITS)
    assert failed and "BlockingIOError" in out


def test_each_call_has_its_own_timeout_and_hung_calls_hold_nothing_back():
    """Calls that hang past their timeout (their threads abandoned) never delay later calls: a
    quick call after many hung ones still answers, and each call's seconds are its own."""
    tools = load_tools(MultiTurnSpec(tools=[f"{FIXTURES}:add", f"{FIXTURES}:hang"]))
    runner = ToolRunner(tools, timeout_seconds=2.0, max_response_length=100, truncate_side="middle", max_running=40)
    try:
        for _ in range(2):      # 2 x 20 hung calls: more than a pool of 16 threads would hold
            results = runner.run([(ToolCall("hang", {}), {})] * 19 + [(ToolCall("add", {"a": 2, "b": 3}), {})])
            assert [r.error for r in results] == ["timeout"] * 19 + [""]
            assert results[-1].text == "5" and results[-1].seconds < 2.0
            assert all(r.seconds == 2.0 for r in results[:-1])
        # 38 hung calls still run: at the cap (40), a call is refused at once, never queued
        refused = runner.run([(ToolCall("hang", {}), {})] * 3)
        assert [r.error for r in refused] == ["timeout", "timeout", "unavailable"]
    finally:
        runner.close()
