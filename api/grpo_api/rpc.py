"""gRPC plumbing shared by the trainer (client) and the rollout servers: message size limits,
the per-job token, TLS, the server-side check of the token and the client-side stub.

Every call carries `authorization: Bearer <token>` (docs/ARCHITECTURE.md §8). The token comes from the
environment (`GRPO_RPC_TOKEN`) or a file (`GRPO_RPC_TOKEN_FILE`, e.g. a mounted Secret); it is
never logged.

With TLS (on Kubernetes and under `grpo run`) the channel is encrypted and the server proves
who it is: a rollout server serves the certificate in `GRPO_TLS_CERT` / `GRPO_TLS_KEY`, which the
job's own CA signed, and the trainer trusts only that CA (`GRPO_TLS_CA`), checking the name
`GRPO_TLS_SERVER_NAME` in the certificate (it dials the pods' IPs). The token stays the
authorization. Without these variables both sides speak plaintext and say so in their logs.
No torch import here.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from grpo_api.proto import rollout_pb2, rollout_pb2_grpc

MiB = 1 << 20
CHUNK_BYTES = 64 * MiB
"""Weight bytes per UpdateWeights message: half the message limit, so the metadata that rides
on a bucket's first chunk always fits."""
MAX_MESSAGE_BYTES = 128 * MiB
"""Largest message either side sends or accepts (gRPC's default, 4 MiB, is too small for chunks)."""

AUTH_METADATA_KEY = "authorization"
TOKEN_ENV = "GRPO_RPC_TOKEN"
TOKEN_FILE_ENV = "GRPO_RPC_TOKEN_FILE"
TLS_CA_ENV = "GRPO_TLS_CA"
"""The job's CA certificate (PEM): the trainer accepts only rollout servers it signed."""
TLS_SERVER_NAME_ENV = "GRPO_TLS_SERVER_NAME"
"""The name the trainer checks in a server's certificate (it dials IPs, not that name)."""
TLS_CERT_ENV = "GRPO_TLS_CERT"
"""A rollout server's certificate (PEM), signed by the job's CA."""
TLS_KEY_ENV = "GRPO_TLS_KEY"
"""Its private key (PEM)."""

log = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Generate calls can run for many minutes without a byte on the wire: keepalive pings keep
    # idle connections through NATs and load balancers, and spot a dead peer.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted rollout server is back in seconds: don't let gRPC's reconnect backoff (up to
    # 120 s by default) keep failing calls to it.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


def channel_options() -> list[tuple[str, int]]:
    return list(_OPTIONS)


def server_options() -> list[tuple[str, int]]:
    # The server must accept the client's keepalive pings, or it answers them with GOAWAY.
    return list(_OPTIONS) + [("grpc.http2.min_ping_interval_without_data_ms", 10_000)]


def listen(server: grpc.Server, host: str, port: int, tls: "ServerTLS | None") -> int:
    """Bind `server` to host:port (TLS only with `tls`) and start it; the port bound (0 picks one)."""
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(tls.key, tls.cert)]))
    if not bound:
        raise OSError(f"can't listen on {host}:{port}")
    server.start()
    return bound


class TokenError(RuntimeError):
    """No usable token: the message says where one was looked for."""


def read_token(env: Mapping[str, str] | None = None) -> str:
    """The job's RPC token from `GRPO_RPC_TOKEN`, else from the file `GRPO_RPC_TOKEN_FILE` names."""
    env = os.environ if env is None else env
    token = env.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = env.get(TOKEN_FILE_ENV, "")
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise TokenError(f"{TOKEN_FILE_ENV}={path}: can't read the token file ({exc.strerror})") from None
        if token:
            return token
        raise TokenError(f"{TOKEN_FILE_ENV}={path}: the token file is empty")
    raise TokenError(f"no RPC token: set {TOKEN_ENV}, or {TOKEN_FILE_ENV} to a file holding it")


class TLSError(RuntimeError):
    """TLS material that can't be used: the message names the variable and why."""


@dataclass(frozen=True)
class ClientAuth:
    """What a client needs to call a job's rollout servers: the token and, for TLS, the CA."""

    token: str
    ca: bytes | None = None
    """The job's CA certificate (PEM); None: plaintext."""
    server_name: str | None = None
    """The name to check in the servers' certificate; None: the host dialled."""


@dataclass(frozen=True)
class ServerTLS:
    cert: bytes
    key: bytes


def _pem(env: Mapping[str, str], name: str, kind: str) -> bytes | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if "-----BEGIN " not in value or f"{kind}-----" not in value:      # "EC PRIVATE KEY" too
        raise TLSError(f"{name}: not a PEM {kind.lower()} (expected '-----BEGIN {kind}-----')")
    return value.encode() + b"\n"


def client_auth(env: Mapping[str, str] | None = None) -> ClientAuth:
    """The token, and the CA and server name when `GRPO_TLS_CA` is set."""
    env = os.environ if env is None else env
    token = read_token(env)
    ca = _pem(env, TLS_CA_ENV, "CERTIFICATE")
    if ca is None:
        log.warning("%s is not set: calls to the rollout servers are not encrypted", TLS_CA_ENV)
        return ClientAuth(token)
    return ClientAuth(token, ca, env.get(TLS_SERVER_NAME_ENV, "").strip() or None)


def server_tls(env: Mapping[str, str] | None = None) -> ServerTLS | None:
    """A server's certificate and key from `GRPO_TLS_CERT` and `GRPO_TLS_KEY`, None when both
    are unset (plaintext)."""
    env = os.environ if env is None else env
    cert, key = _pem(env, TLS_CERT_ENV, "CERTIFICATE"), _pem(env, TLS_KEY_ENV, "PRIVATE KEY")
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        missing = TLS_CERT_ENV if cert is None else TLS_KEY_ENV
        raise TLSError(f"{missing} is not set: TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
    return ServerTLS(cert, key)


def _bearer(token: str) -> str:
    return f"Bearer {token}"


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>` with
    UNAUTHENTICATED, before the servicer sees it."""

    def __init__(self, token: str):
        if not token:
            raise TokenError("the server's RPC token is empty")
        self._expected = _bearer(token).encode()

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
                # Constant time: the comparison must not tell an attacker how much was right.
                return hmac.compare_digest(got, self._expected)
        return False

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self._authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusing_handler(handler)


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    # The refusal must have the same streaming shape as the method it stands in for.
    def refuse(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong RPC token")

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse, **kw)


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor,
                     grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every outgoing call."""

    def __init__(self, token: str):
        self._pair = (AUTH_METADATA_KEY, _bearer(token))

    def _details(self, details):
        metadata = list(details.metadata or ()) + [self._pair]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata):
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


ROUND_ROBIN = ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}')
"""For a `dns:///` name of several servers (a reward model's headless Service): calls spread over
every address it resolves to, and skip one whose connection failed (gRPC's default, pick_first,
sends everything to one)."""


def rollout_channel(address: str, auth: ClientAuth | str, *, round_robin: bool = False) -> grpc.Channel:
    """A channel to one rollout server that sends the token on every call: TLS when `auth` has
    the job's CA, else plaintext (a bare token is plaintext). Close it when done."""
    auth = ClientAuth(auth) if isinstance(auth, str) else auth
    base = channel_options() + ([ROUND_ROBIN] if round_robin else [])
    if auth.ca is None:
        channel = grpc.insecure_channel(address, options=base)
    else:
        options = list(base)
        if auth.server_name:
            options.append(("grpc.ssl_target_name_override", auth.server_name))
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=auth.ca), options=options)
    return grpc.intercept_channel(channel, _TokenMetadata(auth.token))


def rollout_stub(address: str, auth: ClientAuth | str) -> rollout_pb2_grpc.RolloutStub:
    """A Rollout client for `host:port`. The channel closes when the stub is garbage-collected;
    use `rollout_channel` to close it explicitly."""
    return rollout_pb2_grpc.RolloutStub(rollout_channel(address, auth))


class RolloutClients:
    """One channel per rollout server, shared by every caller on the trainer's side (Generate,
    Health, Info and the weight-sync calls), thread-safe. `forget` drops a server's channel after
    a failure, so the next call connects afresh; calls still in flight on it finish (a channel
    closes when its last stub is gone)."""

    def __init__(self, auth: ClientAuth | str):
        self._auth = auth
        self._stubs: dict[str, rollout_pb2_grpc.RolloutStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def __call__(self, address: str) -> rollout_pb2_grpc.RolloutStub:
        with self._lock:
            if address not in self._stubs:
                self._channels[address] = rollout_channel(address, self._auth)
                self._stubs[address] = rollout_pb2_grpc.RolloutStub(self._channels[address])
            return self._stubs[address]

    def health(self, address: str, timeout: float = 10) -> rollout_pb2.HealthReply:
        return self(address).Health(rollout_pb2.HealthRequest(), timeout=timeout)

    def info(self, address: str, timeout: float = 30) -> rollout_pb2.InfoReply:
        return self(address).Info(rollout_pb2.InfoRequest(), timeout=timeout)

    def forget(self, address: str) -> None:
        with self._lock:
            self._stubs.pop(address, None)
            self._channels.pop(address, None)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._stubs.clear()
            self._channels.clear()
