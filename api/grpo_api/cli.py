"""`grpo`: a thin dispatcher. Subcommands are `grpo.commands` entry points registered by each
package; a subcommand's package is imported only when it runs (so `grpo validate` stays fast)."""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points
from typing import NoReturn

from grpo_api import __version__
from grpo_api.contracts import BAD_INPUT_EXIT_CODE, DIE_WITH_PARENT_ENV


def _commands() -> dict:
    return {ep.name: ep for ep in entry_points(group="grpo.commands")}


def _summary(entry_point) -> str:
    """The first paragraph of the command function's docstring, on one line (a summary that wraps
    in the source is not cut mid-sentence). Loading it is cheap: command modules import their
    heavy dependencies inside the functions."""
    try:
        fn = entry_point.load()
    except ImportError:  # a package whose extra isn't installed (e.g. the operator without kopf)
        return "(not installed)"
    return " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Exit as `sys.exit` would (the atexit handlers: a lease, a log mirror's last copy, trackers'
    hooks; logging flushed), but without the interpreter's teardown: no waiting on threads still
    blocked in a call, and no static destructors, where gloo's or Arrow's threads sometimes abort
    a process whose work is done (SIGABRT, "terminate called without an active exception")."""
    import atexit
    import logging
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_launcher() -> None:
    """SIGTERM when the `grpo run` that started this process dies (contracts.DIE_WITH_PARENT_ENV).
    The variable is taken out of the environment, so this process's own children never see it: a
    parent other than the one named means that one is already gone."""
    launcher = os.environ.pop(DIE_WITH_PARENT_ENV, None)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if str(os.getppid()) != launcher:     # it died before the prctl: nothing would signal us
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _die_with_launcher()
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(f"grpo {__version__}: Kubernetes-native GRPO post-training\n\nusage: grpo COMMAND [ARGS]\n\ncommands:")
        width = max(map(len, commands), default=0)
        for name in sorted(commands):
            print(f"  {name:<{width}}  {_summary(commands[name])}")
        print("\nRun `grpo COMMAND --help` for a command's options.")
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        import difflib
        close = difflib.get_close_matches(name, commands, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        print(f"grpo: unknown command '{name}'.{hint} Run `grpo --help`.", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    return int(commands[name].load()(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
