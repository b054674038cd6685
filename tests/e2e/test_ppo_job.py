"""A PPO GRPOJob (advEstimator gae: a critic trained beside the policy) on the real node, from
the images the Dockerfiles build, with trainer.saveBest: what kubectl shows and what the run
leaves in S3. Cheap: the quickstart's task, a few steps."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from .e2e_helpers import (run_path, apply, describe, make_assets, metrics, new_namespace, quickstart_job, status,
                          wait_for, wait_phase)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STEPS = 8


def test_a_ppo_job_trains_its_critic_and_keeps_the_best_checkpoint(cluster, operator):
    models = make_assets(cluster)
    ns, name = new_namespace(cluster), "ppo"
    job = quickstart_job(name, cluster, models, steps=STEPS, testFreq=2, saveFreq=4, keepCheckpoints=1,
                         saveBest={"metric": "val/score"})
    job["spec"]["algorithm"].update({"advEstimator": "gae", "lam": 0.95})
    job["spec"]["critic"] = {"lr": 2e-3}
    apply(cluster, ns, job)
    wait_for("the PPO job to finish", lambda: status(cluster, ns, name).get("phase") in ("Succeeded", "Failed"),
             timeout=1200, interval=3, diagnose=describe(cluster, ns, name))
    progress = wait_phase(cluster, ns, name, {"Succeeded"}, timeout=60)["progress"]
    assert progress["step"] == STEPS

    rows = [r for r in metrics(cluster, ns, name) if "training/step" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["critic/vf_loss"] >= 0 and r["critic/lr"] == 2e-3 and "critic/values/mean" in r for r in rows)
    # the best validation step so far, as the status and `kubectl get gj -o wide` show it
    scores = {r["step"]: r["val/score"] for r in rows if r.get("val/score") is not None}
    best = min(s for s, v in scores.items() if v == max(scores.values()))
    assert (progress["bestStep"], progress["bestScore"]) == (best, pytest.approx(scores[best]))
    wide = cluster.kubectl("get", "gj", name, "-n", ns, "-o", "wide").stdout.splitlines()
    header, row = wide[0].split(), wide[1].split()
    assert row[header.index("BEST-STEP")] == str(best)

    # in S3: the last checkpoint and the best one (whatever keepCheckpoints says), and hf/best
    fs, run = cluster.s3(), run_path(cluster, ns, name)
    kept = {info.base_name for info in fs.get_file_info(pafs.FileSelector(f"{run}/checkpoints"))}
    assert kept == {f"step-{best}", f"step-{STEPS}"}, kept
    assert fs.get_file_info(f"{run}/hf/best/config.json").type == pafs.FileType.File
    manifest = fs.open_input_stream(f"{run}/checkpoints/step-{STEPS}/trainer_state.json").read().decode()
    assert '"critic_scheduler"' in manifest          # the critic is part of the checkpoint
