"""The operator against a real kube-apiserver + kube-controller-manager, running as a subprocess
under the chart's ServiceAccount and RBAC. The tests play the kubelet (pod status patches); the
Job, ReplicaSet and garbage-collector controllers are the real ones."""

from __future__ import annotations

import base64
import json
import signal
import time
from datetime import datetime, timezone

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from operator_helpers import GROUP, PLURAL, VERSION, body, eventually, kubectl
from operator_process import OPERATOR_NS, OperatorProcess, render_rbac

pytestmark = pytest.mark.controlplane


# --- helpers ---------------------------------------------------------------------------------

class Cluster:
    """Admin-side view of one test namespace."""

    def __init__(self, api_client, ns: str, storage_root):
        self.ns, self.storage_root = ns, storage_root
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.net = client.NetworkingV1Api(api_client)

    def create(self, name="demo", **changes) -> dict:
        changes = {"storage.uri": f"file://{self.storage_root}", "storage.secretRef": None, **changes}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body(name, self.ns, **changes))

    def get(self, name="demo") -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_spec(self, name, spec: dict) -> dict:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    def status(self, name="demo") -> dict:
        return (self.get(name) or {}).get("status") or {}

    def condition(self, type_, name="demo") -> dict | None:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == type_), None)

    def wait_phase(self, phase, name="demo", timeout=30) -> dict:
        return eventually(lambda: self.status(name) if self.status(name).get("phase") == phase else None,
                          timeout=timeout, what=f"{name} phase {phase} (now {self.status(name)})")

    def trainer_job(self, name="demo"):
        try:
            return self.batch.read_namespaced_job(f"{name}-trainer", self.ns)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def deployment(self, name="demo"):
        try:
            return self.apps.read_namespaced_deployment(f"{name}-rollout", self.ns)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def pods(self, name="demo", role=None):
        selector = f"grpo.dev/job={name}" + (f",grpo.dev/role={role}" if role else "")
        return [p for p in self.core.list_namespaced_pod(self.ns, label_selector=selector).items
                if p.metadata.deletion_timestamp is None]

    def trainer_pods(self, name="demo", attempt=None, count=2):
        def current():
            pods = [p for p in self.pods(name, "trainer")
                    if attempt is None or p.metadata.labels.get("grpo.dev/attempt") == str(attempt)]
            return pods if len(pods) >= count else None
        return eventually(current, what=f"{count} trainer pods of {name} (attempt {attempt})")

    def kubelet(self, pod, phase, *, waiting=None, exit_code=None, message=None, reason=None):
        """What the kubelet would report for the pod (`message`: the termination message, which
        FallbackToLogsOnError fills with the end of the log, or the waiting state's message;
        `reason`: the terminated state's, e.g. OOMKilled)."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if waiting:
            state = {"waiting": {"reason": waiting, "message": message or f"{waiting}: pull access denied for the image"}}
        elif exit_code is not None:
            state = {"terminated": {"exitCode": exit_code,
                                    "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                                    "startedAt": now, "finishedAt": now, **({"message": message} if message else {})}}
        else:
            state = {"running": {"startedAt": now}}
        c = pod.spec.containers[0]
        status = {"phase": phase, "containerStatuses": [{
            "name": c.name, "image": c.image, "imageID": "", "ready": phase == "Running",
            "restartCount": 0, "state": state}]}
        if phase == "Running":
            status["conditions"] = [{"type": "Ready", "status": "True"}]
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.ns, {"status": status})

    def run_all(self, name="demo", trainer_count=2, rollout_count=2, attempt=None):
        for p in self.trainer_pods(name, attempt=attempt, count=trainer_count):
            self.kubelet(p, "Running")
        rollouts = eventually(lambda: (ps := self.pods(name, "rollout")) and len(ps) >= rollout_count and ps,
                              what="rollout pods")
        for p in rollouts:
            self.kubelet(p, "Running")

    def events(self, name="demo") -> list:
        return [e for e in self.core.list_namespaced_event(self.ns).items
                if e.involved_object.kind == "GRPOJob" and e.involved_object.name == name]

    def wait_event(self, reason, name="demo"):
        """The job's first event with `reason`; events are posted after the status is written."""
        return eventually(lambda: next((e for e in self.events(name) if e.reason == reason), None),
                          what=f"a {reason} event on {name} (now {[e.reason for e in self.events(name)]})")

    def children(self, name="demo") -> dict[str, list]:
        sel = f"grpo.dev/job={name}"
        return {
            "configmaps": self.core.list_namespaced_config_map(self.ns, label_selector=sel).items,
            "secrets": self.core.list_namespaced_secret(self.ns, label_selector=sel).items,
            "services": self.core.list_namespaced_service(self.ns, label_selector=sel).items,
            "jobs": self.batch.list_namespaced_job(self.ns, label_selector=sel).items,
            "deployments": self.apps.list_namespaced_deployment(self.ns, label_selector=sel).items,
            "networkpolicies": self.net.list_namespaced_network_policy(self.ns, label_selector=sel).items,
            "podmonitors": self.custom.list_namespaced_custom_object(
                "monitoring.coreos.com", "v1", self.ns, "podmonitors", label_selector=sel)["items"],
        }


@pytest.fixture
def k(admin_client, namespace, storage_root, operator) -> Cluster:
    return Cluster(admin_client, namespace, storage_root)


def table(text: str) -> list[dict[str, str]]:
    """kubectl's table output as rows of {column: cell}, cut at the header's column starts (a
    cell may be empty)."""
    header, *lines = text.splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    cut = lambda line: [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]  # noqa: E731
    return [dict(zip(cut(header), cut(line))) for line in lines]


def write_progress(k: "Cluster", name, **progress):
    """progress.json where the trainer of the object `name` now in the API writes it (its uid's run)."""
    root = k.storage_root / k.ns / name / k.get(name)["metadata"]["uid"]
    root.mkdir(parents=True, exist_ok=True)
    (root / "progress.json").write_text(json.dumps(progress))


# --- tests -----------------------------------------------------------------------------------

def test_create_makes_owned_children_wired_for_torchrun(k, control_plane, kubectl_bin):
    gj = k.create()
    uid = gj["metadata"]["uid"]
    kids = eventually(lambda: (c := k.children()) and all(c.values()) and c, what="every child")
    assert {kind: [o["metadata"]["name"] if isinstance(o, dict) else o.metadata.name for o in objs]
            for kind, objs in kids.items()} == {
        "configmaps": ["demo-spec"], "secrets": ["demo-rpc"], "services": ["demo-rollout", "demo-trainer"],
        "jobs": ["demo-trainer"], "deployments": ["demo-rollout"],
        "networkpolicies": ["demo-rollout", "demo-trainer"], "podmonitors": ["demo"]}
    for objs in kids.values():
        for o in objs:
            refs = o["metadata"]["ownerReferences"] if isinstance(o, dict) else o.metadata.owner_references
            (ref,) = refs
            ref = ref if isinstance(ref, dict) else ref.to_dict()
            assert ref["uid"] == uid and ref["controller"] is True
            assert ref.get("blockOwnerDeletion", ref.get("block_owner_deletion")) is True

    # The Job controller makes one pod per node rank, with the rendezvous hostname.
    pods = sorted(k.trainer_pods(), key=lambda p: p.spec.hostname)
    assert [p.spec.hostname for p in pods] == ["demo-trainer-0", "demo-trainer-1"]
    for p in pods:
        assert p.spec.subdomain == "demo-trainer"
        c = p.spec.containers[0]
        env = {e.name: e for e in c.env}
        assert "JOB_COMPLETION_INDEX" in env               # injected by the Job controller
        assert "--node-rank=$(JOB_COMPLETION_INDEX)" in c.args
        assert "--master-addr=demo-trainer-0.demo-trainer" in c.args
        assert f"dns:///demo-rollout.{k.ns}.svc.cluster.local:50051" in c.args
        assert c.resources.limits["nvidia.com/gpu"] == "4"
    # The trainer's c10d port takes only the job's own pods (issue 22).
    trainer_policy = k.net.read_namespaced_network_policy("demo-trainer", k.ns).spec
    assert trainer_policy.pod_selector.match_labels == {"grpo.dev/job": "demo", "grpo.dev/role": "trainer"}
    peers = [p.pod_selector.match_labels for p in trainer_policy.ingress[0]._from]
    assert peers == [{"grpo.dev/job": "demo", "grpo.dev/role": "trainer"},      # torchrun, NCCL between nodes
                     {"grpo.dev/job": "demo", "grpo.dev/role": "rollout"}]      # the nccl weight sync
    assert [p.port for p in trainer_policy.ingress[1].ports] == [9090]
    # A rollout server whose engine hangs is restarted; loading the model isn't cut short.
    rollout = eventually(lambda: k.pods("demo", "rollout"), what="rollout pods")[0].spec.containers[0]
    assert rollout.liveness_probe.http_get.path == "/live?stuckAfterSeconds=1800"
    assert rollout.startup_probe.http_get.path == "/ready" and rollout.startup_probe.failure_threshold == 360
    assert k.status()["phase"] == "Pending"
    assert k.condition("Created")["status"] == "True"
    k.wait_event("TrainerCreated")

    k.run_all()
    st = k.wait_phase("Running")
    assert k.condition("Running")["status"] == "True"
    assert st["observedGeneration"] == 1 and st["startTime"]

    write_progress(k, "demo", step=3, totalSteps=10, epoch=0, policyVersion=3,
                   rewardMean=0.625, validationScore=0.5, lastCheckpoint="file:///x/checkpoints/step-2",
                   tokensPerSecond=123.0)
    eventually(lambda: (k.status().get("progress") or {}).get("step") == 3, what="progress in the status")
    assert k.status()["progress"] == {"step": 3, "totalSteps": 10, "epoch": 0, "policyVersion": 3,
                                      "rewardMean": 0.625, "validationScore": 0.5,
                                      "lastCheckpoint": "file:///x/checkpoints/step-2"}
    out = kubectl(kubectl_bin, control_plane, "-n", k.ns, "get", "gj").stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "STEP", "TOTAL", "REWARD", "VAL", "AGE"]
    assert out[1].split()[:6] == ["demo", "Running", "3", "10", "0.625", "0.5"]

    # The token, the checkpoint key and the TLS key are in the Secret and nowhere else the operator
    # writes; its certificate is the job CA's, for the rollout Service's name the trainer checks.
    from cryptography import x509
    data = {key: base64.b64decode(v).decode() for key, v in k.core.read_namespaced_secret("demo-rpc", k.ns).data.items()}
    assert set(data) == {"token", "checkpoint-key", "ca.crt", "tls.crt", "tls.key"}
    assert len(data["token"]) == 64 and len(bytes.fromhex(data["checkpoint-key"])) == 32
    for plain in (data["token"], data["checkpoint-key"], data["tls.key"]):
        assert plain not in json.dumps(k.get()) and plain not in json.dumps(kids["configmaps"][0].data)
    ca, cert = (x509.load_pem_x509_certificate(data[key].encode()) for key in ("ca.crt", "tls.crt"))
    cert.verify_directly_issued_by(ca)
    names_in_cert = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"demo-rollout.{k.ns}.svc" in names_in_cert.get_values_for_type(x509.DNSName)


CRASH_LOG = "step 3: loss 0.41\nTraceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory"


def test_trainer_failure_restarts_then_fails_after_backoff_limit(k, control_plane, kubectl_bin):
    gj = k.create(**{"runPolicy.backoffLimit": 1})
    first = k.trainer_pods(attempt=0)
    old_uid = k.trainer_job().metadata.uid
    rank0 = next(p for p in first if p.spec.hostname == "demo-trainer-0")
    k.kubelet(rank0, "Failed", exit_code=1, message=CRASH_LOG)     # the Job fails (backoffLimit 0)
    st = k.wait_phase("Restarting")
    assert st["restarts"] == 1
    new = eventually(lambda: (j := k.trainer_job()) and j.metadata.uid != old_uid and j, what="a new trainer Job")
    assert new.metadata.labels["grpo.dev/attempt"] == "1"
    failed_event = k.wait_event("TrainerFailed")
    assert "restart 1 of 1" in failed_event.message and failed_event.type == "Warning"
    # Why it failed outlives the Job: the exit code and the end of the log (issue 22).
    exit_line = f"pod {rank0.metadata.name} exited with code 1 (Error): {CRASH_LOG}"
    assert exit_line in failed_event.message
    assert k.condition("TrainerFailed")["status"] == "True" and exit_line in k.condition("TrainerFailed")["message"]
    # ... and the failed attempt's pod stays for `kubectl logs`, owned by the GRPOJob now.
    (kept,) = [p for p in k.pods("demo", "trainer") if p.metadata.labels["grpo.dev/attempt"] == "0"]
    assert kept.metadata.name == rank0.metadata.name
    assert gj["metadata"]["uid"] in [o.uid for o in kept.metadata.owner_references]

    # Until the next attempt runs.
    for p in k.trainer_pods(attempt=1):
        k.kubelet(p, "Running")
    k.wait_phase("Running")
    eventually(lambda: not [p for p in k.pods("demo", "trainer") if p.metadata.labels["grpo.dev/attempt"] == "0"],
               what="the failed attempt's pod deleted once attempt 1 runs")
    recovered = k.condition("TrainerFailed")
    assert recovered["status"] == "False" and exit_line in recovered["message"]     # still said

    k.kubelet(k.trainer_pods(attempt=1)[1], "Failed", exit_code=137, message="Killed")
    st = k.wait_phase("Failed")
    assert st["restarts"] == 1 and st["completionTime"]
    failed = k.condition("Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "runPolicy.backoffLimit=1" in failed["message"]
    assert "exited with code 137 (SIGKILL, Error): Killed" in failed["message"]
    eventually(lambda: k.deployment().spec.replicas == 0, what="rollout scaled to zero")
    assert k.trainer_job().metadata.labels["grpo.dev/attempt"] == "1"   # kept for `kubectl logs`
    wide = table(kubectl(kubectl_bin, control_plane, "-n", k.ns, "get", "gj", "-o", "wide").stdout)
    assert list(wide[0])[-4:] == ["RESTARTS", "RESUMED-FROM", "EPOCH", "REASON"]
    assert (wide[0]["PHASE"], wide[0]["RESTARTS"], wide[0]["REASON"]) == ("Failed", "1", "BackoffLimitExceeded")


def test_success_scales_rollout_to_zero_then_ttl_deletes_the_job(k, operator):
    k.create(**{"runPolicy.ttlSecondsAfterFinished": 12})
    k.run_all()
    k.wait_phase("Running")
    write_progress(k, "demo", step=10, totalSteps=10, rewardMean=0.75)
    for p in k.trainer_pods():
        k.kubelet(p, "Succeeded", exit_code=0)
    st = k.wait_phase("Succeeded")
    assert st["completionTime"] and k.condition("Succeeded")["status"] == "True"
    assert st["progress"]["step"] == 10                      # the final step's numbers
    eventually(lambda: k.deployment().spec.replicas == 0, what="rollout scaled to zero")
    write_progress(k, "demo", step=99)
    operator.wait_for_resyncs()                              # resyncs ran: a finished job's progress stays
    st = k.status()
    assert st, "the TTL deleted the job before two resyncs ran: raise ttlSecondsAfterFinished"
    assert st["progress"]["step"] == 10
    eventually(lambda: k.get() is None, timeout=30, what="the TTL to delete the GRPOJob")
    eventually(lambda: not any(k.children().values()), timeout=30, what=f"the garbage collector ({k.children()})")


def test_progress_the_operator_cannot_read_is_a_condition_not_a_log_line_per_resync(k, operator):
    """The chart's defaults give the operator no S3 credentials: say so in the status (why Step,
    Reward and Val stay empty), once in the log and the events, not at every resync (issue 22)."""
    k.create(**{"storage.uri": "s3://runs/team-a", "storage.secretRef": "s3-credentials"})
    c = eventually(lambda: (c := k.condition("ProgressUnreadable")) and c["status"] == "True" and c,
                   what="the ProgressUnreadable condition")
    assert c["reason"] == "StorageUnreadable" and "AWS_ACCESS_KEY_ID" in c["message"]
    assert "operator.storageCredentialsSecret" in c["message"]
    assert k.wait_event("ProgressUnreadable").type == "Warning"
    operator.wait_for_resyncs(3)                             # a few resyncs, each reading progress
    logged = [ln for ln in operator.logs().splitlines() if f"{k.ns}/demo: can't read progress" in ln]
    assert len(logged) == 1, logged
    assert [e.reason for e in k.events()].count("ProgressUnreadable") == 1


def test_image_pull_error_is_surfaced_and_the_pending_deadline_fails_the_job(k, control_plane, kubectl_bin):
    k.create(**{"runPolicy.pendingDeadlineSeconds": 8})
    for p in k.trainer_pods():
        k.kubelet(p, "Pending", waiting="ErrImagePull")
    eventually(lambda: (c := k.condition("PodsPending")) and c["reason"] == "ErrImagePull" and c,
               what="the pull error in the status")
    assert "pull access denied" in k.condition("PodsPending")["message"]
    # why it waits, without `describe`: the Reason column (issue 36)
    wide = table(kubectl(kubectl_bin, control_plane, "-n", k.ns, "get", "gj", "-o", "wide").stdout)
    assert (wide[0]["PHASE"], wide[0]["REASON"]) == ("Pending", "ErrImagePull"), wide
    assert k.wait_event("ErrImagePull").type == "Warning"
    k.wait_phase("Failed", timeout=30)
    failed = k.condition("Failed")
    assert failed["reason"] == "PendingDeadlineExceeded" and "ErrImagePull" in failed["message"]
    eventually(lambda: k.trainer_job() is None, what="the pending trainer Job removed")
    eventually(lambda: k.deployment().spec.replicas == 0, what="rollout scaled to zero")


def test_active_deadline_fails_a_running_job(k):
    k.create(**{"runPolicy.activeDeadlineSeconds": 4})
    k.run_all()
    k.wait_phase("Failed", timeout=30)
    assert k.condition("Failed")["reason"] == "DeadlineExceeded"
    eventually(lambda: k.trainer_job() is None, what="the trainer stopped")


def test_suspend_removes_pods_and_resume_recreates_them(k):
    k.create()
    k.run_all()
    k.wait_phase("Running")
    cm_uid = k.core.read_namespaced_config_map("demo-spec", k.ns).metadata.uid
    k.patch_spec("demo", {"runPolicy": {"suspend": True}})
    k.wait_phase("Suspended")
    eventually(lambda: k.trainer_job() is None and k.deployment() is None, what="the pods removed")
    eventually(lambda: k.condition("Suspended")["reason"] == "Suspended", what="suspended")
    assert k.core.read_namespaced_config_map("demo-spec", k.ns).metadata.uid == cm_uid   # the spec stays
    # The Job and the Deployment are gone; the garbage collector deletes their pods after them.
    eventually(lambda: not k.pods(), what=f"the pods deleted (left: {[p.metadata.name for p in k.pods()]})")

    k.patch_spec("demo", {"runPolicy": {"suspend": False}})
    eventually(lambda: k.trainer_job() is not None and k.deployment() is not None, what="the pods recreated")
    assert k.trainer_job().metadata.labels["grpo.dev/attempt"] == "0"   # a resume is not a restart
    k.run_all(attempt=0)
    st = k.wait_phase("Running")
    assert st["restarts"] == 0 and k.condition("Suspended")["status"] == "False"
    k.wait_event("Suspended")
    k.wait_event("Resumed")


def test_rollout_replicas_scale_while_running(k):
    k.create()
    eventually(lambda: k.deployment() is not None, what="the rollout Deployment")
    k.patch_spec("demo", {"rollout": {"replicas": 3}})
    eventually(lambda: k.deployment().spec.replicas == 3, what="scaled to 3")
    eventually(lambda: len(k.pods("demo", "rollout")) == 3, what="3 rollout pods")
    eventually(lambda: k.status().get("observedGeneration") == 2, what="observedGeneration 2")


def test_kubectl_scale_sets_the_rollout_replicas(k, control_plane, kubectl_bin):
    """The scale subresource (issue 36): `kubectl scale gj` scales the rollout servers, the one
    part of a job that scales; the status counts the ready ones."""
    k.create()
    eventually(lambda: k.deployment() is not None, what="the rollout Deployment")
    kubectl(kubectl_bin, control_plane, "-n", k.ns, "scale", "gj", "demo", "--replicas=2")
    assert k.get()["spec"]["rollout"]["replicas"] == 2
    eventually(lambda: k.deployment().spec.replicas == 2, what="scaled to 2")
    k.run_all(rollout_count=2)
    eventually(lambda: k.status().get("rolloutReplicas") == 2, what="2 ready rollout servers in the status")
    out = kubectl(kubectl_bin, control_plane, "-n", k.ns, "get", "gj", "demo", "--subresource=scale",
                  "-o", "jsonpath={.spec.replicas} {.status.replicas}").stdout
    assert out.split() == ["2", "2"]


def test_a_spec_made_invalid_while_running_stops_the_job(k):
    k.create()
    k.run_all()
    k.wait_phase("Running")
    k.patch_spec("demo", {"rollout": {"template": {"spec": {"hostNetwork": True}}}})   # mutable, but refused
    k.wait_phase("Failed")
    assert k.condition("Invalid")["message"].startswith("spec.rollout.template.spec.hostNetwork")
    eventually(lambda: k.deployment().spec.replicas == 0, what="rollout scaled to zero")
    eventually(lambda: k.trainer_job() is None, what="the trainer stopped")


@pytest.mark.parametrize("spec, field", [
    ({"trainer": {"nnodes": 4}}, "spec.trainer"), ({"model": {"path": "other/model"}}, "spec.model"),
    ({"algorithm": {"clipRatioHigh": 0.28}}, "spec.algorithm"),
    ({"resume": "never"}, "spec.resume"),                                 # a string, not a section
    # what the running pods never pick up (issue 22): the group size, the engine, the GPUs per server
    ({"rollout": {"n": 8}}, "spec.rollout.n"), ({"rollout": {"engine": "hf"}}, "spec.rollout.engine"),
    ({"rollout": {"tensorParallelSize": 1}}, "spec.rollout.tensorParallelSize"),
    ({"rollout": {"temperature": 0.7}}, "spec.rollout.temperature"),
])
def test_the_api_server_refuses_changes_a_running_job_would_not_honour(k, spec, field):
    k.create()
    with pytest.raises(ApiException) as refused:
        k.patch_spec("demo", spec)
    assert refused.value.status == 422
    assert f"{field} can't change while the job exists: the pods read it once, at start (only " \
           "spec.rollout.replicas, spec.rollout.template, spec.runPolicy can change)" in refused.value.body
    assert k.get()["metadata"]["generation"] == 1


def test_a_job_deleted_and_applied_again_is_a_new_run(k, operator):
    """Issue 36, bug 3: the re-created object has its own run (storage under its uid): it never
    shows the old object's progress, and the old run's files stay where they were."""
    first = k.create()
    k.run_all()
    k.wait_phase("Running")
    write_progress(k, "demo", step=7, totalSteps=10, rewardMean=0.5)
    eventually(lambda: (k.status().get("progress") or {}).get("step") == 7, what="the first run's progress")
    old_run = k.status()["runUri"]
    assert old_run == f"file://{k.storage_root}/{k.ns}/demo/{first['metadata']['uid']}"
    k.custom.delete_namespaced_custom_object(GROUP, VERSION, k.ns, PLURAL, "demo")
    eventually(lambda: k.get() is None and not any(k.children().values()), timeout=60, what="the first job gone")

    second = k.create()
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    eventually(lambda: k.status().get("runUri"), what="the new job's run")
    assert k.status()["runUri"] == f"file://{k.storage_root}/{k.ns}/demo/{second['metadata']['uid']}"
    spec = yaml.safe_load(eventually(lambda: k.children()["configmaps"], what="the spec ConfigMap")[0]
                          .data["job.yaml"])
    assert spec["metadata"]["uid"] == second["metadata"]["uid"]           # the pods write the new run
    k.run_all()
    k.wait_phase("Running")
    operator.wait_for_resyncs()
    assert k.status().get("progress") is None                            # not the old object's step 7
    assert (k.storage_root / k.ns / "demo" / first["metadata"]["uid"] / "progress.json").exists()


def test_delete_garbage_collects_every_child(k):
    k.create()
    eventually(lambda: all(k.children().values()), what="every child")
    k.trainer_pods()
    k.custom.delete_namespaced_custom_object(GROUP, VERSION, k.ns, PLURAL, "demo")
    eventually(lambda: not any(k.children().values()) and not k.pods(), timeout=60,
               what="the garbage collector to delete the children and pods")


@pytest.mark.parametrize("changes, field", [
    # (a missing storage.uri is refused by the API server now: tests/faults/test_bad_input_crd.py)
    ({"trainer.template": {"spec": {"hostNetwork": True}}}, "spec.trainer.template.spec.hostNetwork"),
])
def test_invalid_job_creates_nothing(k, operator, changes, field):
    k.create(**changes)
    st = k.wait_phase("Failed")
    invalid = k.condition("Invalid")
    assert invalid["status"] == "True" and invalid["reason"] == "InvalidSpec" and invalid["message"].startswith(field)
    assert k.wait_event("InvalidSpec").type == "Warning"
    operator.wait_for_resyncs()   # resyncs ran: still nothing
    assert not any(k.children().values()) and not k.pods()
    assert st["completionTime"]


def made_so_far(k) -> tuple[set[str], set[str]]:
    """The namespace's jobs that have their token Secret (the first thing a new job's reconcile
    creates, reconciler.Reconciler._act), and those that have their trainer Job (the last)."""
    sel = "grpo.dev/job"
    secrets = {s.metadata.labels[sel] for s in k.core.list_namespaced_secret(k.ns, label_selector=sel).items}
    trainers = {j.metadata.labels[sel] for j in k.batch.list_namespaced_job(k.ns, label_selector=sel).items}
    return secrets, trainers


def stop_mid_reconcile(k, operator, names) -> set[str]:
    """Lets the paused operator run in 10 ms steps until some job has its first child but not
    its last, and returns those jobs, with the operator stopped (SIGSTOP) right there."""
    def step():
        operator.resume()
        time.sleep(0.01)
        operator.pause()
        time.sleep(0.05)                   # the API calls it had sent land
        secrets, trainers = made_so_far(k)
        if not secrets - trainers and trainers >= set(names):
            pytest.fail(f"every job was done within one step, none seen part-way: {trainers}")
        return secrets - trainers
    return eventually(step, timeout=60, interval=0, what="a job with its Secret but no trainer Job yet")


def test_operator_killed_mid_reconcile_leaves_no_duplicates(k, operator):
    """SIGKILL while a job's first reconcile is part-way (its Secret made, its trainer Job not
    yet): the restarted operator finishes it and the others, and nothing exists twice."""
    names = ["a", "b", "c"]
    operator.pause()                       # the jobs' events wait until stop_mid_reconcile steps
    try:
        for n in names:
            k.create(n)
        part_way = stop_mid_reconcile(k, operator, names)
        secrets, _ = made_so_far(k)
        # The token, certificate and checkpoint key handed out so far: a running pod would hold them.
        tokens = {n: k.core.read_namespaced_secret(f"{n}-rpc", k.ns).data for n in secrets}
    except BaseException:
        operator.resume()                  # the other tests' operator
        raise
    operator.kill(signal.SIGKILL)          # stopped, so exactly there
    assert part_way <= set(tokens)
    operator.start()
    for n in names:
        eventually(lambda: all(k.children(n).values()), what=f"{n}'s children")
        k.trainer_pods(n)
    operator.wait_for_resyncs()            # resyncs ran since: nothing changes any more
    for n in names:
        kids = k.children(n)
        assert {kind: len(objs) for kind, objs in kids.items()} == {
            "configmaps": 1, "secrets": 1, "services": 2, "jobs": 1, "deployments": 1, "networkpolicies": 2,
            "podmonitors": 1}
        # Re-applying the Deployment after a restart must not change its template.
        rs = k.apps.list_namespaced_replica_set(k.ns, label_selector=f"grpo.dev/job={n}").items
        assert len(rs) == 1
        assert len(k.trainer_pods(n)) == 2
        if n in tokens:   # the token, certificate and checkpoint key a running pod holds stay valid
            assert k.core.read_namespaced_secret(f"{n}-rpc", k.ns).data == tokens[n], n
        st = k.status(n)
        assert st["phase"] == "Pending" and st["restarts"] == 0
        assert k.trainer_job(n).metadata.labels["grpo.dev/attempt"] == "0"
        # Never two (the second create finds the first Job); none when the kill fell between the
        # create and its event.
        assert [e.reason for e in k.events(n)].count("TrainerCreated") <= 1


def test_operator_exports_its_metrics_and_reports_healthy(operator, k):
    k.create()
    k.wait_phase("Pending")
    text = eventually(lambda: 'grpo_operator_jobs{namespace="%s",phase="Pending"} 1.0' % k.ns in (t := operator.metrics())
                      and t, what="the job in the operator's metrics")
    assert "grpo_operator_reconcile_duration_seconds_count" in text
    before = operator.resyncs()
    eventually(lambda: operator.resyncs() > before, what="the resync loop to count a pass")
    assert operator.healthy()


def test_operator_was_never_forbidden(operator):
    """Runs last: the chart's RBAC covered every call the other tests made the operator do."""
    lines = operator.logs().splitlines()
    assert not [ln for ln in lines if "is forbidden: User" in ln][:3]        # an RBAC denial
    assert not [ln for ln in lines if "reconcile failed" in ln][:3]


def test_namespaced_operator_needs_only_roles(k, operator, control_plane, kubectl_bin, tmp_path):
    """watchNamespaces: the chart's Role in the namespace and nothing cluster-wide suffice."""
    kubectl(kubectl_bin, control_plane, "apply", "-f", "-",
            stdin=render_rbac(f"watchNamespaces={{{k.ns}}}", release="scoped"))
    scoped = OperatorProcess(control_plane.kubeconfig_for_service_account(OPERATOR_NS, "scoped-grpo-operator"),
                             tmp_path, namespaces=k.ns)
    operator.kill(signal.SIGTERM)          # one operator per job at a time
    try:
        scoped.start()
        k.create()
        eventually(lambda: all(k.children().values()), what="every child, made by the namespaced operator")
        k.run_all()
        k.wait_phase("Running")
        scoped.kill(signal.SIGTERM)
        lines = scoped.logs().splitlines()
        assert not [ln for ln in lines if "is forbidden: User" in ln or "reconcile failed" in ln][:3]
    finally:
        scoped.kill(signal.SIGKILL)
        operator.start()


# --- reward models (issue 31) ----------------------------------------------------------------

REWARD_MODELS = [{"name": "skywork", "path": "/models/skywork-rm", "replicas": 2, "gpus": 1},
                 {"name": "judge", "kind": "judge", "path": "/models/judge", "gpus": 0, "engine": "hf",
                  "promptTemplate": "Q: {prompt} A: {response} score?"}]


def test_reward_models_are_served_by_their_own_deployments_and_stop_with_the_job(k):
    """The API server admits rewardModels; each gets an owned Deployment and headless Service, only
    the rollout pods reach them, the rollout servers are told where they are, the certificate names
    them, and a succeeded job scales them to zero with the rollout."""
    uid = k.create(**{"reward.rewardModels": REWARD_MODELS})["metadata"]["uid"]
    rm = {m: eventually(lambda m=m: _read(k.apps.read_namespaced_deployment, f"demo-rm-{m}", k.ns),
                        what=f"the {m} Deployment") for m in ("skywork", "judge")}
    for model, deployment in rm.items():
        (ref,) = deployment.metadata.owner_references
        assert ref.uid == uid and ref.controller is True
        svc = k.core.read_namespaced_service(f"demo-rm-{model}", k.ns)
        assert svc.spec.cluster_ip == "None" and svc.spec.selector["grpo.dev/reward-model"] == model
        assert svc.metadata.owner_references[0].uid == uid
    assert rm["skywork"].spec.replicas == 2 and rm["judge"].spec.replicas == 1
    # The ReplicaSet controller makes the reward pods from the operator's template.
    pods = eventually(lambda: (ps := k.pods("demo", "reward")) and len(ps) == 3 and ps, what="3 reward pods")
    sky = next(p for p in pods if p.metadata.labels["grpo.dev/reward-model"] == "skywork").spec.containers[0]
    assert sky.args[:5] == ["reward", "--spec", "/etc/grpo/job.yaml", "--model", "skywork"]
    assert sky.resources.limits["nvidia.com/gpu"] == "1"
    assert sky.readiness_probe.http_get.path == "/ready" and sky.liveness_probe.http_get.path == "/live"
    secret_env = {e.name: e.value_from.secret_key_ref.key for e in sky.env if e.value_from and e.value_from.secret_key_ref}
    assert secret_env == {"GRPO_RPC_TOKEN": "token", "GRPO_TLS_CERT": "tls.crt", "GRPO_TLS_KEY": "tls.key"}
    # Only this job's rollout pods reach their gRPC port.
    policy = k.net.read_namespaced_network_policy("demo-reward", k.ns).spec
    assert policy.pod_selector.match_labels == {"grpo.dev/job": "demo", "grpo.dev/role": "reward"}
    assert [p.pod_selector.match_labels for p in policy.ingress[0]._from] == [{"grpo.dev/job": "demo",
                                                                               "grpo.dev/role": "rollout"}]
    assert [p.port for p in policy.ingress[0].ports] == [50051]
    # The rollout servers get every model's Service and the CA to check it by ...
    rollout_env = {e.name: e for e in k.deployment().spec.template.spec.containers[0].env}
    assert rollout_env["GRPO_REWARD_ADDRESSES"].value == (
        f"skywork=dns:///demo-rm-skywork.{k.ns}.svc:50051;judge=dns:///demo-rm-judge.{k.ns}.svc:50051")
    assert rollout_env["GRPO_TLS_CA"].value_from.secret_key_ref.key == "ca.crt"
    # ... and the job's certificate carries those names.
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(base64.b64decode(k.core.read_namespaced_secret("demo-rpc", k.ns).data["tls.crt"]))
    dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {f"demo-rm-skywork.{k.ns}.svc", f"demo-rm-judge.{k.ns}.svc", f"demo-rollout.{k.ns}.svc"} <= set(dns)

    k.run_all()
    for p in pods:
        k.kubelet(p, "Running")
    k.wait_phase("Running")
    for p in k.trainer_pods():
        k.kubelet(p, "Succeeded", exit_code=0)
    k.wait_phase("Succeeded")
    eventually(lambda: all(k.apps.read_namespaced_deployment(f"demo-rm-{m}", k.ns).spec.replicas == 0
                           for m in ("skywork", "judge")), what="the reward models scaled to zero")
    assert k.deployment().spec.replicas == 0


def test_a_reward_pod_that_cannot_start_is_in_the_status_and_kubectl_get(k, control_plane, kubectl_bin):
    """A reward server whose image can't be pulled holds the job Pending with the pod named, as a
    trainer or rollout pod would (the pods view covers every pod of the job)."""
    k.create(**{"reward.rewardModels": REWARD_MODELS[:1]})
    (pod, *_) = eventually(lambda: k.pods("demo", "reward"), what="a reward pod")
    k.kubelet(pod, "Pending", waiting="ErrImagePull")
    c = eventually(lambda: (c := k.condition("PodsPending")) and c["reason"] == "ErrImagePull" and c,
                   what="the reward pod's pull error in the status")
    assert pod.metadata.name in c["message"]
    wide = table(kubectl(kubectl_bin, control_plane, "-n", k.ns, "get", "gj", "-o", "wide").stdout)
    assert (wide[0]["PHASE"], wide[0]["REASON"]) == ("Pending", "ErrImagePull"), wide


def test_a_crash_looping_rollout_server_is_a_condition_and_its_bad_input_fails_the_job(k, control_plane, kubectl_bin):
    """Issue 48, item 12: a server pod that crash-loops left the job `Running` with no reason. The
    kubelet's shapes: CrashLoopBackOff waiting, the crash (and its log's end) in lastState."""
    def crash_loop(pod, exit_code, message):
        c = pod.spec.containers[0]
        k.core.patch_namespaced_pod_status(pod.metadata.name, k.ns, {"status": {
            "phase": "Running", "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{
                "name": c.name, "image": c.image, "imageID": "", "ready": False, "restartCount": 2,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed"}},
                "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message,
                                             "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:00:05Z"}}}]}})

    k.create()
    k.run_all()
    k.wait_phase("Running")
    pod = k.pods("demo", "rollout")[0]
    crash_loop(pod, 1, "RuntimeError: CUDA error: no kernel image is available")
    c = eventually(lambda: (c := k.condition("ServersFailing")) and c["status"] == "True" and c,
                   what="the crash loop in the status")
    assert c["reason"] == "RolloutServerFailing" and pod.metadata.name in c["message"]
    assert "exit code 1, 2 restart(s): RuntimeError: CUDA error" in c["message"]
    assert k.wait_event("RolloutServerFailing").type == "Warning"
    wide = table(kubectl(kubectl_bin, control_plane, "-n", k.ns, "get", "gj", "-o", "wide").stdout)
    assert (wide[0]["PHASE"], wide[0]["REASON"]) == ("Running", "RolloutServerFailing"), wide
    # Bad input (exit 2: `reward.function: nosuch_module:score`): not retried, everything stops.
    crash_loop(pod, 2, "rollout: spec.reward.function 'nosuch_module:score': can't import nosuch_module")
    k.wait_phase("Failed")
    failed = k.condition("Failed")
    assert failed["reason"] == "RolloutServerFailing" and "can't import nosuch_module" in failed["message"]
    eventually(lambda: k.deployment().spec.replicas == 0, what="rollout scaled to zero")
    eventually(lambda: k.trainer_job() is None, what="the trainer Job removed")


def test_suspend_removes_the_reward_and_sandbox_deployments_and_resume_recreates_them(k):
    """The python tool's sandbox pool (issue 32) lives as the reward servers do: the API server
    admits its fields, its Deployment, Service and deny-all-egress NetworkPolicy are the job's, and
    suspend removes it with the rollout servers, its only callers."""
    k.create(**{"reward.rewardModels": REWARD_MODELS[:1],
                "rollout.multiTurn": {"enable": True, "tools": ["python"], "python": {"replicas": 2}}})
    for name in ("demo-rm-skywork", "demo-sandbox"):
        eventually(lambda n=name: _read(k.apps.read_namespaced_deployment, n, k.ns), what=f"the Deployment {name}")
    policy = k.net.read_namespaced_network_policy("demo-sandbox", k.ns).spec
    assert policy.policy_types == ["Ingress", "Egress"] and not policy.egress
    rollout_env = {e.name: e for e in k.deployment().spec.template.spec.containers[0].env}
    assert rollout_env["GRPO_SANDBOX_ADDRESSES"].value == f"dns:///demo-sandbox.{k.ns}.svc:50051"
    k.patch_spec("demo", {"runPolicy": {"suspend": True}})
    k.wait_phase("Suspended")
    for name in ("demo-rm-skywork", "demo-sandbox"):
        eventually(lambda n=name: _read(k.apps.read_namespaced_deployment, n, k.ns) is None, what=f"{name} removed")
    k.patch_spec("demo", {"runPolicy": {"suspend": False}})
    d = eventually(lambda: _read(k.apps.read_namespaced_deployment, "demo-rm-skywork", k.ns), what="recreated")
    assert d.spec.replicas == 2
    sandbox = eventually(lambda: _read(k.apps.read_namespaced_deployment, "demo-sandbox", k.ns), what="recreated")
    assert sandbox.spec.replicas == 2


def _read(read, name, ns):
    try:
        return read(name, ns)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
