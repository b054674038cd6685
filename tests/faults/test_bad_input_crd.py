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
import sys
from pathlib import Path

import yaml

import pytest

from unit.test_spec import INVALID_SPECS, job_with

pytestmark = [pytest.mark.faults, pytest.mark.controlplane]
REPO = Path(__file__).resolve().parents[2]


def _kubectl(kubectl_bin, cp, *args, stdin: str | None = None):
    return subprocess.run([kubectl_bin, "--kubeconfig", str(cp.kubeconfig), *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def _body(name: str, changes: dict) -> dict:
    # A cluster job needs storage every pod reaches (refused otherwise: see below).
    changes = {"storage.uri": "s3://bucket/runs", **changes}
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
        elif any(v < 1 for k, v in changes.items() if k.endswith(("BatchSize", "rollout.n")) and isinstance(v, int)) \
                and "must divide" in out.stderr:     # a bad batch size is its own error, no cross-field noise
            problems.append(f"{name} {changes}: a spurious cross-field error: {out.stderr.strip()}")
    assert not problems, "\n".join(problems)
    # kinds of refusal: the OpenAPI schema, a CEL rule (a cross-field rule's message), strict field validation
    stderr = "\n".join(out.stderr for _, _, out in refused.values())
    assert "should be greater than or equal to 1" in stderr           # schema bound
    assert "rollout.n must be >= 2 for group estimators" in stderr    # CEL, with its fieldPath
    assert 'unknown field "spec.rollout.temprature"' in stderr        # strict decoding
    # nothing was created
    got = _kubectl(kubectl_bin, control_plane, "get", "grpojobs", "-n", namespace, "-o", "name")
    assert got.returncode == 0 and got.stdout.strip() == "", got.stdout


# --- what only a cluster job must keep (issue 22) ----------------------------------------------------

def _apply(kubectl_bin, cp, namespace, text: str):
    return _kubectl(kubectl_bin, cp, "apply", "-n", namespace, "-f", "-", stdin=text)


def test_a_job_without_storage_every_pod_reaches_is_refused_at_apply(grpojob_crd, control_plane, kubectl_bin,
                                                                      namespace):
    """`grpo run` defaults the storage to ./outputs; pods have no shared folder, so the API server
    refuses the job before anything is created (not the operator, after `created`)."""
    quickstart = (REPO / "examples" / "quickstart.yaml").read_text()
    for text in (quickstart, json.dumps(_body("relative", {"storage.uri": "file://runs"}))):
        out = _apply(kubectl_bin, control_plane, namespace, text)
        assert out.returncode != 0, out.stdout
        assert "spec.storage.uri" in out.stderr and "required on Kubernetes" in out.stderr, out.stderr
    ok = _apply(kubectl_bin, control_plane, namespace, json.dumps(_body("absolute", {"storage.uri": "file:///mnt/runs"})))
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("length", [51, 64])
def test_an_over_long_name_is_refused_at_apply(grpojob_crd, control_plane, kubectl_bin, namespace, length):
    out = _apply(kubectl_bin, control_plane, namespace, json.dumps(_body("x" * length, {})))
    assert out.returncode != 0, out.stdout
    assert "<nil>" not in out.stderr and "metadata.name: Invalid value" in out.stderr, out.stderr
    assert "metadata.name must be at most 50 characters" in out.stderr, out.stderr
    fits = _apply(kubectl_bin, control_plane, namespace, json.dumps(_body("x" * 50, {})))
    assert fits.returncode == 0, fits.stderr


def test_a_bare_n_key_is_caught_by_grpo_validate_as_kubectl_would_refuse_it(grpojob_crd, control_plane,
                                                                           kubectl_bin, namespace, tmp_path):
    # spec is the document's last key: the appended section is spec.rollout
    text = yaml.safe_dump(_body("bare-n", {}), sort_keys=False) + "  rollout:\n    n: 5\n"
    path = tmp_path / "job.yaml"
    path.write_text(text)
    refused = _apply(kubectl_bin, control_plane, namespace, text)
    assert refused.returncode != 0 and "spec.rollout.false" in refused.stderr, refused.stderr
    out = subprocess.run([sys.executable, "-m", "grpo_api.cli", "validate", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1, out.stdout
    assert 'spec.rollout.n: quote the key, "n": 5 (line ' in out.stderr, out.stderr
    assert "spec.rollout.false" in out.stderr
    path.write_text(text.replace("    n: 5", '    "n": 5'))
    quoted = subprocess.run([sys.executable, "-m", "grpo_api.cli", "validate", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert quoted.returncode == 0, quoted.stderr
    explain = _kubectl(kubectl_bin, control_plane, "explain", "grpojob.spec.rollout.n")
    assert explain.returncode == 0 and 'Quote the key in YAML, `"n": 8`' in " ".join(explain.stdout.split()), \
        explain.stdout
