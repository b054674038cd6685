"""Colocated placement on Kubernetes (issue 46, pure builders): the trainer pods run the rollout
servers (no rollout Deployment, Service or NetworkPolicy), rank 0 reaches every pod's servers by
the pods' stable names, the servers never get the checkpoint key, their reward models and sandbox
admit the trainer pods, and an operator without an image that holds both is refused clearly."""

import copy

from grpo_operator import manifests, names, validation
from grpo_operator.settings import OperatorSettings
from operator_helpers import UID, body, job
from prometheus_helpers import pod_monitor_targets

S = OperatorSettings(colocated_image="reg/colocated:1")
# operator_helpers' job: 2 nodes x 4 GPUs, vLLM with tensor parallel 2 -> 2 servers per pod, 4 in all
COLOCATED = {"rollout.placement": "colocated", "rollout.replicas": 4}


def _trainer_container(j, settings=S):
    return manifests.build_trainer_job(j, settings)["spec"]["template"]["spec"]["containers"][0]


def test_trainer_pods_run_their_servers_before_torchrun():
    c = _trainer_container(job(**COLOCATED))
    assert c["image"] == "reg/colocated:1"
    assert c["command"] == ["grpo", "trainer", "--colocate"]
    args = c["args"]
    assert args[:args.index("--torchrun")] == ["--spec", names.SPEC_PATH, "--ports", "50051,50052",
                                               "--metrics-ports", "9091,9092"]
    torchrun = args[args.index("--torchrun") + 1:]
    assert torchrun == manifests.torchrun_args(job(**COLOCATED))
    rollout = torchrun[torchrun.index("--rollout") + 1].split(",")
    assert rollout == [f"demo-trainer-{node}.demo-trainer.team-a.svc:{port}" for node in (0, 1)
                       for port in (50051, 50052)]
    assert {p["containerPort"] for p in c["ports"]} >= {50051, 50052}
    # each pod still asks for its nprocPerNode GPUs: the servers share them
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4


def _trainer_pods(j, settings=S):
    """The trainer Job's pods as the Job controller labels them (their completion index)."""
    template = manifests.build_trainer_job(j, settings)["spec"]["template"]
    pods = {}
    for node in range(j.spec.trainer.nnodes):
        pod = copy.deepcopy(template)
        pod["metadata"]["labels"][manifests.COMPLETION_INDEX_LABEL] = str(node)
        pods[f"demo-trainer-{node}"] = pod
    return pods


def test_every_trainer_pods_servers_are_scraped_with_trainer_rank_0():
    """Each colocated server serves /metrics on its own declared port of the trainer pod (its
    worker label names it); the job's PodMonitor scrapes them on every node, the trainer's
    `metrics` port on node 0 alone (rank 0 serves it), and the trainer's NetworkPolicy admits
    the scrapers on those ports."""
    j = job(**COLOCATED)
    pods = _trainer_pods(j)
    ports = {p["name"]: p["containerPort"] for p in pods["demo-trainer-0"]["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == 9090 and ports["metrics-0"] == 9091 and ports["metrics-1"] == 9092
    assert pod_monitor_targets(manifests.build_pod_monitor(j, S), pods) == {
        ("demo-trainer-0", "metrics"), ("demo-trainer-0", "metrics-0"), ("demo-trainer-0", "metrics-1"),
        ("demo-trainer-1", "metrics-0"), ("demo-trainer-1", "metrics-1")}
    scrape_rule = manifests.build_trainer_network_policy(j, S)["spec"]["ingress"][1]
    assert [p["port"] for p in scrape_rule["ports"]] == [9090, 9091, 9092]
    # placement separate: trainer node 0's `metrics` only, as before
    separate = job()
    assert pod_monitor_targets(manifests.build_pod_monitor(separate, S), _trainer_pods(separate)) == {
        ("demo-trainer-0", "metrics")}


def test_servers_get_their_certificate_and_the_pod_keeps_one_ca():
    env = [e["name"] for e in _trainer_container(job(**COLOCATED))["env"]]
    assert {"GRPO_TLS_CERT", "GRPO_TLS_KEY", "GRPO_TLS_CA", "GRPO_CHECKPOINT_KEY"} <= set(env)
    assert len(env) == len(set(env)), env


def test_separate_trainer_pods_are_unchanged():
    c = _trainer_container(job())
    assert c["command"] == manifests.TRAINER_COMMAND and c["image"] == S.trainer_image
    assert "GRPO_TLS_CERT" not in {e["name"] for e in c["env"]}


def test_no_rollout_objects_and_the_trainer_policy_admits_the_servers_between_pods():
    children = manifests.build_children(job(**COLOCATED), S, pod_monitor=False)
    kinds = {(c["kind"], c["metadata"]["name"]) for c in children}
    assert ("Service", "demo-rollout") not in kinds and ("NetworkPolicy", "demo-rollout") not in kinds
    policy = next(c for c in children if c["kind"] == "NetworkPolicy" and c["metadata"]["name"] == "demo-trainer")
    from_trainers = [rule for rule in policy["spec"]["ingress"]
                     if {"podSelector": {"matchLabels": names.selector("demo", names.TRAINER)}} in rule["from"]]
    assert from_trainers and all("ports" not in rule for rule in from_trainers)   # every port, 50051.. included


def test_reward_and_sandbox_servers_admit_the_trainer_pods_and_the_trainer_dials_them():
    j = job(**COLOCATED, **{"reward.rewardModels": [{"name": "rm", "path": "/models/rm", "gpus": 1}],
                            "rollout.multiTurn": {"enable": True, "tools": ["python"]}})
    trainers = {"podSelector": {"matchLabels": names.selector("demo", names.TRAINER)}}
    for policy in (manifests.build_reward_network_policy(j, S), manifests.build_sandbox_network_policy(j, S)):
        assert policy["spec"]["ingress"][0]["from"] == [trainers], policy
    env = {e["name"] for e in _trainer_container(j)["env"]}
    assert {"GRPO_REWARD_ADDRESSES", "GRPO_SANDBOX_ADDRESSES"} <= env


def test_without_a_colocated_image_the_trainer_pods_run_the_rollout_image():
    """The rollout image carries the trainer's extra too (Dockerfile.rollout): it is the colocated
    image unless the admin names another."""
    obj = body(**COLOCATED)
    obj["metadata"]["uid"] = UID
    settings = OperatorSettings(rollout_image="reg/rollout:1")
    parsed, errors = validation.parse_grpojob(obj, settings)
    assert parsed is not None and not errors
    assert _trainer_container(parsed, settings)["image"] == "reg/rollout:1"
    assert _trainer_container(parsed, S)["image"] == "reg/colocated:1"


def test_status_counts_the_servers_of_ready_trainer_pods_and_the_reward_servers_follow():
    from grpo_operator.reconciler import _colocated_ready, _followed_deployment

    def pod(role, ready):
        return {"metadata": {"labels": {names.ROLE_LABEL: role}},
                "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
    j = job(**COLOCATED)
    assert _colocated_ready(j, [pod("trainer", True), pod("trainer", False), pod("reward", True)]) == 2
    assert _colocated_ready(j, [pod("trainer", True), pod("trainer", True)]) == 4
    # the reward servers are the Deployment the lifecycle scales (to 0 when the job ends)
    with_rm = job(**COLOCATED, **{"reward.rewardModels": [{"name": "rm", "path": "/models/rm", "gpus": 1}]})
    assert _followed_deployment(with_rm, "demo") == names.reward_model_name("demo", "rm")
    assert _followed_deployment(job(), "demo") == names.rollout_name("demo")
