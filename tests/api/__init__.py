"""Tests of grpo_api, the contract the other packages share: storage, records, the gRPC stubs and
tokens, the weight-sync plan."""
