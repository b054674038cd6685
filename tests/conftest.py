"""Shared fixtures. Tests that need a real server (Kubernetes control plane, S3) get it from a
session fixture; see tests/controlplane and tests/rollout."""
