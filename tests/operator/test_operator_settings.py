"""Operator settings (env and flags), the operator-side validation, progress.json parsing and the
operator's metrics — the pure parts around the reconciler."""

import argparse
import json

import pytest
from prometheus_client import generate_latest

from grpo_api.spec import Progress
from grpo_operator import settings as settings_mod
from grpo_operator.metrics import METRIC_NAMES, OperatorMetrics
from grpo_operator.progress import read_progress
from grpo_operator.settings import OperatorSettings
from grpo_operator.validation import parse_grpojob
from operator_helpers import UID, body, job


def test_defaults_are_safe():
    s = OperatorSettings()
    assert s.namespaces == () and s.run_as_user == 1000 and s.read_storage_secrets is False
    assert s.trainer_termination_grace_seconds >= 600


def test_environment_overrides_defaults():
    s = OperatorSettings.from_env({
        "GRPO_OPERATOR_NAMESPACES": "team-a, team-b",
        "GRPO_OPERATOR_TRAINER_IMAGE": "reg/t:2",
        "GRPO_OPERATOR_NETWORK_POLICY": "false",
        "GRPO_OPERATOR_RESYNC_SECONDS": "2.5",
        "GRPO_OPERATOR_TRAINER_RESOURCES": '{"requests": {"cpu": "1"}}',
        "GRPO_OPERATOR_METRICS_NAMESPACE": "",
        "GRPO_OPERATOR_POD_MONITOR": "false",
        "UNRELATED": "x",
    })
    assert s.namespaces == ("team-a", "team-b") and s.trainer_image == "reg/t:2"
    assert s.network_policy is False and s.resync_seconds == 2.5 and s.pod_monitor == "false"
    assert s.trainer_resources == {"requests": {"cpu": "1"}} and s.metrics_namespace is None


@pytest.mark.parametrize("env, message", [
    ({"GRPO_OPERATOR_NETWORK_POLICY": "maybe"}, "GRPO_OPERATOR_NETWORK_POLICY: expected true or false"),
    ({"GRPO_OPERATOR_METRICS_PORT": "http"}, "GRPO_OPERATOR_METRICS_PORT: expected a number"),
    ({"GRPO_OPERATOR_TRAINER_RESOURCES": "[1]"}, "GRPO_OPERATOR_TRAINER_RESOURCES: expected a JSON object"),
    ({"GRPO_OPERATOR_POD_MONITOR": "yes"}, "GRPO_OPERATOR_POD_MONITOR: expected one of auto, true, false"),
    ({"GRPO_OPERATOR_RUN_AS_USER": "0"}, "non-root"),
])
def test_bad_environment_names_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        OperatorSettings.from_env(env)


def test_flags_win_over_the_environment():
    parser = argparse.ArgumentParser()
    settings_mod.add_arguments(parser)
    args = parser.parse_args(["--rollout-image", "reg/r:3", "--namespaces", "x"])
    s = settings_mod.from_arguments(args, env={"GRPO_OPERATOR_ROLLOUT_IMAGE": "reg/r:env",
                                               "GRPO_OPERATOR_TRAINER_IMAGE": "reg/t:env"})
    assert (s.rollout_image, s.trainer_image, s.namespaces) == ("reg/r:3", "reg/t:env", ("x",))
    assert "--trainer-termination-grace-seconds" in parser.format_help()


def _api_object(**changes):
    obj = body(**changes)
    obj["metadata"]["uid"] = UID
    return obj


def test_valid_job_parses():
    j, errors = parse_grpojob(_api_object(), OperatorSettings())
    assert errors == [] and j.metadata.name == "demo" and j.metadata.uid == UID


@pytest.mark.parametrize("changes, message", [
    ({"storage.uri": None}, "spec.storage.uri: required on Kubernetes"),
    ({"storage.uri": "file://relative/dir"}, "spec.storage.uri: a file:// URI must be absolute"),
    ({"trainer.template": {"spec": {"hostNetwork": True}}}, "spec.trainer.template.spec.hostNetwork: not allowed"),
    ({"rollout.template": {"spec": {"containers": [{"name": "x"}]}}}, "spec.rollout.template.spec.containers[0].name"),
    ({"rollout.bogus": 1}, "spec.rollout.bogus: unknown field"),
])
def test_invalid_jobs_name_the_field(changes, message):
    j, errors = parse_grpojob(_api_object(**changes), OperatorSettings())
    assert j is None and any(e.startswith(message) for e in errors), errors


def test_long_names_are_invalid():
    obj = _api_object()
    obj["metadata"]["name"] = "x" * 51
    j, errors = parse_grpojob(obj, OperatorSettings())
    assert j is None and any(e.startswith("metadata.name") for e in errors)


def test_parse_progress_keeps_the_status_keys():
    doc = {"step": 42, "totalSteps": 174, "epoch": 0.0, "policyVersion": 42, "rewardMean": 0.61,
           "validationScore": None, "lastCheckpoint": "s3://b/ckpt/step-40", "tokensPerSecond": 9.5, "updatedAt": 1.0}
    p = Progress.from_json(json.dumps(doc).encode())
    assert (p.step, p.total_steps, p.epoch, p.policy_version, p.reward_mean, p.validation_score, p.last_checkpoint) \
        == (42, 174, 0, 42, 0.61, None, "s3://b/ckpt/step-40")
    for junk in (b"", b"{", b"[1]", b'{"step": "many"}'):
        assert Progress.from_json(junk) is None


def test_progress_as_the_trainer_writes_it_is_what_the_status_shows():
    """The trainer writes progress.json with the model the operator reads: the keys are the
    status' (kubectl's columns read .status.progress.step, .rewardMean, ...), unset ones absent."""
    progress = Progress(step=4, total_steps=8, epoch=1, policy_version=4, reward_mean=0.5, best_step=2, best_score=0.75,
                        resumed_from_step=2, resumed_at="2026-12-03T17:00:00Z", reward_error_fraction=0.25,
                        tool_error_fraction=0.0)
    written = progress.to_json()
    assert json.loads(written) == {"step": 4, "totalSteps": 8, "epoch": 1, "policyVersion": 4, "rewardMean": 0.5,
                                   "bestStep": 2, "bestScore": 0.75, "resumedFromStep": 2,
                                   "resumedAt": "2026-12-03T17:00:00Z", "rewardErrorFraction": 0.25,
                                   "toolErrorFraction": 0.0}
    assert Progress.from_json(written) == progress


def test_read_progress_from_file_storage(tmp_path):
    j = job(**{"storage.uri": f"file://{tmp_path}", "storage.secretRef": None})
    assert read_progress(j, {}) == (None, None)                 # not written yet: no progress, no problem
    root = tmp_path / "team-a" / "demo" / j.metadata.uid          # each object's own run (status.runUri)
    root.mkdir(parents=True)
    (root / "progress.json").write_text(json.dumps({"step": 7, "totalSteps": 9, "rewardMean": 0.25}))
    p, error = read_progress(j, {})
    assert (p.step, p.total_steps, p.reward_mean, error) == (7, 9, 0.25, None)


def test_the_status_shows_scores_to_four_significant_digits(tmp_path):
    """kubectl's Reward, Val and Best columns print the status' floats whole (issue 48: 17 digits)."""
    j = job(**{"storage.uri": f"file://{tmp_path}", "storage.secretRef": None})
    root = tmp_path / "team-a" / "demo" / j.metadata.uid
    root.mkdir(parents=True)
    (root / "progress.json").write_text(json.dumps({"step": 7, "rewardMean": 0.123046875, "validationScore": -12.34567,
                                                    "bestStep": 5, "bestScore": 0.000123456789,
                                                    "rewardErrorFraction": 1 / 3, "toolErrorFraction": 0.0625}))
    p, _ = read_progress(j, {})
    assert (p.reward_mean, p.validation_score, p.best_score, p.best_step) == (0.1230, -12.35, 0.0001235, 5)
    assert (p.reward_error_fraction, p.tool_error_fraction) == (0.3333, 0.0625)   # the failure rates too


def test_metrics_export_every_name_and_count_jobs_by_phase():
    m = OperatorMetrics()
    m.set_phase("a", "j1", "Pending")
    m.set_phase("a", "j1", "Running")
    m.set_phase("a", "j2", "Running")
    m.set_phase("b", "j3", "Failed")
    m.forget("b", "j3")
    m.reconcile_errors.labels(kind="transient").inc()
    m.restarts.labels(namespace="a", job="j1").inc()
    m.reconcile_seconds.labels(trigger="resync").observe(0.02)
    text = generate_latest(m.registry).decode()
    assert 'grpo_operator_jobs{namespace="a",phase="Running"} 2.0' in text
    assert 'grpo_operator_jobs{namespace="a",phase="Pending"} 0.0' in text
    assert 'grpo_operator_jobs{namespace="b"' not in text             # forgotten: no stale series
    assert 'grpo_operator_transitions_total{namespace="a",phase="Running"} 1.0' in text
    for name in METRIC_NAMES:
        assert name in text


def test_reconciles_of_one_job_never_overlap_and_requests_coalesce():
    import threading
    import time

    from grpo_operator.reconciler import Reconciler

    class Probe(Reconciler):
        def __init__(self):
            super().__init__(kube=None, settings=OperatorSettings(), metrics=OperatorMetrics(), env={})
            self.running, self.overlap, self.calls = 0, False, []
            self.guard = threading.Lock()

        def reconcile(self, namespace, name, *, read_progress=False):
            with self.guard:
                self.running += 1
                self.overlap |= self.running > 1
            self.calls.append((name, read_progress))
            if len(self.calls) == 1:
                release.wait(30)        # the first run lasts until every other request arrived
            with self.guard:
                self.running -= 1

    release = threading.Event()
    r = Probe()
    threads = [threading.Thread(target=r.request, args=("ns", "a"), kwargs={"trigger": "pod", "read_progress": i == 3})
               for i in range(8)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while not r.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    for t in threads[1:]:
        t.start()
        t.join()                        # a request for a job being reconciled returns at once
    release.set()
    threads[0].join()
    assert not r.overlap
    # The first request runs; the seven that arrive meanwhile become one more run, which reads
    # progress because one of them asked to.
    assert r.calls == [("a", False), ("a", True)]
    r.request("ns", "b", trigger="grpojob")
    assert r.calls[-1] == ("b", False)


def test_a_resync_pass_is_counted_after_it_reconciled_every_known_job():
    from grpo_operator.reconciler import Reconciler

    class Probe(Reconciler):
        def __init__(self):
            super().__init__(kube=None, settings=OperatorSettings(), metrics=OperatorMetrics(), env={})
            self.calls = []

        def reconcile(self, namespace, name, *, read_progress=False):
            passes = self.metrics.registry.get_sample_value("grpo_operator_resyncs_total")
            self.calls.append((name, read_progress, passes))

    r = Probe()
    assert r.metrics.registry.get_sample_value("grpo_operator_resyncs_total") == 0
    r.request("ns", "b", trigger="grpojob")
    r.request("ns", "a", trigger="pod")
    r.calls.clear()
    r.resync()
    # Each known job reconciled, reading progress, before the pass is counted.
    assert r.calls == [("a", True, 0), ("b", True, 0)]
    assert r.metrics.registry.get_sample_value("grpo_operator_resyncs_total") == 1


def test_job_defaults_round_trip_through_json():
    """What a job's ConfigMap pins (issue 36, bug 1): the pod-shaping defaults, read back as typed
    settings over the current ones; the operator's own settings are never pinned."""
    pinned = OperatorSettings(trainer_image="reg/t:1", image_pull_secrets=("pull",), rollout_resources={
        "requests": {"cpu": "2"}}, run_as_user=2000)
    record = json.loads(json.dumps(pinned.job_defaults()))
    assert set(record) == set(settings_mod.JOB_DEFAULTS)
    assert "resync_seconds" not in record and "network_policy" not in record
    now = OperatorSettings(trainer_image="reg/t:2", rollout_image="reg/r:2", resync_seconds=3, network_policy=False)
    back = now.with_job_defaults(record)
    assert (back.trainer_image, back.image_pull_secrets, back.rollout_resources, back.run_as_user) == (
        "reg/t:1", ("pull",), {"requests": {"cpu": "2"}}, 2000)
    assert back.rollout_image == pinned.rollout_image            # pinned too, though it was the default
    assert (back.resync_seconds, back.network_policy) == (3, False)   # the operator's own: current
    # A default a later operator added keeps its current value; a malformed record is refused.
    assert now.with_job_defaults({"trainer_image": "reg/t:1"}).rollout_image == "reg/r:2"
    with pytest.raises(ValueError, match="image_pull_secrets"):
        now.with_job_defaults({"image_pull_secrets": "pull"})


def test_a_jobs_created_condition_says_how_to_leave_a_bad_pinned_image():
    """Issue 48: a job created during a bad `helm upgrade` keeps that upgrade's images after
    `helm rollback`. Its Created condition names them and the field that changes the rollout
    image of the running job; following it gives the rollout Deployment that image."""
    from grpo_operator.manifests import build_rollout_deployment
    from grpo_operator.reconciler import runs_with
    bad = OperatorSettings(trainer_image="reg/trainer:bad", rollout_image="reg/rollout:bad")
    said = runs_with(bad)
    assert "trainer image reg/trainer:bad" in said and "rollout image reg/rollout:bad" in said
    assert "spec.rollout.template" in said and "spec.trainer.template" in said
    fixed = job(**{"rollout.template": {"spec": {"containers": [{"image": "reg/rollout:good"}]}}})
    (container,) = build_rollout_deployment(fixed, bad)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "reg/rollout:good"
