"""The invalid specs of tests/unit/test_spec.py at `kubectl apply`, through the generated CRD on
a real kube-apiserver (issue 12): each is refused by the API server itself (OpenAPI schema, or a
CEL rule for cross-field checks) with a message naming the field, and nothing is created.

Rules that depend on defaults: the CRD gives every spec section a default of {} so the API
server fills in field defaults before CEL runs. So `rollout.n: 1` alone is refused because
`algorithm.advEstimator` defaults to grpo; `microBatchSizePerGPU: 41` because `rollout.n`
defaults to 5 (8 x 5 = 40 responses per mini-batch); `nprocPerNode: 3` for the same 40;
`maxTokensPerGPU: 100` because the lengths default to 512 + 512; `policyLoss: gspo` because
`lossAggMode` defaults to token-mean.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from unit.test_spec import INVALID_SPECS, job_with

pytestmark = [pytest.mark.faults, pytest.mark.controlplane]


def _kubectl(kubectl_bin, cp, *args, stdin: str | None = None):
    return subprocess.run([kubectl_bin, "--kubeconfig", str(cp.kubeconfig), *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def _body(name: str, changes: dict) -> dict:
    return {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": name}, **job_with(**changes)}


def test_every_invalid_spec_is_refused_by_the_api_server_naming_the_field(grpojob_crd, control_plane, kubectl_bin,
                                                                          namespace, tmp_path):
    assert len(INVALID_SPECS) >= 30
    # the baseline the table changes is a valid job: the API server takes it
    ok = _kubectl(kubectl_bin, control_plane, "apply", "-n", namespace, "--dry-run=server", "-f", "-",
                  stdin=json.dumps(_body("baseline", {})))
    assert ok.returncode == 0, ok.stderr
    refused = {}
    for k, (changes, field, _) in enumerate(INVALID_SPECS):
        name = f"bad-{k:02d}"
        # JSON, not YAML: kubectl's YAML 1.1 would turn some values (e.g. "yes") into booleans
        out = _kubectl(kubectl_bin, control_plane, "apply", "-n", namespace, "-f", "-",
                       stdin=json.dumps(_body(name, changes)))
        refused[name] = (changes, field, out)
    problems = []
    for name, (changes, field, out) in refused.items():
        if out.returncode == 0:
            problems.append(f"{name} {changes}: accepted ({out.stdout.strip()})")
        elif field not in out.stderr:
            problems.append(f"{name} {changes}: refused without naming {field}: {out.stderr.strip()}")
    assert not problems, "\n".join(problems)
    # kinds of refusal: the OpenAPI schema, a CEL rule (a cross-field rule's message), strict field validation
    stderr = "\n".join(out.stderr for _, _, out in refused.values())
    assert "should be greater than or equal to 1" in stderr           # schema bound
    assert "rollout.n must be >= 2 for group estimators" in stderr    # CEL, with its fieldPath
    assert 'unknown field "spec.rollout.temprature"' in stderr        # strict decoding
    # nothing was created
    got = _kubectl(kubectl_bin, control_plane, "get", "grpojobs", "-n", namespace, "-o", "name")
    assert got.returncode == 0 and got.stdout.strip() == "", got.stdout
