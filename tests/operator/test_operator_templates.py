"""The per-job pod template merge (grpo_operator.templates): each rule of its table, and refusals
that name the field."""

import copy

import pytest

from grpo_operator.templates import TemplateError, merge_pod_template

BASE = {
    "metadata": {"labels": {"grpo.dev/job": "demo", "grpo.dev/role": "trainer"}},
    "spec": {
        "containers": [{"name": "trainer", "image": "trainer:1",
                        "env": [{"name": "GRPO_RPC_TOKEN", "valueFrom": {"secretKeyRef": {"name": "x", "key": "t"}}},
                                {"name": "PYTHONUNBUFFERED", "value": "1"}],
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                        "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"nvidia.com/gpu": 4}}}],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "a", "operator": "Exists"}],
        "securityContext": {"runAsNonRoot": True},
    },
}
PATH = "spec.trainer.template"


def merge(override):
    return merge_pod_template(BASE, override, PATH)


def refused(override) -> list[str]:
    with pytest.raises(TemplateError) as info:
        merge(override)
    return info.value.errors


def test_nothing_to_merge_is_a_copy():
    out = merge(None)
    assert out == BASE and out is not BASE
    assert merge({}) == BASE


def test_inputs_are_not_modified():
    before, override = copy.deepcopy(BASE), {"spec": {"nodeSelector": {"x": "y"}, "containers": [{"env": [
        {"name": "A", "value": "1"}]}]}}
    override_before = copy.deepcopy(override)
    merge(override)
    assert BASE == before and override == override_before


def test_metadata_labels_and_annotations_are_added():
    out = merge({"metadata": {"labels": {"team": "a"}, "annotations": {"sidecar.istio.io/inject": "false"}}})
    assert out["metadata"]["labels"] == {"grpo.dev/job": "demo", "grpo.dev/role": "trainer", "team": "a"}
    assert out["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}


def test_node_selector_merges_key_by_key():
    out = merge({"spec": {"nodeSelector": {"pool": "h200", "zone": "b"}}})
    assert out["spec"]["nodeSelector"] == {"pool": "h200", "zone": "b"}


def test_lists_are_appended():
    out = merge({"spec": {"tolerations": [{"key": "b", "operator": "Exists"}],
                          "topologySpreadConstraints": [{"maxSkew": 1}], "imagePullSecrets": [{"name": "r"}]}})
    assert [t["key"] for t in out["spec"]["tolerations"]] == ["a", "b"]
    assert out["spec"]["topologySpreadConstraints"] == [{"maxSkew": 1}]
    assert out["spec"]["imagePullSecrets"] == [{"name": "r"}]


def test_scalars_and_affinity_are_set():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    out = merge({"spec": {"affinity": affinity, "priorityClassName": "hi", "schedulerName": "kueue",
                          "runtimeClassName": "nvidia", "serviceAccountName": "s3-reader"}})
    s = out["spec"]
    assert (s["affinity"], s["priorityClassName"], s["schedulerName"], s["runtimeClassName"],
            s["serviceAccountName"]) == (affinity, "hi", "kueue", "nvidia", "s3-reader")


def test_volumes_and_mounts_are_added():
    out = merge({"spec": {"volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "models"}}],
                          "containers": [{"volumeMounts": [{"name": "cache", "mountPath": "/models"}]}]}})
    assert [v["name"] for v in out["spec"]["volumes"]] == ["dshm", "cache"]
    assert out["spec"]["containers"][0]["volumeMounts"][-1] == {"name": "cache", "mountPath": "/models"}


def test_container_env_by_name_and_resources_per_key():
    out = merge({"spec": {"containers": [{"name": "trainer", "image": "mine:2",
                                          "env": [{"name": "PYTHONUNBUFFERED", "value": "0"},
                                                  {"name": "NCCL_DEBUG", "value": "INFO"}],
                                          "envFrom": [{"configMapRef": {"name": "extra"}}],
                                          "resources": {"requests": {"memory": "64Gi"},
                                                        "limits": {"memory": "128Gi"}}}]}})
    c = out["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PYTHONUNBUFFERED"] == "0" and env["NCCL_DEBUG"] == "INFO" and "GRPO_RPC_TOKEN" in env
    assert c["image"] == "mine:2" and c["envFrom"] == [{"configMapRef": {"name": "extra"}}]
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "64Gi"},
                              "limits": {"nvidia.com/gpu": 4, "memory": "128Gi"}}


@pytest.mark.parametrize("override, field", [
    ({"spec": {"hostNetwork": True}}, "spec.trainer.template.spec.hostNetwork: not allowed"),
    ({"spec": {"securityContext": {"runAsUser": 0}}}, "spec.trainer.template.spec.securityContext: not allowed"),
    ({"spec": {"initContainers": []}}, "spec.trainer.template.spec.initContainers: not allowed"),
    ({"kind": "Pod"}, "spec.trainer.template.kind: not allowed"),
    ({"metadata": {"name": "x"}}, "spec.trainer.template.metadata.name: not allowed"),
    ({"metadata": {"labels": {"grpo.dev/job": "other"}}}, "spec.trainer.template.metadata.labels.grpo.dev/job: set by"),
    ({"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, "spec.trainer.template.spec.volumes[0].name: 'dshm'"),
    ({"spec": {"volumes": [{"emptyDir": {}}]}}, "spec.trainer.template.spec.volumes[0].name: required"),
    ({"spec": {"containers": [{"name": "sidecar"}]}}, "spec.trainer.template.spec.containers[0].name: no container"),
    ({"spec": {"containers": [{"command": ["sh"]}]}}, "spec.trainer.template.spec.containers[0].command: not allowed"),
    ({"spec": {"containers": [{"securityContext": {"privileged": True}}]}},
     "spec.trainer.template.spec.containers[0].securityContext: not allowed"),
    ({"spec": {"containers": [{"env": [{"name": "GRPO_RPC_TOKEN", "value": "x"}]}]}},
     "spec.trainer.template.spec.containers[0].env[0].name: 'GRPO_RPC_TOKEN' is set by the operator"),
    ({"spec": {"containers": [{"env": [{"name": "GRPO_TLS_CA", "value": ""}]}]}},      # TLS off: no
     "spec.trainer.template.spec.containers[0].env[0].name: 'GRPO_TLS_CA' is set by the operator"),
    ({"spec": {"containers": [{"env": [{"name": "GRPO_CHECKPOINT_KEY", "value": "00" * 32}]}]}},
     "spec.trainer.template.spec.containers[0].env[0].name: 'GRPO_CHECKPOINT_KEY' is set by the operator"),
    ({"spec": {"containers": [{"env": [{"name": "PET_NNODES", "value": "9"}]}]}},
     "spec.trainer.template.spec.containers[0].env[0].name: 'PET_NNODES'"),
    ({"spec": {"containers": [{"volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]}]}},
     "spec.trainer.template.spec.containers[0].volumeMounts[0].mountPath: '/dev/shm'"),
    ({"spec": {"containers": [{"resources": {"claims": []}}]}},
     "spec.trainer.template.spec.containers[0].resources.claims: only requests and limits"),
    ({"spec": {"tolerations": {"key": "a"}}}, "spec.trainer.template.spec.tolerations: must be a list"),
    ({"spec": {"nodeSelector": ["a"]}}, "spec.trainer.template.spec.nodeSelector: must be a map"),
])
def test_refusals_name_the_field(override, field):
    assert any(e.startswith(field) for e in refused(override)), refused(override)


def test_every_refusal_is_reported_at_once():
    errors = refused({"spec": {"hostNetwork": True, "hostPID": True, "containers": [{"command": ["sh"]}]}})
    assert len(errors) == 3
