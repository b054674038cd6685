"""A verl launch script run as bash runs it, with nothing it launches run: the argv that
`python3 -m verl.trainer.main_ppo` (or `uv run ...`, `ray job submit -- ...`, `torchrun ...`)
would get, exactly.

Why bash itself and not an interpreter of the bash these scripts use: verl's scripts pick
settings with `case "$DEVICE"`, `if`, arrays, functions, `source`, `${X:-$(...)}` and
`set -euo pipefail`; every construct an interpreter gets slightly wrong is a job that trains
something else than verl would (issue 43: one script in five), while bash can't drift from bash.

How: `bash SCRIPT ARGS...` in a temporary cwd, with `HOME` a temporary folder too, a timeout and
a `PATH` whose first folder holds stubs. The launchers' stubs (python, python3, uv, ray,
torchrun, ...) append their argv to a record file and exit 0; `python3 -c` exits 1, as on an
NVIDIA machine without torch_npu, so `DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' ...)}`
selects gpu. The side effects a translation must never perform (downloads, installs, git, GPU
queries, killing processes) are stubs that do nothing; file commands (rm, mkdir, mv, cp, ...)
run only when every path they name lies in the temporary folders (a `cd` to the script's own
folder and a relative `rm -rf` touch nothing). Shell redirections to absolute paths are not
stubbed: verl's scripts write only logs that way.

The environment: only what is given (`--env KEY=VALUE`), or the caller's with `expand_env`.
A variable the script reads but nothing sets expands to nothing in bash; to say so instead of
translating `$DATA/train.parquet` into `/train.parquet`, the script runs a second time with such
variables set to markers, and a word where a marker took the place of the empty expansion is
kept as written (`$DATA/train.parquet`), with a warning. `$HOME` and the cwd (`$(pwd)`) are
written back as `$HOME` / `$PWD`, or with `expand_env` as the caller's.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# Programs whose argv is recorded: a verl launch goes through one of them.
LAUNCHERS = ("python", "python3", "uv", "ray", "torchrun", "accelerate", "deepspeed", "srun", "mpirun")
# Side effects a translation must never perform; the stubs print nothing and succeed.
SILENT = ("nvidia-smi", "npu-smi", "pip", "pip3", "git", "wget", "curl", "huggingface-cli", "hf", "modelscope",
          "aws", "gsutil", "hdfs", "docker", "ssh", "scp", "rsync", "sleep", "pkill", "killall", "wandb",
          "apt", "apt-get", "sudo", "conda", "hadoop", "ossutil", "aria2c", "sbatch")
# File commands that run for real only on paths inside the temporary folders.
CONFINED = ("rm", "rmdir", "mkdir", "mv", "cp", "ln", "touch", "chmod", "chown", "truncate", "tee")
TIMEOUT_S = 30
_MARK = "\x01"          # wraps a marker: NAME between two of them


class ShellError(ValueError):
    """The script couldn't be run to its launch."""


@dataclass
class ShellRun:
    launches: list[list[str]]          # every recorded launcher argv, its program first
    code: int
    stderr: str
    warnings: list[str] = field(default_factory=list)


_RECORD = """#!/bin/bash
# grpo from-verl: records what the script would launch; runs nothing.
printf '%s\\0' "$#" "${0##*/}" "$@" >> "$GRPO_VERL_RECORD"
"""
_PYTHON = _RECORD + """for a in "$@"; do [ "$a" = -c ] && exit 1; [ "$a" = -m ] && break; done
exit 0
"""
_CONFINED = """#!/bin/bash
# grpo from-verl: runs the real command only when every path it names is in the temporary folders.
real=$(PATH=/usr/local/bin:/usr/bin:/bin command -v "${0##*/}") || exit 0
for a in "$@"; do
  case "$a" in -*) continue ;; esac
  p=$(realpath -m -- "$a" 2>/dev/null) || p=/
  case "$p" in "$GRPO_VERL_ROOT"/*) ;; *) [ "${0##*/}" = tee ] && exec cat; exit 0 ;; esac
done
exec "$real" "$@"
"""


def _stubs(folder: Path) -> None:
    folder.mkdir()
    for name, body in [*((n, _PYTHON if n.startswith("python") else _RECORD) for n in LAUNCHERS),
                       *((n, "#!/bin/sh\nexit 0\n") for n in SILENT), *((n, _CONFINED) for n in CONFINED)]:
        path = folder / name
        path.write_text(body)
        path.chmod(0o755)


def _records(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    fields, out, i = path.read_bytes().split(b"\0"), [], 0
    while i + 1 < len(fields):
        n = int(fields[i])
        out.append([f.decode("utf-8", "replace") for f in fields[i + 1:i + 2 + n]])
        i += 2 + n
    return out


# Variables bash sets itself (a script reading them reads no environment).
_BASH_VARS = {"BASH_SOURCE", "BASH", "BASHPID", "BASH_VERSION", "BASH_LINENO", "FUNCNAME", "LINENO", "RANDOM",
              "SECONDS", "PIPESTATUS", "PPID", "UID", "EUID", "HOSTNAME", "HOSTTYPE", "OSTYPE", "IFS", "PWD",
              "OLDPWD", "HOME", "PATH", "SHLVL", "OPTIND", "OPTARG", "REPLY", "GROUPS", "EPOCHSECONDS", "TMPDIR"}


def run_script(text: str, *, path: str | None = None, args: list[str] = (), env: dict[str, str] | None = None,
               expand_env: bool = False) -> ShellRun:
    """Run `text` (the script at `path`, when it is a file: `$0`, `source` and `BASH_SOURCE` then
    resolve as they would) under bash and record its launches. `env` adds to the environment."""
    bash = shutil.which("bash")
    if not bash:
        raise ShellError("bash is needed to read a shell script (it runs the script with its launchers stubbed)")
    with tempfile.TemporaryDirectory(prefix="grpo-from-verl-") as tmp:
        root = Path(tmp).resolve()
        (root / "home").mkdir()
        (root / "cwd").mkdir()
        _stubs(root / "bin")
        # Sourced before the script: resource limits don't change a launch's arguments, and a
        # `ulimit -n 32768` beyond this machine's hard limit must not stop a `set -e` script; nor
        # must a `cd verl &&` into a folder of the user's machine that isn't here.
        (root / "env.sh").write_text('ulimit() { builtin ulimit "$@" 2>/dev/null || true; }\n'
                                     'cd() { builtin cd "$@" 2>/dev/null || true; }\n')
        script = Path(path).resolve() if path else root / "script.sh"
        if not path:
            script.write_text(text)
        base = dict(os.environ) if expand_env else {"LANG": "C.UTF-8", "USER": os.environ.get("USER", "user")}
        for name in [n for n in base if n.startswith("BASH_FUNC_")] + ["BASH_ENV", "ENV", "CDPATH", "PS4"]:
            base.pop(name, None)
        base.update(env or {})
        base.update(PATH=f"{root / 'bin'}:/usr/local/bin:/usr/bin:/bin", HOME=str(root / "home"),
                    TMPDIR=str(root / "cwd"), GRPO_VERL_ROOT=str(root), BASH_ENV=str(root / "env.sh"))
        # Candidates for "read but never set": not given a default (`${X:-d}`) nor assigned by the script.
        handled = set(re.findall(r"\$\{([A-Za-z_]\w*):?[-=?+]", text)) | set(re.findall(r"\b([A-Za-z_]\w*)\+?=", text))
        unset = sorted(set(re.findall(r"\$\{?[#!]?([A-Za-z_]\w*)", text)) - handled - set(base) - _BASH_VARS)

        def run(extra: dict[str, str], n: int) -> ShellRun:
            record = root / f"record{n}"
            run_env = {**base, **extra, "GRPO_VERL_RECORD": str(record)}
            try:
                done = subprocess.run([bash, str(script), *args], cwd=root / "cwd", env=run_env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=TIMEOUT_S,
                                      start_new_session=True)
            except subprocess.TimeoutExpired:
                raise ShellError(f"the script didn't finish within {TIMEOUT_S} s under bash (launchers stubbed): a "
                                 f"wait loop? pass the verl arguments after -- instead") from None
            return ShellRun(_records(record), done.returncode, done.stderr.decode("utf-8", "replace"))

        result = run({}, 0)
        if unset:
            marked = run({n: f"{_MARK}{n}{_MARK}" for n in unset}, 1)
            _keep_unset_as_written(result, marked)
        _write_back(result, str(root / "home"), "$HOME", os.environ.get("HOME") if expand_env else None)
        _write_back(result, str(root / "cwd"), "$PWD", os.getcwd() if expand_env else None)
        return result


def _keep_unset_as_written(result: ShellRun, marked: ShellRun) -> None:
    """Where a marker stands in the second run and the first run has the same word without it, the
    script expanded an unset variable to nothing: keep `$NAME` as written."""
    if [len(a) for a in result.launches] != [len(a) for a in marked.launches]:
        return                      # the variables changed the script's path: bash's first run stands
    names: list[str] = []
    for argv, marked_argv in zip(result.launches, marked.launches):
        for i, (word, mword) in enumerate(zip(argv, marked_argv)):
            if _MARK in mword and re.sub(f"{_MARK}\\w+{_MARK}", "", mword) == word:
                argv[i] = re.sub(f"{_MARK}(\\w+){_MARK}", lambda m: names.append(m.group(1)) or f"${m.group(1)}",
                                 mword)
    result.warnings += [f"${n} is left as written; pass --expand-env to take it from the environment (or --env "
                        f"{n}=...)" for n in dict.fromkeys(names)]


def _write_back(result: ShellRun, folder: str, name: str, value: str | None) -> None:
    used = False
    for argv in result.launches:
        for i, word in enumerate(argv):
            if folder in word:
                argv[i], used = word.replace(folder, value if value is not None else name), True
    if used and value is None:
        result.warnings.append(f"{name} is left as written; pass --expand-env to take it from the environment")


def describe(argv: list[str]) -> str:
    return shlex.join(argv[:6]) + (" ..." if len(argv) > 6 else "")
