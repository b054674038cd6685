"""The children's manifests (pure builders): names, owner references, labels, torchrun wiring,
GPUs, security, the token, the network policy and the PodMonitor. The golden file pins the
whole set; regenerate it with GRPO_UPDATE_GOLDEN=1 after an intended change and read the diff."""

import os
from pathlib import Path

import pytest
import yaml

from grpo_api.contracts import STOPPED_EXIT_CODE
from grpo_operator import manifests, names
from grpo_operator.pki import JobTLS
from grpo_operator.settings import OperatorSettings
from operator_helpers import UID, job
from operator_helpers import body as operator_body

GOLDEN = Path(__file__).parent / "golden" / "children.yaml"
S = OperatorSettings()
FAKE_TLS = JobTLS(ca_cert="<ca.crt>", cert="<tls.crt>", key="<tls.key>")    # real ones: tests/rollout/test_tls.py


def all_children(j=None):
    j = j or job()
    return [*manifests.build_children(j, S, pod_monitor=True),
            manifests.build_rpc_secret(j, S, token="t0k3n", checkpoint_key="c4pk3y", tls=FAKE_TLS),
            manifests.build_trainer_job(j, S, attempt=0),
            manifests.build_rollout_deployment(j, S)]


def test_children_match_the_golden_manifests():
    children = all_children()
    # The spec's YAML is grpo_api's (dump_job); the ConfigMap test below checks what matters here.
    children[0]["data"]["job.yaml"] = "<dump_job(job)>"
    rendered = yaml.safe_dump_all(children, sort_keys=True)
    if os.environ.get("GRPO_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(rendered)
    assert rendered == GOLDEN.read_text(), "manifests changed: GRPO_UPDATE_GOLDEN=1 and review the diff"


def test_builders_are_pure():
    assert all_children() == all_children()


@pytest.mark.parametrize("child", all_children(), ids=lambda c: f"{c['kind']}/{c['metadata']['name']}")
def test_every_child_is_owned_and_labelled(child):
    meta = child["metadata"]
    assert meta["namespace"] == "team-a"
    (owner,) = meta["ownerReferences"]
    assert owner == {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "name": "demo", "uid": UID,
                     "controller": True, "blockOwnerDeletion": True}
    labels = meta["labels"]
    assert labels["app.kubernetes.io/name"] == "grpojob"
    assert labels["app.kubernetes.io/instance"] == "demo"
    assert labels["app.kubernetes.io/managed-by"] == "grpo-operator"
    assert labels["app.kubernetes.io/component"]
    assert labels["grpo.dev/job"] == "demo" and labels["grpo.dev/role"]


def test_names_are_deterministic():
    kinds = {(c["kind"], c["metadata"]["name"]) for c in all_children()}
    assert kinds == {("ConfigMap", "demo-spec"), ("Secret", "demo-rpc"), ("Service", "demo-trainer"),
                     ("Service", "demo-rollout"), ("Job", "demo-trainer"), ("Deployment", "demo-rollout"),
                     ("NetworkPolicy", "demo-rollout"), ("NetworkPolicy", "demo-trainer"), ("PodMonitor", "demo")}


def test_config_map_holds_the_resolved_spec_the_pods_read():
    cm = manifests.build_config_map(job(), S)
    doc = yaml.safe_load(cm["data"]["job.yaml"])
    # the uid places the run's files (a re-created job is a new run); no managedFields
    assert doc["metadata"] == {"name": "demo", "namespace": "team-a", "uid": job().metadata.uid}
    assert doc["spec"]["rollout"]["n"] == 5
    assert doc["spec"]["algorithm"]["advEstimator"] == "grpo"           # defaults filled in
    assert "status" not in doc


def test_secrets_only_in_the_secret_and_each_role_gets_its_own():
    """The token, the checkpoint key and the TLS material live in the Secret alone. The trainer
    gets the token, the CA (and the name to check) and the checkpoint key; the rollout servers
    the token and their certificate and key, never the checkpoint key (they run the user's
    reward code)."""
    j = job()
    tls = JobTLS(ca_cert="CA-PEM-x1", cert="CERT-PEM-x2", key="KEY-PEM-x3")
    secret = manifests.build_rpc_secret(j, S, token="s3cr3t-token", checkpoint_key="ckpt-key-x4", tls=tls)
    assert secret["stringData"] == {"token": "s3cr3t-token", "checkpoint-key": "ckpt-key-x4", "ca.crt": "CA-PEM-x1",
                                    "tls.crt": "CERT-PEM-x2", "tls.key": "KEY-PEM-x3"}
    others = yaml.safe_dump_all([c for c in all_children(j) if c["kind"] != "Secret"])
    for value in secret["stringData"].values():
        assert value not in others

    def env_of(workload):
        return {e["name"]: e.get("valueFrom", e.get("value"))
                for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]}

    def ref(key):
        return {"secretKeyRef": {"name": "demo-rpc", "key": key}}
    trainer, rollout = env_of(manifests.build_trainer_job(j, S)), env_of(manifests.build_rollout_deployment(j, S))
    assert trainer["GRPO_RPC_TOKEN"] == rollout["GRPO_RPC_TOKEN"] == ref("token")
    assert trainer["GRPO_TLS_CA"] == ref("ca.crt") and trainer["GRPO_CHECKPOINT_KEY"] == ref("checkpoint-key")
    assert trainer["GRPO_TLS_SERVER_NAME"] == "demo-rollout.team-a.svc"       # a name in the servers' certificate
    assert "GRPO_TLS_KEY" not in trainer and "GRPO_TLS_CERT" not in trainer
    assert rollout["GRPO_TLS_CERT"] == ref("tls.crt") and rollout["GRPO_TLS_KEY"] == ref("tls.key")
    assert "GRPO_CHECKPOINT_KEY" not in rollout and "GRPO_TLS_CA" not in rollout


def test_trainer_job_is_indexed_with_torchrun_wiring():
    spec = manifests.build_trainer_job(job(), S, attempt=2)["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 2
    assert spec["backoffLimit"] == 0
    assert spec["podReplacementPolicy"] == "Failed"
    disruption, stopped, bad_input = spec["podFailurePolicy"]["rules"]
    assert disruption == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    # `kubectl delete pod` sets no DisruptionTarget: the trainer's own exit on SIGTERM says it
    # was stopped (issue 48), and the Job replaces the pod without counting a failure
    assert stopped == {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                          "values": [STOPPED_EXIT_CODE]}}
    assert STOPPED_EXIT_CODE not in (0, 1, 2) and STOPPED_EXIT_CODE < 126   # no crash's, no signal's
    assert bad_input == {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                             "values": [2]}}
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "demo-trainer" and pod["restartPolicy"] == "Never"
    assert spec["template"]["metadata"]["labels"][names.ATTEMPT_LABEL] == "2"
    (c,) = pod["containers"]
    assert c["command"] == ["grpo", "trainer", "--torchrun"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["args"] == [
        "--nnodes=2", "--nproc-per-node=4", "--node-rank=$(JOB_COMPLETION_INDEX)",
        "--master-addr=demo-trainer-0.demo-trainer", "--master-port=29500",
        "--no-python", "grpo", "trainer", "--spec", "/etc/grpo/job.yaml",
        "--rollout", "dns:///demo-rollout.team-a.svc.cluster.local:50051", "--metrics-port", "9090"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "4"
    assert env["PET_MASTER_ADDR"] == "demo-trainer-0.demo-trainer" and env["PET_MASTER_PORT"] == "29500"
    assert env["PET_NODE_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}


def test_trainer_pods_get_gpus_shm_spec_and_s3_credentials():
    pod = manifests.build_trainer_job(job(), S)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert c["resources"]["requests"] == S.trainer_resources["requests"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": S.shm_size}
    assert vols["grpo-spec"]["configMap"]["name"] == "demo-spec"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {"/etc/grpo": "grpo-spec", "/dev/shm": "dshm"}
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID", "optional": False}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-credentials"
    assert pod["terminationGracePeriodSeconds"] == S.trainer_termination_grace_seconds >= 600


def _pods(j):
    return {"trainer": manifests.build_trainer_job(j, S)["spec"]["template"]["spec"],
            "rollout": manifests.build_rollout_deployment(j, S)["spec"]["template"]["spec"]}


def test_a_model_cache_is_filled_by_an_init_container_and_read_only_in_the_pods():
    user_secret = {"secretRef": {"name": "hf-credentials"}}
    j = job(**{"model.path": "s3://models/Qwen3-1.7B", "model.cache": {"claimName": "shared-models"},
               "trainer.trackerSecretRef": "wandb-credentials",
               "trainer.template": {"spec": {"containers": [{"image": "registry.example/trainer:patched",
                                                              "env": [{"name": "HF_TOKEN", "value": "x"}],
                                                              "envFrom": [user_secret]}]}},
               "rollout.template": {"spec": {"containers": [{"envFrom": [user_secret]}]}}})
    for role, pod in _pods(j).items():
        (main,) = pod["containers"]
        (init,) = pod["initContainers"]
        assert {v["name"]: v for v in pod["volumes"]}["model-cache"] == {
            "name": "model-cache", "persistentVolumeClaim": {"claimName": "shared-models"}}
        assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in main["volumeMounts"]
        assert {"name": "GRPO_MODEL_CACHE", "value": "/model-cache"} in main["env"]
        # the fetch runs the main container's image (a template's too) and is the only one that
        # writes the cache
        assert init["name"] == "model" and init["image"] == main["image"]
        assert [init["command"], init["args"]] == [["grpo"], ["model", "fetch", "--spec", "/etc/grpo/job.yaml"]]
        # with the storage credentials and the template's environment, and no secret a fetch
        # doesn't need: not the job's token, TLS or checkpoint keys, not the tracker's Secret
        env = {e["name"]: e for e in init["env"]}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-credentials"
        assert env["HF_TOKEN"]["value"] == "x" if role == "trainer" else "HF_TOKEN" not in env
        secret_keys = {e["valueFrom"]["secretKeyRef"]["name"] for e in main["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        assert "demo-rpc" in secret_keys      # the main container has them ...
        assert "demo-rpc" not in {e["valueFrom"]["secretKeyRef"]["name"] for e in init["env"]
                                      if "secretKeyRef" in e.get("valueFrom", {})}     # ... the fetch not
        assert init["envFrom"] == [user_secret]
        assert role == "rollout" or {"secretRef": {"name": "wandb-credentials"}} in main["envFrom"]
        assert {m["mountPath"]: m.get("readOnly", False) for m in init["volumeMounts"]} == {
            "/etc/grpo": True, "/model-cache": False}
        assert init["securityContext"] == main["securityContext"]
        assert "resources" not in init          # no GPUs held by the fetch
    assert _pods(j)["trainer"]["initContainers"][0]["image"] == "registry.example/trainer:patched"


def test_a_model_in_object_storage_without_a_cache_is_fetched_into_each_pod():
    pods = _pods(job(**{"model.path": "s3://models/Qwen3-1.7B"}))
    for pod in pods.values():
        assert {v["name"]: v for v in pod["volumes"]}["model-cache"] == {"name": "model-cache", "emptyDir": {}}
        assert pod["initContainers"][0]["args"][:2] == ["model", "fetch"]


def test_a_hub_model_without_a_cache_has_no_init_container():
    for pod in _pods(job(**{"model.path": "Qwen/Qwen3-1.7B"})).values():
        assert "initContainers" not in pod and "model-cache" not in {v["name"] for v in pod["volumes"]}


def test_a_template_cannot_rewire_the_model_cache():
    from grpo_operator.templates import TemplateError
    j = job(**{"model.cache": {"claimName": "m"}, "rollout.template": {"spec": {
        "volumes": [{"name": "model-cache", "emptyDir": {}}],
        "containers": [{"env": [{"name": "GRPO_MODEL_CACHE", "value": "/tmp"}],
                        "volumeMounts": [{"name": "x", "mountPath": "/model-cache"}]}]}}})
    with pytest.raises(TemplateError) as err:
        manifests.build_rollout_deployment(j, S)
    assert err.value.errors == [
        "spec.rollout.template.spec.volumes[0].name: 'model-cache' is the operator's volume; choose another name",
        "spec.rollout.template.spec.containers[0].env[0].name: 'GRPO_MODEL_CACHE' is set by the operator "
        "(it wires the pods together)",
        "spec.rollout.template.spec.containers[0].volumeMounts[0].mountPath: '/model-cache' is the operator's; "
        "choose another path"]


def test_tracker_secret_becomes_the_trainer_environment_by_reference():
    j = job(**{"trainer.loggers": ["console", "wandb", "mlflow"], "trainer.trackerSecretRef": "team-trackers"})
    trainer = manifests.build_trainer_job(j, S)["spec"]["template"]["spec"]["containers"][0]
    # Every key of the Secret (WANDB_API_KEY, MLFLOW_TRACKING_URI, ...) as a variable of the trainer.
    assert trainer["envFrom"] == [{"secretRef": {"name": "team-trackers"}}]
    # The rollout servers log nothing to the trackers: they don't get the credentials.
    rollout = manifests.build_rollout_deployment(j, S)["spec"]["template"]["spec"]["containers"][0]
    assert "envFrom" not in rollout
    # The ConfigMap the pods read names the Secret, and that is all it knows of it.
    doc = yaml.safe_load(manifests.build_config_map(j, S)["data"]["job.yaml"])
    assert doc["spec"]["trainer"]["trackerSecretRef"] == "team-trackers"
    # No Secret named: no envFrom (the golden file's job).
    assert "envFrom" not in manifests.build_trainer_job(job(), S)["spec"]["template"]["spec"]["containers"][0]


def test_tracker_secret_and_a_template_envfrom_are_both_kept():
    j = job(**{"trainer.trackerSecretRef": "team-trackers",
               "trainer.template": {"spec": {"containers": [{"envFrom": [{"configMapRef": {"name": "proxy"}}]}]}}})
    trainer = manifests.build_trainer_job(j, S)["spec"]["template"]["spec"]["containers"][0]
    assert trainer["envFrom"] == [{"secretRef": {"name": "team-trackers"}}, {"configMapRef": {"name": "proxy"}}]


def test_cpu_trainer_and_hf_rollout_get_no_gpus():
    j = job(**{"trainer.device": "cpu", "rollout.engine": "hf", "storage.secretRef": None})
    trainer = manifests.build_trainer_job(j, S)["spec"]["template"]["spec"]["containers"][0]
    rollout = manifests.build_rollout_deployment(j, S)["spec"]["template"]["spec"]["containers"][0]
    for c in (trainer, rollout):
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        assert not any(e["name"].startswith("AWS_") for e in c["env"])


@pytest.mark.parametrize("build", [manifests.build_trainer_job, manifests.build_rollout_deployment])
def test_pods_are_locked_down(build):
    pod = build(job(), S)["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    sc = pod["containers"][0]["securityContext"]
    assert sc == {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert pod["automountServiceAccountToken"] is False
    assert pod["containers"][0]["imagePullPolicy"] == "IfNotPresent"


def test_rollout_deployment_runs_the_server_on_the_jobs_gpus():
    d = manifests.build_rollout_deployment(job(), S)
    assert d["spec"]["replicas"] == 2
    assert manifests.build_rollout_deployment(job(), S, replicas=0)["spec"]["replicas"] == 0
    assert d["spec"]["selector"]["matchLabels"] == {"grpo.dev/job": "demo", "grpo.dev/role": "rollout"}
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["grpo"]
    assert c["args"] == ["rollout", "--spec", "/etc/grpo/job.yaml", "--port", "50051", "--metrics-port", "9090",
                         "--worker-id", "$(POD_NAME)"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2          # tensorParallelSize
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert c["image"] == S.rollout_image


def test_services_are_headless():
    trainer = manifests.build_trainer_service(job(), S)["spec"]
    rollout = manifests.build_rollout_service(job(), S)["spec"]
    assert trainer["clusterIP"] == rollout["clusterIP"] == "None"
    assert trainer["publishNotReadyAddresses"] is True      # rendezvous before readiness
    assert rollout["publishNotReadyAddresses"] is False     # only loaded servers get work
    assert trainer["selector"] == {"grpo.dev/job": "demo", "grpo.dev/role": "trainer"}
    assert {p["port"] for p in rollout["ports"]} == {50051, 9090}


def test_rollout_network_policy_admits_the_trainer_scrapers_and_nccl_peers():
    spec = manifests.build_network_policy(job(), S)["spec"]
    assert spec["podSelector"]["matchLabels"] == {"grpo.dev/job": "demo", "grpo.dev/role": "rollout"}
    grpc, metrics, nccl = spec["ingress"]
    assert grpc == {"from": [{"podSelector": {"matchLabels": {"grpo.dev/job": "demo", "grpo.dev/role": "trainer"}}}],
                    "ports": [{"protocol": "TCP", "port": 50051}]}
    assert metrics["from"] == [{"podSelector": {}}] and metrics["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert "ports" not in nccl and len(nccl["from"]) == 2
    grpc_only = manifests.build_network_policy(job(**{"weightSync.backend": "grpc"}),
                                               OperatorSettings(metrics_namespace="monitoring"))["spec"]
    assert len(grpc_only["ingress"]) == 2
    assert grpc_only["ingress"][1]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_trainer_network_policy_admits_only_the_jobs_pods():
    spec = manifests.build_trainer_network_policy(job(), S)["spec"]
    assert spec["podSelector"]["matchLabels"] == {"grpo.dev/job": "demo", "grpo.dev/role": "trainer"}
    peers, metrics = spec["ingress"]
    assert [p["podSelector"]["matchLabels"]["grpo.dev/role"] for p in peers["from"]] == ["trainer", "rollout"]
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}]
    grpc = manifests.build_trainer_network_policy(job(**{"weightSync.backend": "grpc"}), S)["spec"]
    assert [p["podSelector"]["matchLabels"]["grpo.dev/role"] for p in grpc["ingress"][0]["from"]] == ["trainer"]


def test_pod_monitor_scrapes_rollouts_and_trainer_node_zero():
    pm = manifests.build_pod_monitor(job(), OperatorSettings(pod_monitor_labels={"release": "prom"}))
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["selector"]["matchLabels"] == {"grpo.dev/job": "demo"}
    assert pm["spec"]["selector"]["matchExpressions"] == [
        {"key": "batch.kubernetes.io/job-completion-index", "operator": "NotIn", "values": ["1"]}]
    one_node = manifests.build_pod_monitor(job(**{"trainer.nnodes": 1, "trainer.microBatchSizePerGPU": 8}), S)
    assert "matchExpressions" not in one_node["spec"]["selector"]


def test_optional_children_follow_settings():
    kinds = [c["kind"] for c in manifests.build_children(job(), OperatorSettings(network_policy=False),
                                                         pod_monitor=False)]
    assert kinds == ["ConfigMap", "Service", "Service"]


def test_template_overrides_reach_the_pods():
    template = {"metadata": {"annotations": {"team": "a"}},
                "spec": {"nodeSelector": {"gpu": "h200"}, "priorityClassName": "training",
                         "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                         "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "models"}}],
                         "containers": [{"volumeMounts": [{"name": "cache", "mountPath": "/models"}],
                                         "env": [{"name": "HF_HOME", "value": "/models"}]}]}}
    j = job(**{"trainer.template": template})
    pod = manifests.build_trainer_job(j, S)["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"team": "a"}
    assert pod["spec"]["nodeSelector"] == {"gpu": "h200"}
    assert pod["spec"]["priorityClassName"] == "training"
    assert {"name": "cache", "mountPath": "/models"} in pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "HF_HOME", "value": "/models"} in pod["spec"]["containers"][0]["env"]
    rollout_pod = manifests.build_rollout_deployment(j, S)["spec"]["template"]["spec"]
    assert "nodeSelector" not in rollout_pod        # the trainer's template is the trainer's


def test_settings_reach_the_pods():
    s = OperatorSettings(trainer_image="reg/trainer:1", rollout_image="reg/rollout:1", image_pull_policy="Always",
                         image_pull_secrets=("regcred",), run_as_user=2000, gpu_resource="amd.com/gpu",
                         trainer_resources={"requests": {"cpu": "1"}})
    pod = manifests.build_trainer_job(job(), s)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert (c["image"], c["imagePullPolicy"]) == ("reg/trainer:1", "Always")
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["securityContext"]["runAsUser"] == 2000
    assert c["resources"] == {"requests": {"cpu": "1"}, "limits": {"amd.com/gpu": 4}}
    assert manifests.build_rollout_deployment(job(), s)["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "reg/rollout:1"


def test_missing_uid_is_an_error():
    from grpo_api.jobfile import parse_job
    from operator_helpers import body
    with pytest.raises(ValueError, match="metadata.uid"):
        manifests.build_config_map(parse_job(body()), S)


# --- reward models (issue 31) ----------------------------------------------------------------

REWARD_MODELS = [{"name": "skywork", "path": "/models/skywork-rm", "replicas": 2, "gpus": 1},
                 {"name": "judge", "kind": "judge", "path": "/models/judge", "gpus": 0, "engine": "hf",
                  "promptTemplate": "Q: {prompt} A: {response} score?",
                  "template": {"spec": {"nodeSelector": {"pool": "rm"}}}}]


def reward_job(**changes):
    return job(**{"reward.rewardModels": REWARD_MODELS, **changes})


def _env(container):
    return {e["name"]: e for e in container["env"]}


def test_each_reward_model_gets_a_deployment_and_a_headless_service():
    j = reward_job()
    services = {c["metadata"]["name"]: c for c in manifests.build_children(j, S, pod_monitor=False)
                if c["kind"] == "Service"}
    for model in ("skywork", "judge"):
        svc = services[f"demo-rm-{model}"]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
        assert svc["spec"]["selector"] == {"grpo.dev/job": "demo", "grpo.dev/role": "reward",
                                           "grpo.dev/reward-model": model}
    sky, judge = manifests.build_rollout_dependencies(j, S, rollout_replicas=1)
    assert sky["metadata"]["name"] == "demo-rm-skywork" and sky["spec"]["replicas"] == 2
    assert sky["spec"]["selector"]["matchLabels"] == services["demo-rm-skywork"]["spec"]["selector"]
    pod = sky["spec"]["template"]
    assert pod["metadata"]["labels"]["grpo.dev/reward-model"] == "skywork"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == S.rollout_image
    assert c["args"] == ["reward", "--spec", "/etc/grpo/job.yaml", "--model", "skywork", "--port", "50051",
                         "--metrics-port", "9090"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert c["startupProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/live"
    # The job's token and server certificate, never the checkpoint key or the storage credentials.
    env = _env(c)
    assert {k: env[k]["valueFrom"]["secretKeyRef"] for k in ("GRPO_RPC_TOKEN", "GRPO_TLS_CERT", "GRPO_TLS_KEY")} == {
        "GRPO_RPC_TOKEN": {"name": "demo-rpc", "key": "token"},
        "GRPO_TLS_CERT": {"name": "demo-rpc", "key": "tls.crt"}, "GRPO_TLS_KEY": {"name": "demo-rpc", "key": "tls.key"}}
    assert "GRPO_CHECKPOINT_KEY" not in env and not any(k.startswith("AWS_") for k in env)
    # A CPU judge gets no GPU, and its own template override.
    (jc,) = judge["spec"]["template"]["spec"]["containers"]
    assert judge["spec"]["replicas"] == 1 and "nvidia.com/gpu" not in jc["resources"].get("limits", {})
    assert judge["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "rm"}
    assert "nodeSelector" not in pod["spec"]


def test_reward_servers_are_at_zero_while_the_rollout_servers_are():
    assert [d["spec"]["replicas"] for d in manifests.build_rollout_dependencies(reward_job(), S, rollout_replicas=0)] == [0, 0]


def test_the_rollout_servers_get_the_reward_services_and_the_ca():
    env = _env(manifests.build_rollout_deployment(reward_job(), S)["spec"]["template"]["spec"]["containers"][0])
    assert env["GRPO_REWARD_ADDRESSES"]["value"] == (
        "skywork=dns:///demo-rm-skywork.team-a.svc:50051;judge=dns:///demo-rm-judge.team-a.svc:50051")
    assert env["GRPO_TLS_CA"]["valueFrom"]["secretKeyRef"] == {"name": "demo-rpc", "key": "ca.crt"}
    # What the rollout server parses, and the name the certificate carries.
    from grpo_api.contracts import REWARD_ADDRESSES_ENV, parse_reward_addresses
    assert parse_reward_addresses(env[REWARD_ADDRESSES_ENV]["value"])["skywork"] == [
        "dns:///demo-rm-skywork.team-a.svc:50051"]
    assert "demo-rm-skywork.team-a.svc" in names.reward_dns_names("demo", "team-a", ["skywork"])
    # Without reward models the rollout pods get neither.
    plain = _env(manifests.build_rollout_deployment(job(), S)["spec"]["template"]["spec"]["containers"][0])
    assert "GRPO_REWARD_ADDRESSES" not in plain and "GRPO_TLS_CA" not in plain


def test_only_the_jobs_rollout_pods_reach_the_reward_servers():
    policies = {c["metadata"]["name"]: c for c in manifests.build_children(reward_job(), S, pod_monitor=False)
                if c["kind"] == "NetworkPolicy"}
    spec = policies["demo-reward"]["spec"]
    assert spec["podSelector"] == {"matchLabels": {"grpo.dev/job": "demo", "grpo.dev/role": "reward"}}
    grpc, metrics = spec["ingress"]
    assert grpc == {"from": [{"podSelector": {"matchLabels": {"grpo.dev/job": "demo", "grpo.dev/role": "rollout"}}}],
                    "ports": [{"protocol": "TCP", "port": 50051}]}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert "demo-reward" not in {c["metadata"]["name"] for c in manifests.build_children(job(), S, pod_monitor=False)}


def test_a_reward_model_with_a_model_cache_mounts_it_read_only_and_fetches_nothing():
    j = reward_job(**{"model.cache": {"claimName": "models"}})
    pod = manifests.build_rollout_dependencies(j, S, rollout_replicas=1)[0]["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert "initContainers" not in pod        # the policy's fetch is the rollout pods' business


def test_a_refused_reward_template_names_its_field():
    from grpo_operator.templates import TemplateError
    from grpo_operator.validation import parse_grpojob
    bad = [{**REWARD_MODELS[0], "template": {"spec": {"hostNetwork": True}}}]
    doc = operator_body(**{"reward.rewardModels": bad})
    doc["metadata"]["uid"] = UID
    assert parse_grpojob(doc, S)[1] and all(e.startswith("spec.reward.rewardModels[0].template")
                                            for e in parse_grpojob(doc, S)[1])
    with pytest.raises(TemplateError):
        manifests.build_rollout_dependencies(job(**{"reward.rewardModels": bad}), S, rollout_replicas=1)


def test_long_reward_service_names_stay_one_dns_label():
    name = names.reward_model_name("j" * 50, "m" * 40)
    assert len(name) <= 63 and name.startswith("j" * 50 + "-rm-")
    assert name == names.reward_model_name("j" * 50, "m" * 40) != names.reward_model_name("j" * 50, "m" * 39 + "n")


# --- the python tool's sandbox pool (issue 32 item 5) -------------------------------------------

def python_job(**python):
    return job(**{"rollout.multiTurn": {"enable": True, "tools": ["python"], "python": python}})


def test_the_python_tool_gets_a_sandbox_pool_by_default_on_kubernetes():
    children = {(c["kind"], c["metadata"]["name"]): c for c in manifests.build_children(python_job(), S, pod_monitor=False)}
    svc = children[("Service", "demo-sandbox")]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"grpo.dev/job": "demo",
                                                                              "grpo.dev/role": "sandbox"}
    (sandbox,) = manifests.build_rollout_dependencies(python_job(), S, rollout_replicas=1)
    assert sandbox["metadata"]["name"] == "demo-sandbox" and sandbox["spec"]["replicas"] == 1
    assert manifests.build_rollout_dependencies(python_job(replicas=3), S, rollout_replicas=1)[0]["spec"]["replicas"] == 3
    # at zero with the rollout servers; none without the python tool, or with replicas 0
    assert manifests.build_rollout_dependencies(python_job(), S, rollout_replicas=0)[0]["spec"]["replicas"] == 0
    assert manifests.build_rollout_dependencies(python_job(replicas=0), S, rollout_replicas=1) == []
    assert not any(c["metadata"]["name"] == "demo-sandbox" for c in manifests.build_children(
        python_job(replicas=0), S, pod_monitor=False))
    lookup = job(**{"rollout.multiTurn": {"enable": True, "tools": ["tools:lookup"]}})
    assert manifests.build_rollout_dependencies(lookup, S, rollout_replicas=1) == []


def test_a_sandbox_pod_holds_nothing_but_the_token_and_its_certificate():
    pod = manifests.build_sandbox_deployment(python_job(concurrency=3, memoryMB=512), S)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == ["sandbox", "--spec", "/etc/grpo/job.yaml", "--port", "50051", "--metrics-port", "9090"]
    env = _env(c)
    assert {k for k, v in env.items() if "secretKeyRef" in v.get("valueFrom", {})} == {
        "GRPO_RPC_TOKEN", "GRPO_TLS_CERT", "GRPO_TLS_KEY"}
    assert not any(k.startswith("AWS_") for k in env) and "envFrom" not in c
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]} and pod["automountServiceAccountToken"] is False
    # /tmp is the only writable place, size-limited; no shared memory, no model, no GPU
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "3Gi"}} in pod["volumes"] and env["TMPDIR"]["value"] == "/tmp"
    assert {v["name"] for v in pod["volumes"]} == {"grpo-spec", "tmp"} and "initContainers" not in pod
    assert c["resources"]["limits"] == {"cpu": "3", "memory": f"{3 * 512 + 256}Mi"}


def test_the_sandbox_pods_can_open_no_connection_and_only_the_rollout_pods_reach_them():
    policies = {c["metadata"]["name"]: c for c in manifests.build_children(python_job(), S, pod_monitor=False)
                if c["kind"] == "NetworkPolicy"}
    spec = policies["demo-sandbox"]["spec"]
    assert spec["podSelector"] == {"matchLabels": {"grpo.dev/job": "demo", "grpo.dev/role": "sandbox"}}
    assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["egress"] == []      # not even DNS
    grpc, metrics = spec["ingress"]
    assert grpc == {"from": [{"podSelector": {"matchLabels": {"grpo.dev/job": "demo", "grpo.dev/role": "rollout"}}}],
                    "ports": [{"protocol": "TCP", "port": 50051}]}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}]


def test_the_rollout_servers_dial_the_sandbox_service_with_the_jobs_ca(monkeypatch):
    env = _env(manifests.build_rollout_deployment(python_job(), S)["spec"]["template"]["spec"]["containers"][0])
    from grpo_api.contracts import SANDBOX_ADDRESSES_ENV
    from grpo_rollout.tools.sandbox_client import sandbox_addresses
    monkeypatch.setenv(SANDBOX_ADDRESSES_ENV, env[SANDBOX_ADDRESSES_ENV]["value"])
    assert sandbox_addresses([]) == ["dns:///demo-sandbox.team-a.svc:50051"]      # what the rollout server dials
    assert env["GRPO_TLS_CA"]["valueFrom"]["secretKeyRef"] == {"name": "demo-rpc", "key": "ca.crt"}
    assert "demo-sandbox.team-a.svc" in names.sandbox_dns_names("demo", "team-a")
    # with reward models too, the CA is there once
    both = job(**{"rollout.multiTurn": {"enable": True, "tools": ["python"]}, "reward.rewardModels": REWARD_MODELS})
    container = manifests.build_rollout_deployment(both, S)["spec"]["template"]["spec"]["containers"][0]
    assert [e["name"] for e in container["env"]].count("GRPO_TLS_CA") == 1


def test_a_refused_sandbox_template_names_its_field():
    from grpo_operator.templates import TemplateError
    with pytest.raises(TemplateError, match=r"spec.rollout.multiTurn.python.template.spec.hostNetwork"):
        manifests.build_sandbox_deployment(python_job(template={"spec": {"hostNetwork": True}}), S)
    # gVisor or Kata for hostile code: a runtime class is the template's to set
    gvisor = manifests.build_sandbox_deployment(python_job(template={"spec": {"runtimeClassName": "gvisor"}}), S)
    assert gvisor["spec"]["template"]["spec"]["runtimeClassName"] == "gvisor"
