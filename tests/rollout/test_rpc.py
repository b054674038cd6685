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
