"""Security properties (issue 12, docs/ARCHITECTURE.md §8) checked on real processes and a real control
plane: oversize gRPC messages are refused; no secret (the RPC token, the S3 secret key, the TLS
private key, the checkpoint key) reaches a log, a file of the run, the object store or /metrics,
and each process gets only its own; the operator's ServiceAccount is denied what it doesn't need;
nothing from the network is unpickled.

Covered elsewhere, not repeated here: calls without / with a wrong token are UNAUTHENTICATED
(tests/rollout/test_server.py::test_calls_without_the_right_token_are_refused); the token is
only in the Secret, never in the spec ConfigMap or another child
(tests/operator/test_operator_manifests.py::test_secrets_only_in_the_secret_and_each_role_gets_its_own); pods are non-root
without privilege escalation (…::test_pods_are_locked_down); the NetworkPolicy
(…::test_rollout_network_policy_admits_the_trainer_scrapers_and_nccl_peers); the chart's RBAC rules are exactly the operator's calls
(tests/chart/test_chart.py::test_rbac_is_least_privilege).
"""

from __future__ import annotations

import ast
import json
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from controlplane.conftest import helm_bin
from faults_helpers import Hold, S3Process
from grpo_api.proto import rollout_pb2 as pb
from grpo_api.proto.rollout_pb2_grpc import RolloutStub
from grpo_api.rpc import AUTH_METADATA_KEY, MAX_MESSAGE_BYTES, rollout_stub
from integration_helpers import (READY_PREFIX, LauncherRun, cmdline, descendants, start_rollout_servers, wait_until,
                                 write_job)

pytestmark = [pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
PRODUCT = [REPO / d for d in ("api", "operator", "trainer_image", "rollout_image")]


# --- gRPC message size ----------------------------------------------------------------------------

@pytest.mark.integration
def test_oversize_messages_are_refused_and_the_server_goes_on(tmp_path, tiny_model, train_data, token):
    job = write_job(tmp_path / "job.yaml", name="oversize", model=tiny_model, train=train_data,
                    storage=tmp_path / "store", rollout={"replicas": 1})
    (server,) = start_rollout_servers(job, token, 1, tmp_path)
    try:
        # a client without a send limit (not ours): the server refuses what is over its limit
        channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)])
        raw = RolloutStub(channel)
        auth = [(AUTH_METADATA_KEY, f"Bearer {token}")]
        huge = "x" * (MAX_MESSAGE_BYTES + (1 << 20))
        with pytest.raises(grpc.RpcError) as err:
            raw.Generate(pb.GenerateRequest(request_id=huge, prompt_uri="file:///p", output_uri="file:///o"),
                         metadata=auth, timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        # a streamed weight chunk too (UpdateWeights is where big messages belong)
        with pytest.raises(grpc.RpcError) as err:
            raw.UpdateWeights(iter([pb.WeightChunk(version=1, num_buckets=1, data=huge.encode(), last_in_bucket=True)]),
                              metadata=auth, timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        del huge
        channel.close()
        # our own client doesn't even send it
        with pytest.raises(grpc.RpcError) as err:
            rollout_stub(server.address, token).Generate(
                pb.GenerateRequest(request_id="y" * (MAX_MESSAGE_BYTES + 1), prompt_uri="p", output_uri="o"), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # nothing was applied, the server is still serving
        health = server.health()
        assert health.ready and health.policy_version == 0
    finally:
        server.stop()


# --- no secret in logs, files, objects or metrics -------------------------------------------------------

@pytest.mark.s3
@pytest.mark.integration
def test_no_secret_in_logs_files_objects_or_metrics(tmp_path, tiny_model, train_data, s3, monkeypatch):
    """`grpo run` on S3 storage, with the S3 secret key and an RPC token in its environment set
    to recognisable values. The launcher gives its processes a fresh token of its own: that one
    is read from a rollout server's environment during the run, with its TLS key. None of these,
    nor the run's checkpoint key (in <run>/checkpoint.key, 0600, alone), may appear in the
    launcher's output, any file of the run (spec, logs), any object the run wrote (parquet
    shards, checkpoints, metrics, progress) or the rollout server's /metrics. The rollout server
    serves TLS and never gets the checkpoint key; the trainer gets the CA, not the TLS key."""
    hold = Hold(tmp_path / "hold")
    job = write_job(tmp_path / "job.yaml", name="secrets", model=tiny_model, train=train_data, storage=tmp_path,
                    reward={"function": hold.function, "workers": 1, "timeoutSeconds": 600},
                    rollout={"replicas": 1},
                    trainer={"nprocPerNode": 1, "totalSteps": 3, "saveFreq": 2,
                             "loggers": ["console", "jsonl", "tensorboard", "prometheus"]})
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["storage"] = {"uri": f"s3://{S3Process.BUCKET}/runs", "endpoint": s3.endpoint, "secretRef": "s3-creds"}
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    given_token = "grpo-token-GIVEN-a1b2c3d4e5"
    for key, value in {**s3.env(), "GRPO_RPC_TOKEN": given_token}.items():
        monkeypatch.setenv(key, value)                     # LauncherRun passes the environment on
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run = LauncherRun(job, cwd, tmp_path / "cache", [])
    try:
        server_pid = wait_until(lambda: next((p for p in descendants(run.proc.pid)
                                              if "rollout" in cmdline(p) and "--spec" in cmdline(p)), None), 120,
                                what="the rollout server")
        hold.arm(server_pid, after=4 * 4)                  # held in step 2: the run is in full swing
        hold.wait_holding(server_pid, 300, also=lambda: run.proc.poll() is not None)
        environ = _environ(server_pid)
        token = environ["GRPO_RPC_TOKEN"]
        trainer_pid = next(p for p in descendants(run.proc.pid) if "trainer" in cmdline(p) and "--spec" in cmdline(p))
        trainer_env = _environ(trainer_pid)
        local_root = cwd / "outputs" / "it" / "secrets"
        ready = next(ln for ln in (local_root / "logs" / "rollout-0.log").read_text().splitlines()
                     if ln.startswith(READY_PREFIX))
        port = json.loads(ready[len(READY_PREFIX):])["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read()                             # step 1 counted, step 2 in flight
        hold.release()
        code = run.wait(300)
    finally:
        hold.release()
        if run.proc.poll() is None:
            run.kill_tree()
    assert code == 0, run.log()[-6000:]
    assert token != given_token and len(token) >= 32        # a fresh random token, not the one given
    assert json.loads(ready[len(READY_PREFIX):])["tls"] is True
    key_file = local_root / "checkpoint.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    checkpoint_key = key_file.read_text().strip()
    assert "GRPO_CHECKPOINT_KEY" not in environ and "GRPO_TLS_CA" not in environ
    assert trainer_env["GRPO_CHECKPOINT_KEY"] == checkpoint_key and "BEGIN CERTIFICATE" in trainer_env["GRPO_TLS_CA"]
    assert "GRPO_TLS_KEY" not in trainer_env and trainer_env["GRPO_RPC_TOKEN"] == token
    tls_key = "".join(environ["GRPO_TLS_KEY"].strip().splitlines()[1:-1])      # the PEM's base64 body
    secrets_ = {"RPC token": token.encode(), "given RPC token": given_token.encode(),
                "S3 secret key": S3Process.SECRET.encode(), "TLS private key": tls_key.encode(),
                "checkpoint key": checkpoint_key.encode()}
    haystacks: dict[str, bytes] = {"launcher output": run.log().encode(), "rollout /metrics": metrics}
    assert b"grpo_rollout_samples_total" in metrics
    for path in local_root.rglob("*"):
        if path.is_file() and path != key_file:
            haystacks[str(path)] = path.read_bytes()
    storage = s3.storage()
    objects = [u for u in storage.list(f"s3://{S3Process.BUCKET}/runs", recursive=True) if not storage.list(u)]
    for uri in objects:
        haystacks[uri] = storage.read_bytes(uri)
    names = set(haystacks)
    assert {str(local_root / "job.yaml"), str(local_root / "logs" / "rollout-0.log")} <= names
    for kind in ("progress.json", "metrics.jsonl", "/prompts/step-1/", "/rollouts/step-1/", "/checkpoints/step-2/",
                 "/hf/step-3/"):
        assert any(kind in name for name in names), (kind, sorted(names))
    leaks = [f"{what} in {where}" for where, data in haystacks.items() for what, secret in secrets_.items()
             if secret in data]
    assert not leaks, leaks


def _environ(pid: int) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)


# --- the operator's ServiceAccount, with the chart's RBAC, on a real API server ------------------------

@pytest.mark.controlplane
def test_the_operator_service_account_is_denied_what_it_does_not_need(control_plane, kubectl_bin, admin_client,
                                                                       grpojob_crd):
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    ns, release = "grpo-faults-system", "faults"
    rbac = subprocess.run([helm_bin(), "template", release, str(REPO / "charts" / "grpo-operator"), "--namespace", ns,
                           "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"],
                          capture_output=True, text=True, check=True, timeout=60).stdout
    core = client.CoreV1Api(admin_client)
    core.create_namespace({"metadata": {"name": ns}})
    other = "grpo-faults-other"
    core.create_namespace({"metadata": {"name": other}})
    core.create_namespaced_secret(other, {"metadata": {"name": "s3-creds"}, "stringData": {"k": "v"}})
    subprocess.run([kubectl_bin, "--kubeconfig", str(control_plane.kubeconfig), "apply", "-f", "-"], input=rbac,
                   text=True, check=True, capture_output=True, timeout=60)
    account = f"{release}-grpo-operator"
    sa = config.new_client_from_config(config_file=str(control_plane.kubeconfig_for_service_account(ns, account)))
    try:
        as_core, as_rbac = client.CoreV1Api(sa), client.RbacAuthorizationV1Api(sa)
        # what it needs works (RBAC bindings take a moment to reach the authorizer)
        custom = client.CustomObjectsApi(sa)
        wait_until(lambda: _allowed(lambda: custom.list_cluster_custom_object("grpo.dev", "v1alpha1", "grpojobs")),
                   30, what="the operator's RoleBinding")
        as_core.create_namespaced_secret(other, {"metadata": {"name": "rpc"}, "stringData": {"token": "t"}})
        denied = {
            "delete nodes": lambda: as_core.delete_node("any-node"),
            "list nodes": lambda: as_core.list_node(),
            "read a secret in another namespace": lambda: as_core.read_namespaced_secret("s3-creds", other),
            "list secrets cluster-wide": lambda: as_core.list_secret_for_all_namespaces(),
            "read its own namespace's secrets": lambda: as_core.list_namespaced_secret(ns),
            "create pods": lambda: as_core.create_namespaced_pod(other, {
                "metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}),
            "exec into pods": lambda: as_core.connect_post_namespaced_pod_exec("p", other, command=["true"]),
            "delete namespaces": lambda: as_core.delete_namespace(other),
            "bind cluster-admin to itself": lambda: as_rbac.create_cluster_role_binding({
                "metadata": {"name": "escalate"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}]}),
            "change its own ClusterRole": lambda: as_rbac.patch_cluster_role(account, {"rules": []}),
            "delete CRDs": lambda: client.ApiextensionsV1Api(sa).delete_custom_resource_definition("grpojobs.grpo.dev"),
            "read service account tokens": lambda: as_core.create_namespaced_service_account_token(account, ns, {
                "spec": {"audiences": ["x"]}}),
        }
        problems = []
        for what, call in denied.items():
            try:
                call()
                problems.append(f"{what}: allowed")
            except ApiException as exc:          # refused by RBAC, before anything else is looked at
                if exc.status != 403 or f"system:serviceaccount:{ns}:{account}" not in exc.body:
                    problems.append(f"{what}: {exc.status} {exc.reason}, not 403 Forbidden for the account")
        assert not problems, problems
        assert core.read_namespaced_secret("s3-creds", other).data   # still there
    finally:
        sa.close()
        core.delete_namespace(other)


def _allowed(call) -> bool:
    from kubernetes.client.rest import ApiException
    try:
        call()
        return True
    except ApiException as exc:
        assert exc.status == 403, exc
        return False


# --- nothing from the network is unpickled (static) --------------------------------------------------

_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
_OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list"}


def _unsafe_calls(source: str, filename: str) -> tuple[list[str], int]:
    """(findings, torch.load calls seen) in one module."""
    found, loads = [], 0
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLE_MODULES:
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            kwargs = {k.arg: k.value for k in node.keywords}
            last = name.rsplit(".", 1)[-1]
            if last == "load" and name.split(".")[0] == "torch":
                loads += 1
                value = kwargs.get("weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    found.append(f"{where}: {ast.unparse(node)} without weights_only=True")
            elif last in _OBJECT_COLLECTIVES:
                found.append(f"{where}: {name} pickles objects over the process group")
            elif last in ("read_pickle", "unsafe_load", "full_load") or name in ("yaml.load", "np.load", "numpy.load"):
                if name in ("np.load", "numpy.load"):
                    value = kwargs.get("allow_pickle")
                    if not (isinstance(value, ast.Constant) and value.value is True):
                        continue
                found.append(f"{where}: {ast.unparse(node)}")
    return found, loads


def test_the_scanner_finds_what_it_looks_for():
    bad = ("import pickle\nfrom dill import loads\nimport torch, yaml\nimport torch.distributed as dist\n"
           "torch.load(f)\ntorch.load(f, weights_only=False)\ndist.broadcast_object_list([x])\n"
           "yaml.load(s)\nyaml.unsafe_load(s)\nnp.load(f, allow_pickle=True)\n")
    found, loads = _unsafe_calls(bad, "bad.py")
    assert len(found) == 8 and loads == 2, found
    assert _unsafe_calls("torch.load(f, weights_only=True)\nyaml.safe_load(s)\nnp.load(f)\n", "ok.py") == ([], 1)


def test_nothing_from_the_network_is_unpickled():
    """Product code never unpickles: no pickle-family imports, torch.load only with
    weights_only=True, no object collectives (the trainer broadcasts JSON), no unsafe YAML.
    (torch.distributed.checkpoint itself unpickles its .metadata file: see docs/RELIABILITY.md.)"""
    files = [p for root in PRODUCT for p in root.rglob("*.py") if "proto" not in p.parts]
    assert len(files) > 40
    findings, loads = [], 0
    for path in files:
        found, n = _unsafe_calls(path.read_text(), str(path.relative_to(REPO)))
        findings += found
        loads += n
    assert not findings, findings
    assert loads >= 1          # the one torch.load there is (checkpoint export) was inspected
