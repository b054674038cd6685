"""The built-in `python` tool: runs the model's code in a separate, limited process.

Each call gets a fresh process (`python -I`: no user site, no PYTHON* variables, the script's
folder not on the path) in a fresh temporary folder that is deleted afterwards, a minimal
environment, its own session (a timeout kills the whole process group), and rlimits on CPU time,
address space, file size, open files and (for a non-root server) processes. Where unprivileged
user namespaces are allowed, it also enters a new user and network namespace: no interface but
a down loopback, so no network. It is NOT a security boundary against hostile code: the files
the server's user can read stay readable (no mount namespace or seccomp), and without user
namespaces the network is reachable. On Kubernetes the programs run in the job's sandbox pods
instead (grpo_rollout.sandbox_server: the same function, in pods that can open no connection;
docs/RELIABILITY.md).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile

from grpo_api.spec import PythonSandbox
from grpo_rollout.tools.base import Tool, ToolError

MAX_OUTPUT_BYTES = 64 * 1024

# Applies the limits, then becomes `python -I main.py`. It runs as a fresh process: the limits are
# not set between fork and exec (preexec_fn), which is unsafe in a threaded server (gRPC's, the
# tool runner's) and crashed children with SIGSEGV under load.
_LAUNCHER = """
import ctypes, os, resource, sys
cpu, memory_mb, max_processes, isolate = map(int, sys.argv[1:5])
if isolate and ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) != 0:   # CLONE_NEWUSER|NEWNET
    sys.exit(125)
mb = 1024 * 1024
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))   # SIGXCPU at the soft limit, SIGKILL a second later
resource.setrlimit(resource.RLIMIT_AS, (memory_mb * mb, memory_mb * mb))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 * mb, 16 * mb))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if os.getuid() != 0:   # root ignores RLIMIT_NPROC
    resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
os.execv(sys.executable, [sys.executable, "-I", *sys.argv[5:]])
"""


def _command(limits: PythonSandbox, isolate_network: bool, *program: str) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(limits.cpu_seconds), str(limits.memory_mb),
            str(limits.max_processes), str(int(isolate_network)), *program]


@functools.cache
def network_isolation_available() -> bool:
    """Whether a child can enter its own user+network namespace here (checked once, in a child)."""
    try:
        result = subprocess.run(_command(PythonSandbox(), True, "-c", "pass"), timeout=30, capture_output=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


def run_python(code: str, limits: PythonSandbox) -> tuple[str, bool]:
    """(what the model reads back, whether the run failed: a non-zero exit, a signal or the timeout)."""
    isolate = network_isolation_available()
    with tempfile.TemporaryDirectory(prefix="grpo-python-") as cwd:
        path = os.path.join(cwd, "main.py")
        with open(path, "w") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        # Its own session: a timeout kills the whole process group, whatever it forked.
        proc = subprocess.Popen(_command(limits, isolate, "main.py"), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=limits.timeout_seconds)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            return _text(out) + f"\nError: timed out after {limits.timeout_seconds:g}s (killed)", True
        finally:
            _kill_group(proc)     # whatever it forked and left behind
    text = _text(out)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        hint = " (CPU time limit)" if name == "SIGXCPU" else ""
        return text + f"\nError: killed by {name}{hint}", True
    if proc.returncode != 0:
        return text + f"\nError: exit status {proc.returncode}", True
    return text, False


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(out: bytes | None) -> str:
    out = out or b""
    if len(out) > MAX_OUTPUT_BYTES:
        out = out[:MAX_OUTPUT_BYTES] + b"\n...(output cut)"
    return out.decode("utf-8", errors="replace")


class PythonTool(Tool):
    name = "python"
    schema = {"type": "function", "function": {
        "name": "python",
        "description": "Run a Python program in a sandbox and return what it prints (stdout and stderr).",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "The program; print() what you need to see."}},
            "required": ["code"]}}}

    def __init__(self, limits: PythonSandbox, sandbox=None):
        """sandbox: a tools.sandbox_client.SandboxClient to run the code on; None runs it here."""
        self.limits, self.sandbox = limits, sandbox

    def call(self, arguments: dict, create_kwargs: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError("python needs a string argument 'code'")
        text, failed = self.sandbox.run(code) if self.sandbox else run_python(code, self.limits)
        if failed:
            raise ToolError(text)
        return text

    def close(self) -> None:
        if self.sandbox:
            self.sandbox.close()
