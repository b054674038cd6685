"""The operator under an admin's hands (issue 36), against the real API server and controllers
with the operator under the chart's RBAC: a changed chart default (`helm upgrade` of jobDefaults)
reaches new jobs only; a failure says its cause, and bad input is not retried; a missing Secret
is named and fails the job soon. The tests play the kubelet, as in test_operator_controlplane.py."""

from __future__ import annotations

import json
import signal

import pytest

from grpo_api.contracts import STOPPED_EXIT_CODE
from operator_helpers import eventually, kubectl
from test_operator_controlplane import Cluster, table

pytestmark = pytest.mark.controlplane


@pytest.fixture
def k(admin_client, namespace, storage_root, operator) -> Cluster:
    return Cluster(admin_client, namespace, storage_root)


def images(pod_spec) -> dict[str, str]:
    return {c.name: c.image for c in pod_spec.containers}


def test_a_chart_upgrade_of_job_defaults_reaches_new_jobs_only(k, operator):
    """Issue 36, bug 1: `helm upgrade --set jobDefaults.rollout.image.tag=does-not-exist` put
    the running jobs' rollout Deployments on that image. The chart passes jobDefaults to the
    operator as its environment, so an upgrade is a new operator process with new settings: a
    running job keeps the defaults pinned at its first reconcile (its ConfigMap says which), even
    for its next trainer attempt; a job created after the upgrade gets the new ones."""
    k.create("running")
    k.run_all("running")
    k.wait_phase("Running", "running")
    before = k.deployment("running")
    trainer_before = images(k.trainer_job("running").spec.template.spec)
    pinned = json.loads(k.core.read_namespaced_config_map("running-spec", k.ns).data["operator-defaults.json"])
    assert pinned["rollout_image"] == before.spec.template.spec.containers[0].image
    created = k.condition("Created", "running")["message"]
    assert f"rollout image {pinned['rollout_image']}" in created and "running-spec" in created

    saved = dict(operator.env)
    operator.kill(signal.SIGTERM)                        # the chart's Deployment rolls the operator
    operator.env.update({"GRPO_OPERATOR_ROLLOUT_IMAGE": "reg.example/rollout:does-not-exist",
                         "GRPO_OPERATOR_TRAINER_IMAGE": "reg.example/trainer:new",
                         "GRPO_OPERATOR_ROLLOUT_RESOURCES": '{"requests": {"cpu": "1", "memory": "1Gi"}}'})
    try:
        operator.start()
        k.create("fresh")
        fresh = eventually(lambda: k.deployment("fresh"), what="the new job's rollout Deployment")
        assert images(fresh.spec.template.spec) == {"rollout": "reg.example/rollout:does-not-exist"}
        assert fresh.spec.template.spec.containers[0].resources.requests == {"cpu": "1", "memory": "1Gi"}
        fresh_trainer = eventually(lambda: k.trainer_job("fresh"), what="the new job's trainer Job")
        assert images(fresh_trainer.spec.template.spec) == {"trainer": "reg.example/trainer:new"}
        fresh_pin = json.loads(k.core.read_namespaced_config_map("fresh-spec", k.ns).data["operator-defaults.json"])
        assert fresh_pin["rollout_image"] == "reg.example/rollout:does-not-exist"

        operator.wait_for_resyncs()                      # the new process reconciled the running job
        after = k.deployment("running")
        assert after.metadata.generation == before.metadata.generation      # not even re-rolled
        assert after.spec.template == before.spec.template
        rs = k.apps.list_namespaced_replica_set(k.ns, label_selector="grpo.dev/job=running").items
        assert len(rs) == 1
        assert json.loads(k.core.read_namespaced_config_map("running-spec", k.ns).data["operator-defaults.json"]) \
            == pinned
        assert k.status("running")["phase"] == "Running"

        # A restart of the running job (a new trainer Job) is built with its pinned defaults too.
        rank0 = next(p for p in k.trainer_pods("running", attempt=0) if p.spec.hostname == "running-trainer-0")
        k.kubelet(rank0, "Failed", exit_code=1, message="boom")
        retry = eventually(lambda: (j := k.trainer_job("running")) and j.metadata.labels["grpo.dev/attempt"] == "1"
                           and j, what="attempt 1 of the running job")
        assert images(retry.spec.template.spec) == trainer_before
    finally:
        operator.kill(signal.SIGTERM)
        operator.env.clear()
        operator.env.update(saved)
        operator.start()


def test_bad_input_fails_the_job_at_once_with_the_trainers_own_words(k, control_plane, kubectl_bin):
    """Issue 36, bug 2: `model.path: /models/nope` was retried backoffLimit times, and the
    Failed condition carried torchrun's boilerplate. The trainer exits 2 with its `error: ...`
    line as the termination message; the trainer Job's pod failure policy fails the Job on exit
    code 2 (the real Job controller here), and the operator fails the GRPOJob at once, saying it."""
    said = "error: spec.model.path: '/models/nope' does not exist (give a local model folder, or a Hugging " \
           "Face model id such as Qwen/Qwen3-8B)"
    k.create(**{"runPolicy.backoffLimit": 3})
    rank0 = next(p for p in k.trainer_pods(attempt=0) if p.spec.hostname == "demo-trainer-0")
    k.kubelet(rank0, "Failed", exit_code=2, message=said)
    st = k.wait_phase("Failed")
    assert st["restarts"] == 0
    failed = k.condition("Failed")
    assert failed["reason"] == "BadInput"
    assert failed["message"].endswith(f"pod {rank0.metadata.name} exited with code 2 (Error): {said}")
    assert "FailJob rule" not in failed["message"] and "BackoffLimitExceeded" not in failed["message"]
    job = k.trainer_job()
    assert [c.reason for c in job.status.conditions if c.type == "Failed"] == ["PodFailurePolicy"]
    assert job.metadata.labels["grpo.dev/attempt"] == "0"           # never retried
    assert said in k.wait_event("BadInput").message
    eventually(lambda: k.deployment().spec.replicas == 0, what="rollout scaled to zero")
    wide = table(kubectl(kubectl_bin, control_plane, "-n", k.ns, "get", "gj", "-o", "wide").stdout)
    assert (wide[0]["PHASE"], wide[0]["RESTARTS"], wide[0]["REASON"]) == ("Failed", "0", "BadInput")
    described = kubectl(kubectl_bin, control_plane, "-n", k.ns, "describe", "gj", "demo").stdout
    assert "spec.model.path: '/models/nope' does not exist" in described


def test_a_killed_trainer_says_how_and_a_disrupted_pod_uses_no_restart(k):
    """Issue 36, bug 2: an OOM kill reads `exited with code 137 (SIGKILL, OOMKilled)`; a pod
    deleted by a drain or preemption (DisruptionTarget), or one whose trainer stopped on SIGTERM
    (`kubectl delete pod`, issue 48), is replaced by the Job controller without failing the Job,
    so it counts against no backoff limit."""
    k.create(**{"runPolicy.backoffLimit": 2})
    pods = k.trainer_pods(attempt=0)
    k.run_all()
    k.wait_phase("Running")
    rank1 = next(p for p in pods if p.spec.hostname == "demo-trainer-1")
    k.core.patch_namespaced_pod_status(rank1.metadata.name, k.ns, {"status": {"phase": "Failed", "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
         "message": "preempted", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}})
    eventually(lambda: len([p for p in k.pods("demo", "trainer") if p.spec.hostname == "demo-trainer-1"]) >= 2,
               what="a replacement for the disrupted pod")
    job = k.trainer_job()
    assert not [c for c in job.status.conditions or [] if c.type == "Failed"]
    assert k.status()["restarts"] == 0 and k.condition("TrainerFailed") is None

    # Issue 48: `kubectl delete pod` sets no DisruptionTarget; the trainer stopped by its SIGTERM
    # checkpoints and exits STOPPED_EXIT_CODE, and that pod too is replaced without a restart.
    rank0 = next(p for p in pods if p.spec.hostname == "demo-trainer-0")
    k.kubelet(rank0, "Failed", exit_code=STOPPED_EXIT_CODE, message="trainer stopped by SIGTERM")
    eventually(lambda: len([p for p in k.pods("demo", "trainer") if p.spec.hostname == "demo-trainer-0"]) >= 2,
               what="a replacement for the stopped pod")
    job = k.trainer_job()
    assert not [c for c in job.status.conditions or [] if c.type == "Failed"]
    assert k.status()["restarts"] == 0 and k.condition("TrainerFailed") is None

    rank0 = next(p for p in k.pods("demo", "trainer")
                 if p.spec.hostname == "demo-trainer-0" and p.metadata.uid != rank0.metadata.uid)
    k.kubelet(rank0, "Failed", exit_code=137, reason="OOMKilled", message="step 3: loss 0.41")
    st = k.wait_phase("Restarting")
    assert st["restarts"] == 1
    c = k.condition("TrainerFailed")
    assert c["reason"] == "OOMKilled"
    assert c["message"] == f"attempt 0: pod {rank0.metadata.name} exited with code 137 (SIGKILL, OOMKilled): step 3: loss 0.41"
    assert "exited with code 137 (SIGKILL, OOMKilled)" in k.wait_event("TrainerFailed").message


def test_a_missing_secret_is_named_and_fails_the_job_after_a_short_grace(k):
    """Issue 36, bug 4: with `storage.secretRef: does-not-exist` the job waited the whole pending
    deadline, and ProgressUnreadable gave a wrong hint. The kubelet's CreateContainerConfigError
    becomes a condition naming the Secret and the field, and the job fails after the operator's
    missing_secret_grace_seconds (8 s in these tests; 60 s by default), not the 900 s deadline."""
    k.create(**{"storage.secretRef": "does-not-exist", "runPolicy.pendingDeadlineSeconds": 900})
    for p in k.trainer_pods():
        k.kubelet(p, "Pending", waiting="CreateContainerConfigError", message='secret "does-not-exist" not found')
    c = eventually(lambda: (c := k.condition("SecretMissing")) and c["status"] == "True" and c,
                   what="the SecretMissing condition")
    assert (c["reason"], c["message"]) == ("SecretNotFound", 'secret "does-not-exist" not found (spec.storage.secretRef)')
    assert k.wait_event("SecretNotFound").type == "Warning"
    k.wait_phase("Failed", timeout=40)
    failed = k.condition("Failed")
    assert failed["reason"] == "SecretNotFound"
    assert failed["message"].startswith('secret "does-not-exist" not found (spec.storage.secretRef): the pods can\'t start')
    eventually(lambda: k.trainer_job() is None, what="the pending trainer Job removed")
    eventually(lambda: k.deployment().spec.replicas == 0, what="rollout scaled to zero")
    unreadable = k.condition("ProgressUnreadable")
    assert unreadable is None or unreadable["status"] == "False"       # file:// storage: readable, no hint


def test_helm_uninstall_is_refused_while_a_job_is_unfinished(k, operator_kubeconfig):
    """Issue 36: `helm uninstall` with jobs running gave no warning, and a job that then finished
    kept its rollout pod (and its GPUs) and read Running. The chart's pre-delete hook runs
    `grpo operator check-uninstall` as the operator's ServiceAccount (its RBAC is the chart's):
    it fails, naming the unfinished jobs, and succeeds once none is left."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    grpo = Path(sys.executable).parent / "grpo"

    def check(namespaces=""):
        env = {**os.environ, "KUBECONFIG": str(operator_kubeconfig), "GRPO_OPERATOR_NAMESPACES": namespaces}
        return subprocess.run([str(grpo), "operator", "check-uninstall"], env=env, capture_output=True, text=True,
                              timeout=120)

    k.create("live")
    k.create("done", **{"rollout.template": {"spec": {"hostNetwork": True}}})   # refused: finished, Failed
    k.wait_phase("Failed", name="done")
    # Every namespace (the chart's default; other tests' jobs may be listed too), then only this one.
    everywhere = check()
    assert everywhere.returncode == 1 and f"{k.ns}/live (" in everywhere.stderr, everywhere.stdout + everywhere.stderr
    refused = check(namespaces=k.ns)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"{k.ns}/live (" in refused.stderr and f"{k.ns}/done" not in refused.stderr
    assert "helm uninstall --no-hooks" in refused.stderr
    assert check(namespaces="some-other-namespace").returncode == 0      # watchNamespaces: only those
    k.custom.delete_namespaced_custom_object("grpo.dev", "v1alpha1", k.ns, "grpojobs", "live")
    eventually(lambda: k.get("live") is None, timeout=60, what="the live job gone")
    allowed = check(namespaces=k.ns)
    assert allowed.returncode == 0 and "can be uninstalled" in allowed.stdout, allowed.stdout + allowed.stderr
