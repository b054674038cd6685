"""The control plane behaves like a real cluster, and the project's CRD works on it.

These are the guarantees the operator's own control-plane tests lean on: real version, real
schema validation, real Job controller, real garbage collection, real RBAC.
"""

import copy
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from polling import wait_until

from .cluster import retry

pytestmark = pytest.mark.controlplane

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "grpojob.yaml"
GROUP, VERSION, PLURAL = "grpo.dev", "v1alpha1", "grpojobs"


def eventually(check, timeout=60.0, interval=0.5, what="condition"):
    """Polls check() until it returns something truthy; controllers act asynchronously."""
    return wait_until(check, timeout, interval, what)


def kubectl(kubectl_bin, control_plane, *args, check=True):
    r = subprocess.run([kubectl_bin, "--kubeconfig", str(control_plane.kubeconfig), *args],
                       capture_output=True, text=True, timeout=120)
    if check and r.returncode:
        pytest.fail(f"kubectl {' '.join(args)} failed ({r.returncode}):\n{r.stderr}", pytrace=False)
    return r


@pytest.fixture(scope="module")
def grpojob_crd(control_plane, kubectl_bin):
    if not CRD_FILE.exists():
        pytest.fail(f"{CRD_FILE} is missing (generate it with `grpo crd`)", pytrace=False)
    kubectl(kubectl_bin, control_plane, "apply", "--server-side", "-f", str(CRD_FILE))
    # kubectl wait errors out (instead of waiting) while a new CRD's status.conditions is still null.
    retry(lambda: kubectl(kubectl_bin, control_plane, "wait", "--for=condition=Established",
                          f"crd/{PLURAL}.{GROUP}", "--timeout=60s"))
    return CRD_FILE


def valid_grpojob(name: str) -> dict:
    """The quickstart example (it must pass the schema) with the storage a cluster job needs."""
    body = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    body["metadata"] = {"name": name}
    body["spec"]["storage"] = {"uri": "s3://bucket/runs"}
    return body


def test_version_is_the_pinned_release(admin_client):
    info = client.VersionApi(admin_client).get_code()
    assert (info.git_version, info.major, info.minor) == ("v1.37.2", "1", "37")


def test_crd_applies_and_kubectl_explains_it(grpojob_crd, control_plane, kubectl_bin):
    # The OpenAPI that explain reads is published a moment after the CRD is Established.
    out = eventually(lambda: kubectl(kubectl_bin, control_plane, "explain", "grpojob.spec",
                                     check=False).stdout, what="kubectl explain grpojob.spec")
    for field in ("model", "data", "algorithm", "rollout", "trainer"):
        assert field in out


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_apply_with_kubectl(grpojob_crd, control_plane, kubectl_bin, namespace, example):
    # kubectl reads YAML as YAML 1.1, unlike Python: an unquoted key like `n` becomes `false`.
    # `grpo run` jobs (no storage.uri: their storage is ./outputs) are refused on Kubernetes
    laptop = not (yaml.safe_load(example.read_text())["spec"].get("storage") or {}).get("uri")
    out = kubectl(kubectl_bin, control_plane, "apply", "--dry-run=server", "-n", namespace, "-f", str(example),
                  check=not laptop)
    if laptop:   # refused on Kubernetes: their default storage is a local folder
        assert out.returncode != 0 and "spec.storage.uri" in out.stderr, out.stderr


def test_grpojob_round_trips(grpojob_crd, admin_client, namespace):
    api = client.CustomObjectsApi(admin_client)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, valid_grpojob("demo"))
    got = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "demo")
    assert got["kind"] == "GRPOJob" and got["metadata"]["namespace"] == namespace
    assert got["spec"]["model"]["path"] == valid_grpojob("demo")["spec"]["model"]["path"]


def test_invalid_grpojob_is_refused_by_the_schema(grpojob_crd, admin_client, namespace):
    bad = copy.deepcopy(valid_grpojob("bad"))
    bad["spec"].setdefault("data", {})["trainBatchSize"] = -3
    api = client.CustomObjectsApi(admin_client)
    with pytest.raises(ApiException) as refused:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)
    assert refused.value.status == 422
    assert "spec.data.trainBatchSize" in refused.value.body
    with pytest.raises(ApiException) as absent:
        api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "bad")
    assert absent.value.status == 404
    # a cross-field rule (CEL): a custom agent loop and the tool agent loop exclude each other
    both = copy.deepcopy(valid_grpojob("both"))
    both["spec"].setdefault("rollout", {}).update({"agentLoop": "my_env:Game", "multiTurn": {
        "enable": True, "tools": ["grpo_rollout.tool_task:lookup"]}})
    with pytest.raises(ApiException) as refused:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, both)
    assert refused.value.status == 422 and "rollout.agentLoop and rollout.multiTurn.enable exclude each other" \
        in refused.value.body


def test_colocated_replicas_are_derived_and_scaling_is_refused(grpojob_crd, admin_client, namespace):
    # issue 46: with placement colocated, rollout.replicas is nnodes x nprocPerNode / tensorParallelSize
    api = client.CustomObjectsApi(admin_client)
    wrong = copy.deepcopy(valid_grpojob("colocated-wrong"))
    wrong["spec"]["rollout"].update({"placement": "colocated", "replicas": 1})
    wrong["spec"]["trainer"].update({"nprocPerNode": 2, "microBatchSizePerGPU": 4})
    with pytest.raises(ApiException) as refused:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, wrong)
    assert refused.value.status == 422 and "rollout.replicas must be nnodes x nprocPerNode / tensorParallelSize" \
        in refused.value.body
    right = copy.deepcopy(wrong)
    right["metadata"]["name"] = "colocated"
    right["spec"]["rollout"]["replicas"] = 2
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, right)
    # `kubectl scale gj colocated --replicas=3` goes through the scale subresource: the same rule refuses it
    with pytest.raises(ApiException) as scaled:
        api.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "colocated",
                                                 {"spec": {"replicas": 3}})
    assert scaled.value.status == 422 and "a colocated job can't be scaled" in scaled.value.body
    got = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "colocated")
    assert got["spec"]["rollout"]["replicas"] == 2


def test_job_controller_creates_pods_and_deletion_collects_them(admin_client, namespace):
    batch, core = client.BatchV1Api(admin_client), client.CoreV1Api(admin_client)
    job = batch.create_namespaced_job(namespace, {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "hello"},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "busybox:1.36", "command": ["true"]}]}}}})

    def pods():
        return core.list_namespaced_pod(namespace, label_selector="job-name=hello").items

    # No kubelet here: the pod stays Pending, but it exists and is owned by the Job.
    (pod,) = eventually(pods, what="the Job controller to create a pod")
    owner = pod.metadata.owner_references[0]
    assert (owner.kind, owner.uid, owner.controller) == ("Job", job.metadata.uid, True)

    # batch/v1 Jobs orphan their pods by default; Background asks the garbage collector.
    batch.delete_namespaced_job("hello", namespace, propagation_policy="Background")
    eventually(lambda: not pods(), what="the garbage collector to delete the Job's pods")


def test_garbage_collector_deletes_dependents(admin_client, namespace):
    core = client.CoreV1Api(admin_client)
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "dependent", "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}]}})
    core.delete_namespaced_config_map("owner", namespace)

    def dependent_gone():
        try:
            core.read_namespaced_config_map("dependent", namespace)
            return False
        except ApiException as e:
            return e.status == 404

    eventually(dependent_gone, what="the garbage collector to delete the dependent ConfigMap")


def test_service_account_without_rbac_is_forbidden(control_plane, admin_client, namespace):
    core = client.CoreV1Api(admin_client)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
    minted = control_plane.kubeconfig_for_service_account(namespace, "nobody")
    sa = config.new_client_from_config(config_file=str(minted))
    try:
        with pytest.raises(ApiException) as denied:
            client.CoreV1Api(sa).list_namespaced_config_map(namespace)
        # 403 (authenticated, not authorized), not 401: the minted token itself is good.
        assert denied.value.status == 403
        assert f"system:serviceaccount:{namespace}:nobody" in denied.value.body

        # And RBAC is what decides: a Role + RoleBinding lets the same token through.
        rbac = client.RbacAuthorizationV1Api(admin_client)
        rbac.create_namespaced_role(namespace, {"metadata": {"name": "read-cm"}, "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]})
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": "read-cm"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-cm"},
            "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}]})

        def allowed():
            try:
                return client.CoreV1Api(sa).list_namespaced_config_map(namespace) is not None
            except ApiException as e:
                assert e.status == 403
                return False

        eventually(allowed, timeout=30, what="the RoleBinding to take effect")
    finally:
        sa.close()
