"""Faults with real pods: a rollout pod deleted mid-run, the trainer pod of a colocated job (its
rollout servers inside) killed mid-run, suspend then resume, and an image that doesn't exist."""

from __future__ import annotations

import re

import pytest
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .e2e_helpers import (run_path, apply, describe, gj_row, make_assets, metrics, new_namespace, pods,
                          quickstart_job, status, wait_for, wait_phase)

# The first test to use the cluster also pays for starting it, which includes importing new
# images into containerd (~12 min for the two torch images) when the sources changed.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def models(cluster, operator):
    return make_assets(cluster)


def _wait_step(cluster, ns, name, step: int, timeout: float = 600) -> None:
    """The status' step lags the trainer by up to a resync (10 s, a few CPU steps): the jobs
    here run enough steps past the one waited for that the fault lands mid-run."""
    wait_for(f"{name} at step >= {step}",
             lambda: (status(cluster, ns, name).get("progress") or {}).get("step", 0) >= step,
             timeout=timeout, interval=1, diagnose=describe(cluster, ns, name))


def _samples_per_step(cluster, ns, name) -> dict[int, int]:
    """Distinct (prompt_index, sample_index) pairs in each step's rollout shards."""
    fs = cluster.s3()
    root = f"{run_path(cluster, ns, name)}/rollouts"
    counts = {}
    for d in fs.get_file_info(pafs.FileSelector(root)):
        if d.type != pafs.FileType.Directory:
            continue
        pairs = set()
        for f in fs.get_file_info(pafs.FileSelector(d.path, recursive=True)):
            if f.path.endswith(".parquet"):
                table = pq.read_table(f.path, filesystem=fs, columns=["prompt_index", "sample_index"])
                pairs.update(zip(table["prompt_index"].to_pylist(), table["sample_index"].to_pylist()))
        counts[int(d.base_name.removeprefix("step-"))] = len(pairs)
    return counts


def test_deleted_rollout_pod_is_replaced_and_no_sample_is_lost(cluster, models):
    ns, name, steps = new_namespace(cluster), "rolloutkill", 12
    job = quickstart_job(name, cluster, models, steps=steps, testFreq=-1, valBeforeTrain=False)
    apply(cluster, ns, job)
    _wait_step(cluster, ns, name, 2)
    (victim,) = [p["metadata"]["name"] for p in pods(cluster, ns, name, "rollout")]
    cluster.kubectl("delete", "pod", "-n", ns, victim, "--wait=false")
    wait_for("a new rollout pod", lambda: [p for p in pods(cluster, ns, name, "rollout")
                                           if p["metadata"]["name"] != victim], timeout=120)
    final = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=900)
    assert final["progress"]["step"] == steps
    want = job["spec"]["data"]["trainBatchSize"] * job["spec"]["rollout"]["n"]
    counts = _samples_per_step(cluster, ns, name)
    assert all(counts.get(s, 0) >= want for s in range(1, steps + 1)), counts


def _workers_per_step(cluster, ns, name) -> dict[int, set[str]]:
    """The rollout servers (record column `worker`) whose shards each step trained on."""
    fs = cluster.s3()
    root = f"{run_path(cluster, ns, name)}/rollouts"
    workers = {}
    for f in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        if f.path.endswith(".parquet"):
            step = int(f.path.split("/step-")[1].split("/")[0])
            table = pq.read_table(f.path, filesystem=fs, columns=["worker"])
            workers.setdefault(step, set()).update(table["worker"].to_pylist())
    return workers


def test_killed_colocated_trainer_pod_is_restarted_and_resumes_from_the_checkpoint(cluster, models):
    """rollout.placement colocated (issue 46): the trainer pod runs its two ranks and, beside them,
    one rollout server per rank (no rollout Deployment). Killed mid-run, the pod takes its servers
    with it; the restarted pod (same hostname; its trainer often gets the dead one's pid) starts
    them again, takes over the run's lease, resumes from the checkpoint, and every step's rollouts
    have the same shape: a full batch, from both of the pod's servers."""
    ns, name, steps = new_namespace(cluster), "trainerkill", 16
    job = quickstart_job(name, cluster, models, steps=steps, testFreq=-1, valBeforeTrain=False, saveFreq=5,
                         nprocPerNode=2)
    job["spec"]["rollout"].update({"placement": "colocated", "replicas": 2})
    apply(cluster, ns, job)
    # Kill once the step-5 checkpoint is complete (its manifest is written last), read from
    # storage: the status' step lags by up to a resync, and a kill after the last step would
    # leave nothing to resume.
    fs = cluster.s3()
    manifest = f"{run_path(cluster, ns, name)}/checkpoints/step-5/manifest.json"
    wait_for("the step-5 checkpoint", lambda: fs.get_file_info(manifest).type == pafs.FileType.File,
             timeout=900, interval=1, diagnose=describe(cluster, ns, name))
    assert not pods(cluster, ns, name, "rollout")                 # the servers are the trainer pod's
    (victim,) = [p["metadata"]["name"] for p in pods(cluster, ns, name, "trainer")]
    # A crash, not a deletion: every process of the pod's user dies (its servers too).
    cluster.kubectl("exec", "-n", ns, victim, "--", "bash", "-c", "kill -KILL -1", check=False)
    final = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=1200)
    assert final["progress"]["step"] == steps
    assert final["restarts"] >= 1, final
    (trainer,) = [p for p in pods(cluster, ns, name, "trainer") if p["metadata"]["name"] != victim]
    logs = cluster.kubectl("logs", "-n", ns, trainer["metadata"]["name"]).stdout
    resumed = re.search(r"Resumed from \S+/checkpoints/step-(\d+) ", logs)
    # The replacement resumed from a checkpoint the killed pod wrote, and trained the rest.
    assert resumed and 5 <= int(resumed.group(1)) < steps, logs[-3000:]
    assert max(r["step"] for r in metrics(cluster, ns, name) if "step" in r) == steps
    want = job["spec"]["data"]["trainBatchSize"] * job["spec"]["rollout"]["n"]
    counts, workers = _samples_per_step(cluster, ns, name), _workers_per_step(cluster, ns, name)
    assert all(counts.get(s, 0) >= want for s in range(1, steps + 1)), counts
    assert all(len(workers.get(s, ())) == 2 for s in range(1, steps + 1)), workers


def test_a_job_deleted_mid_run_and_applied_again_runs_anew(cluster, models):
    """Issue 36, bug 3: the same YAML applied again after a delete is a new object with its own
    run (status.runUri ends in its uid): it trains from step 1 and never shows the old progress."""
    ns, name, steps = new_namespace(cluster), "again", 4
    job = quickstart_job(name, cluster, models, steps=steps + 20, testFreq=-1, valBeforeTrain=False, saveFreq=1)
    apply(cluster, ns, job)
    first_run = run_path(cluster, ns, name)
    _wait_step(cluster, ns, name, 2)
    cluster.kubectl("delete", "gj", name, "-n", ns, "--wait=true", "--timeout=300s")
    apply(cluster, ns, quickstart_job(name, cluster, models, steps=steps, testFreq=-1, valBeforeTrain=False))
    second_run = run_path(cluster, ns, name)
    assert second_run != first_run
    seen = []
    def finished():
        st = status(cluster, ns, name)
        seen.append((st.get("progress") or {}).get("step"))
        return st.get("phase") in ("Succeeded", "Failed")
    wait_for(f"{name} (again) to finish", finished, timeout=900, interval=2, diagnose=describe(cluster, ns, name))
    final = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=60)
    assert final["progress"]["step"] == steps and final["restarts"] == 0, final
    assert all(s is None or s <= steps for s in seen), seen      # never the old object's step
    assert [r["step"] for r in metrics(cluster, ns, name) if "training/step" in r] == list(range(1, steps + 1))
    old = cluster.s3().get_file_info(f"{first_run}/progress.json")
    assert old.type == pafs.FileType.File                         # the old run's files are kept


def test_suspend_then_resume(cluster, models):
    ns, name, steps = new_namespace(cluster), "suspend", 16
    job = quickstart_job(name, cluster, models, steps=steps, testFreq=-1, valBeforeTrain=False, saveFreq=4)
    apply(cluster, ns, job)
    # Suspended once the step-4 checkpoint is in storage, read there: the status' step lags by up
    # to a resync, and waiting on it let a CI run's trainer finish all 14 steps before the suspend.
    fs = cluster.s3()
    manifest = f"{run_path(cluster, ns, name)}/checkpoints/step-4/manifest.json"
    wait_for("the step-4 checkpoint", lambda: fs.get_file_info(manifest).type == pafs.FileType.File,
             timeout=900, interval=1, diagnose=describe(cluster, ns, name))
    cluster.kubectl("patch", "gj", name, "-n", ns, "--type=merge", "-p", '{"spec": {"runPolicy": {"suspend": true}}}')
    wait_phase(cluster, ns, name, {"Suspended"}, timeout=300)
    wait_for("no pods while suspended", lambda: not pods(cluster, ns, name, "trainer")
             and not pods(cluster, ns, name, "rollout"), timeout=300, diagnose=describe(cluster, ns, name))
    at_suspend = status(cluster, ns, name)["progress"]["step"]
    cluster.kubectl("patch", "gj", name, "-n", ns, "--type=merge", "-p", '{"spec": {"runPolicy": {"suspend": false}}}')
    final = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=900)
    assert final["progress"]["step"] == steps and at_suspend < steps


def test_missing_image_shows_the_reason_and_the_pending_deadline_fails_the_job(cluster, models):
    ns, name = new_namespace(cluster), "noimage"
    job = quickstart_job(name, cluster, models, steps=2)
    job["spec"]["trainer"]["template"]["spec"]["containers"][0]["image"] = "localhost/grpo-e2e/does-not-exist:1"
    # 25 s: the pull fails within seconds of the pod's creation; the deadline ends the job after
    job["spec"]["runPolicy"] = {"pendingDeadlineSeconds": 25}
    apply(cluster, ns, job)

    def reason_shown():
        described = cluster.kubectl("describe", "gj", name, "-n", ns).stdout
        return ("ErrImagePull" in described or "ImagePullBackOff" in described) and described
    wait_for("the image pull reason in `kubectl describe gj`", reason_shown, timeout=180,
             diagnose=describe(cluster, ns, name))
    final = wait_phase(cluster, ns, name, {"Failed"}, timeout=300)
    failed = next(c for c in final["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PendingDeadlineExceeded", final
    assert "ErrImagePull" in failed["message"] or "ImagePullBackOff" in failed["message"], final   # the cause kept
    assert gj_row(cluster, ns, name)["PHASE"] == "Failed"
