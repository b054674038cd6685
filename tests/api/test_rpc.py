"""Where the RPC token comes from (grpo_api.rpc)."""

import pytest

from grpo_api.rpc import TokenError, read_token


def test_token_from_env_or_file(tmp_path):
    assert read_token({"GRPO_RPC_TOKEN": " abc \n"}) == "abc"
    secret = tmp_path / "token"
    secret.write_text("from-a-secret\n")
    assert read_token({"GRPO_RPC_TOKEN_FILE": str(secret)}) == "from-a-secret"
    with pytest.raises(TokenError, match="set GRPO_RPC_TOKEN"):
        read_token({})
    with pytest.raises(TokenError, match="can't read the token file"):
        read_token({"GRPO_RPC_TOKEN_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("")
    with pytest.raises(TokenError, match="empty"):
        read_token({"GRPO_RPC_TOKEN_FILE": str(tmp_path / "empty")})


def test_tls_material_that_cannot_be_used_names_the_variable():
    from grpo_api.rpc import TLSError, client_auth, server_tls
    from grpo_operator.pki import make_job_tls
    tls = make_job_tls("j", ["j-rollout.ns.svc"])
    assert server_tls({}) is None                                   # plaintext, said in the server's log
    assert server_tls({"GRPO_TLS_CERT": tls.cert, "GRPO_TLS_KEY": tls.key}).key.startswith(b"-----BEGIN PRIVATE KEY")
    with pytest.raises(TLSError, match="GRPO_TLS_KEY is not set: TLS needs both GRPO_TLS_CERT and GRPO_TLS_KEY"):
        server_tls({"GRPO_TLS_CERT": tls.cert})
    with pytest.raises(TLSError, match=r"GRPO_TLS_KEY: not a PEM private key"):
        server_tls({"GRPO_TLS_CERT": tls.cert, "GRPO_TLS_KEY": "/etc/grpo/tls.key"})
    with pytest.raises(TLSError, match=r"GRPO_TLS_CA: not a PEM certificate"):
        client_auth({"GRPO_RPC_TOKEN": "t", "GRPO_TLS_CA": tls.key})
    auth = client_auth({"GRPO_RPC_TOKEN": "t", "GRPO_TLS_CA": tls.ca_cert, "GRPO_TLS_SERVER_NAME": "j-rollout.ns.svc"})
    assert auth.ca.startswith(b"-----BEGIN CERTIFICATE") and auth.server_name == "j-rollout.ns.svc"
