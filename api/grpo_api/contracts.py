"""What the operator and the pods agree on outside the spec: exit codes, the environment
variables the operator sets for the pods, and the address lists they carry. Both sides import
these names from here, so a rename can't leave one side behind (the operator never imports the
trainer or rollout packages).
"""

from __future__ import annotations

from collections.abc import Mapping

BAD_INPUT_EXIT_CODE = 2
"""Any of our processes refused its input (a spec, a flag, a checkpoint that fails its signed
manifest): the same input fails again, so the operator fails the job instead of restarting the
trainer (its Pod failure policy and lifecycle), and `grpo run` stops."""

STOPPED_EXIT_CODE = 75
"""The trainer stopped because it was told to (SIGTERM: `kubectl delete pod`, a drain, a
suspend), after checkpointing when it could: not a failure, so the trainer Job's Pod failure
policy ignores it (the Job replaces the pod, the restart budget is untouched) and a resume takes
the latest checkpoint. 75 is sysexits.h's EX_TEMPFAIL ("try again later"), a code that none of
our processes' other exits can take: Python's are 0, 1, 2 and 120, torchrun's 1 (or a worker's),
a shell's 126 and 127, a signal's 128+N (129 and up); one that did would loop forever."""

ROLLOUT_READY_PREFIX = "GRPO_ROLLOUT_READY "
"""`grpo rollout` prints one line to stdout once it listens: this prefix, then JSON (port,
metrics_port, worker_id, pid, tls). Its parent (`grpo run`, the colocated trainer) waits for it: a
server that exits before it could not start (the run stops, with the server's last line); one that
exits after it has served and is restarted."""
REWARD_READY_PREFIX = "GRPO_REWARD_READY "
"""`grpo reward`'s ready line, as ROLLOUT_READY_PREFIX (port, metrics_port, pid, tls)."""
SANDBOX_READY_PREFIX = "GRPO_SANDBOX_READY "
"""`grpo sandbox`'s ready line, as ROLLOUT_READY_PREFIX."""

LOG_URI_ENV = "GRPO_LOG_URI"
"""Where a rollout pod mirrors its log: `<run>/logs/<pod>.log` (grpo_rollout.log_mirror)."""
ROLLOUT_ADDRESSES_ENV = "GRPO_ROLLOUT_ADDRESSES"
"""The trainer's rollout servers (its --rollout default): `host:port,...` or one `dns:///name:port`."""
REWARD_ADDRESSES_ENV = "GRPO_REWARD_ADDRESSES"
"""The rollout servers' reward model servers: `name=host:port,...;other=...` (reward_addresses)."""
SANDBOX_ADDRESSES_ENV = "GRPO_SANDBOX_ADDRESSES"
"""The rollout servers' sandbox servers for the python tool: `host:port,...` or a `dns:///` name."""
DIE_WITH_PARENT_ENV = "GRPO_DIE_WITH_PARENT"
"""Set by `grpo run` on the processes it starts (the trainer, the servers): its own pid. The `grpo`
command started under it asks Linux for SIGTERM when that parent dies, even by SIGKILL
(grpo_api.cli). Not set up between fork and exec (preexec_fn), which would make the launcher fork
with its gRPC channels open (grpcio >= 1.80 aborts such children: grpc/grpc#43055)."""


def split_addresses(text: str) -> list[str]:
    """`a,b` -> [a, b]: a list of servers, each `host:port` or a `dns:///name:port` of several."""
    return [a.strip() for a in text.split(",") if a.strip()]


def reward_addresses(by_model: Mapping[str, str]) -> str:
    """{name: address} -> `name=address;...`, the value of REWARD_ADDRESSES_ENV."""
    return ";".join(f"{name}={address}" for name, address in by_model.items())


def parse_reward_addresses(text: str) -> dict[str, list[str]]:
    """`name=a,b;other=c` -> {name: [a, b], other: [c]}."""
    out: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, addrs = part.partition("=")
        if not sep or not name.strip() or not addrs.strip():
            raise ValueError(f"reward model addresses {part!r}: expected name=host:port[,host:port...]")
        out.setdefault(name.strip(), []).extend(split_addresses(addrs))
    return out
