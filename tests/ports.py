"""Loopback ports for the servers the tests start (S3, etcd, kube-apiserver, Prometheus, the
operator's probes, rollout servers): grpo_operator.local.reserve_port's, held by this test
process until it exits. A port picked and let go can be taken by another xdist worker's bind(0)
or outgoing connection before the server binds it; a held one can't, and every server here binds
with SO_REUSEADDR (Go's net.Listen, gRPC, http.server, aiohttp), which Linux allows beside it.

Imported as `ports` from every test folder (tests/ is on sys.path, as for `polling`)."""

from __future__ import annotations

import socket

from grpo_operator.local import reserve_port

_held: list[socket.socket] = []


def free_port() -> int:
    return reserve_port(_held)
