"""TLS between the trainer and a rollout server (issue 24), on a real `grpo rollout` process
serving the job's certificate, as on Kubernetes: the certificate is for the rollout Service's
names only, and the trainer dials the pod's IP and checks the Service's name.

- Generate and the gRPC weight sync work over TLS (the weights arrive: greedy output equals
  the pushed weights' own);
- a plaintext client, a client that doesn't trust the job's CA (the system's roots, another
  job's CA) and one that expects another name are refused before any call reaches the server;
- the token is still the authorization: TLS with a wrong token is UNAUTHENTICATED.
"""

from __future__ import annotations

import secrets

import grpc
import pytest

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.proto.rollout_pb2_grpc import RolloutStub
from grpo_api.rpc import ClientAuth, RolloutClients, channel_options, rollout_stub
from grpo_operator import names
from grpo_operator.pki import make_job_tls
from grpo_trainer.weight_sync import GrpcWeightSender, WeightSyncError

from .conftest import chat_prompt, start_server
from .test_weight_sync import BUCKET_BYTES, CHUNK_BYTES, greedy_from_server, greedy_reference, trained_weights

pytestmark = pytest.mark.integration

SERVICE_NAME = names.rollout_dns_names("tls-test", "team-a")[0]     # tls-test-rollout.team-a.svc


@pytest.fixture(scope="module")
def token():
    return secrets.token_hex(16)


@pytest.fixture(scope="module")
def job_tls():
    return make_job_tls("tls-test", names.rollout_dns_names("tls-test", "team-a"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model, token, job_tls):
    srv = start_server(tmp_path_factory.mktemp("tls"), tiny_model, token,
                       env={"GRPO_TLS_CERT": job_tls.cert, "GRPO_TLS_KEY": job_tls.key})
    srv.auth = _auth(token, job_tls)          # what the trainer dials with
    yield srv
    srv.stop()


def _auth(token: str, job_tls, server_name: str = SERVICE_NAME) -> ClientAuth:
    return ClientAuth(token, job_tls.ca_cert.encode(), server_name)


def _health(stub) -> pb.HealthReply:
    return stub.Health(pb.HealthRequest(), timeout=10)


def test_generate_and_the_weight_sync_work_over_tls(server, token, job_tls, tokenizer, tmp_path):
    assert server.info["tls"] is True
    assert _health(server.stub()).ready
    prompts = [chat_prompt(tokenizer, "copy the digit 4"), chat_prompt(tokenizer, "the answer is 9 and 2")]
    version = _health(server.stub()).policy_version
    before = greedy_from_server(server, prompts, version, tmp_path)
    weights, engine = trained_weights(tmp_path, seed=3)
    expected = greedy_reference(engine, prompts)
    assert expected != before
    sender = GrpcWeightSender(RolloutClients(_auth(token, job_tls)), bucket_bytes=BUCKET_BYTES, chunk_bytes=CHUNK_BYTES)
    try:
        report = sender.send([server.address], weights.items(), version + 1)
    finally:
        sender.close()
    assert report.version == version + 1 and report.resent == {}
    assert greedy_from_server(server, prompts, version + 1, tmp_path) == expected


def _unavailable(stub) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _health(stub)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    return err.value.details()


def test_clients_without_tls_or_the_jobs_ca_or_name_are_refused(server, token, job_tls, tmp_path):
    version = _health(rollout_stub(server.address, _auth(token, job_tls))).policy_version
    # plaintext (the right token): the server speaks only TLS
    _unavailable(rollout_stub(server.address, token))
    # TLS trusting the system's CAs, or another job's CA: the server's certificate isn't trusted
    system_roots = grpc.secure_channel(server.address, grpc.ssl_channel_credentials(),
                                       options=[*channel_options(), ("grpc.ssl_target_name_override", SERVICE_NAME)])
    _unavailable(RolloutStub(system_roots))
    other = make_job_tls("other", names.rollout_dns_names("other", "team-a"))
    _unavailable(rollout_stub(server.address, _auth(token, other)))
    # the job's CA, but expecting another job's service: the name doesn't match
    _unavailable(rollout_stub(server.address, _auth(token, job_tls, names.rollout_dns_names("other", "team-a")[0])))
    # a weight push over plaintext fails and changes nothing
    sender = GrpcWeightSender(RolloutClients(token), bucket_bytes=BUCKET_BYTES, chunk_bytes=CHUNK_BYTES)
    weights, _ = trained_weights(tmp_path, seed=4)
    try:
        with pytest.raises(WeightSyncError):
            sender.send([server.address], weights.items(), version + 7)
    finally:
        sender.close()
    assert _health(rollout_stub(server.address, _auth(token, job_tls))).policy_version == version
    # TLS and the job's CA, but a wrong token: the token is still the authorization
    with pytest.raises(grpc.RpcError) as err:
        _health(rollout_stub(server.address, _auth("wrong-" + token, job_tls)))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
