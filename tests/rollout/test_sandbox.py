"""The `python` tool's sandbox servers (`grpo sandbox`, issue 32 item 5) as real processes over
real gRPC with the job's token and TLS: a program runs there as it would in the rollout server,
under the server's limits (a caller can't raise them); a server killed in the middle of a program
has the program run by another one; with none left the model reads that the sandbox is
unavailable (kind `unavailable`), within the tool's timeout; a rollout server told to use sandbox
servers never runs the code itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import polling
from grpo_api.jobfile import load_job
from grpo_api.proto import sandbox_pb2, sandbox_pb2_grpc
from grpo_api.rpc import ClientAuth, rollout_channel
from grpo_api.spec import MultiTurnSpec
from grpo_rollout.tools import ToolCall, ToolRunner, load_tools
from grpo_rollout.tools.sandbox_client import SandboxClient

from .conftest import write_job

READY = "GRPO_SANDBOX_READY "   # grpo_rollout.sandbox_server.READY_PREFIX: the wire contract
TOKEN = "t0ken"


@pytest.fixture(scope="module")
def tls():
    from grpo_operator.pki import make_job_tls
    return make_job_tls("sandbox-test", ["localhost"], ["127.0.0.1"])


class SandboxProcess:
    def __init__(self, job_file, log_path, tls):
        self._log = open(log_path, "wb")
        self.log_path = log_path
        env = {**os.environ, "GRPO_RPC_TOKEN": TOKEN, "GRPO_TLS_CERT": tls.cert, "GRPO_TLS_KEY": tls.key}
        self.proc = subprocess.Popen([sys.executable, "-m", "grpo_api.cli", "sandbox", "--spec", str(job_file),
                                      "--port", "0", "--metrics-port", "-1"],
                                     stdout=subprocess.PIPE, stderr=self._log, env=env)
        got: dict = {}

        def read():
            for line in self.proc.stdout:
                if line.decode().startswith(READY):
                    got.update(json.loads(line.decode()[len(READY):]))
                    return
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(120)
        if not got:
            self.proc.kill()
            raise AssertionError(f"grpo sandbox did not start: {log_path.read_text()[-2000:]}")
        assert got["tls"] is True
        self.address = f"127.0.0.1:{got['port']}"

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)
        self._log.close()


@pytest.fixture
def sandboxes(tmp_path, tiny_model, tls):
    started = []

    def start(**python):
        job = write_job(tmp_path / f"job-{len(started)}.yaml", tiny_model, rollout={
            "engine": "hf", "n": 2, "multiTurn": {"enable": True, "tools": ["python"], "toolTimeoutSeconds": 10,
                                                  "python": {"replicas": 1, **python}}})
        p = SandboxProcess(job, tmp_path / f"sandbox-{len(started)}.log", tls)
        started.append(p)
        return p, load_job(job).spec.rollout.multi_turn
    yield start
    for p in started:
        p.stop(signal.SIGKILL)


def _auth(tls) -> ClientAuth:
    return ClientAuth(TOKEN, tls.ca_cert.encode(), "localhost")


def _running(address, tls) -> int:
    channel = rollout_channel(address, _auth(tls))
    try:
        return sandbox_pb2_grpc.SandboxStub(channel).Health(sandbox_pb2.SandboxHealthRequest(), timeout=5).running
    finally:
        channel.close()


def test_a_program_runs_on_the_sandbox_server_in_a_fresh_folder(sandboxes, tls):
    server, spec = sandboxes()
    client = SandboxClient(spec, [server.address], _auth(tls))
    try:
        out, failed = client.run("import os; print(os.getppid()); print(os.listdir()); print(2 + 3)")
    finally:
        client.close()
    assert len(out.splitlines()) == 3, out
    parent, listing, five = out.splitlines()
    assert not failed and int(parent) == server.proc.pid and listing == "['main.py']" and five == "5"


@pytest.mark.parametrize("code, says", [("while True: pass", "timed out after 1s"),
                                        ("x = bytearray(1024**3)", "MemoryError")])
def test_the_servers_limits_apply_whatever_the_caller(sandboxes, tls, code, says):
    server, spec = sandboxes(timeoutSeconds=1, cpuSeconds=30, memoryMB=128)
    caller = spec.model_copy(update={"python": spec.python.model_copy(update={"timeout_seconds": 60,
                                                                               "memory_mb": 4096})})
    client = SandboxClient(caller, [server.address], _auth(tls))
    try:
        out, failed = client.run(code)
    finally:
        client.close()
    assert failed and says in out, out


def test_a_server_killed_mid_program_has_it_run_by_another(sandboxes, tls):
    first, spec = sandboxes()
    second, _ = sandboxes()
    client = SandboxClient(spec, [first.address, second.address], _auth(tls), retry_pause=0.1)
    got: list = []
    call = threading.Thread(target=lambda: got.append(client.run("import time; time.sleep(5); print('done')")))
    try:
        call.start()
        polling.wait_until(lambda: _running(first.address, tls) == 1, timeout=30, what="the first server running it")
        first.stop(signal.SIGKILL)
        call.join(60)
    finally:
        client.close()
    assert got == [("done\n", False)]
    assert ": ok in " in second.log_path.read_text()       # the second server ran it


def test_with_no_server_left_the_model_reads_that_the_sandbox_is_unavailable(sandboxes, tls):
    server, spec = sandboxes()
    server.stop(signal.SIGKILL)
    tools = load_tools(spec, SandboxClient(spec, [server.address], _auth(tls), retry_pause=0.1))
    runner = ToolRunner(tools, timeout_seconds=spec.tool_timeout_seconds, max_response_length=1000,
                        truncate_side="middle")
    started = time.monotonic()
    try:
        [result] = runner.run([(ToolCall("python", {"code": "print(1)"}), {})])
    finally:
        runner.close()
    assert result.error == "unavailable", result
    assert "the python sandbox is unavailable" in result.text and "UNAVAILABLE" in result.text
    assert time.monotonic() - started < spec.tool_timeout_seconds


def test_a_wrong_token_is_refused(sandboxes, tls):
    server, spec = sandboxes()
    client = SandboxClient(spec, [server.address], ClientAuth("wrong", tls.ca_cert.encode(), "localhost"),
                           retry_pause=0.1)
    tools = load_tools(spec, client)
    with pytest.raises(Exception, match="UNAUTHENTICATED"):
        tools["python"].call({"code": "print(1)"}, {})
    tools["python"].close()


def test_a_rollout_server_asked_for_sandbox_servers_never_runs_the_code_itself():
    with pytest.raises(ValueError, match=r"rollout.multiTurn.python.replicas is 2: .* --sandbox"):
        load_tools(MultiTurnSpec(enable=True, tools=["python"], python={"replicas": 2}))
    # without replicas set, and no sandbox servers given, it runs here (`grpo run`'s default)
    assert load_tools(MultiTurnSpec(enable=True, tools=["python"]))["python"].sandbox is None
