"""A rollout, reward or sandbox server that can't start (issue 48, item 12): the kubelet restarts it
on its own, so only the operator can say so. Pods in the shapes the kubelet writes, through the
pods view and the state machine (grpo_operator.pods, grpo_operator.lifecycle), with no cluster."""

from datetime import datetime, timedelta, timezone

from grpo_api.spec import GRPOJobStatus, Phase
from grpo_operator import manifests, pods
from grpo_operator.conditions import find, fmt_time
from grpo_operator.lifecycle import SERVER_FAILING_SECONDS, Observed, TrainerJob, decide
from grpo_operator.settings import OperatorSettings
from operator_helpers import job

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
IMPORT_ERROR = ("Traceback (most recent call last):\n  ...\nrollout: spec.reward.function 'nosuch_module:score': "
                "can't import nosuch_module: No module named 'nosuch_module'")


def container(name="rollout", *, state=None, last=None, restarts=0, ready=False):
    """A containerStatuses entry as the kubelet writes it."""
    cs = {"name": name, "image": "grpo-rollout:1", "imageID": "", "ready": ready, "restartCount": restarts,
          "state": state or {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
    if last is not None:
        cs["lastState"] = {"terminated": last}
    return cs


def crashed(code=1, message=IMPORT_ERROR, reason="Error"):
    return {"exitCode": code, "reason": reason, "message": message,
            "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:00:05Z"}


def back_off(name="rollout", code=1, message=IMPORT_ERROR, restarts=1):
    """CrashLoopBackOff: the waiting state's message is the kubelet's; the crash is in lastState."""
    return container(name, restarts=restarts, last=crashed(code, message), state={"waiting": {
        "reason": "CrashLoopBackOff",
        "message": f"back-off 10s restarting failed container={name} pod=demo-rollout-7d9c-x2k4q"}})


def pod(name, role, *statuses, phase="Running", init=(), reward_model=None, deleting=False):
    labels = {"grpo.dev/job": "demo", "grpo.dev/role": role}
    if reward_model:
        labels["grpo.dev/reward-model"] = reward_model
    meta = {"name": name, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": list(statuses),
                                         **({"initContainerStatuses": list(init)} if init else {})}}


def healthy(name, role="rollout"):
    return pod(name, role, container(role, ready=True))


def failures(*pod_list):
    return pods.view(list(pod_list), attempt=0).server_failures


def test_every_server_container_leaves_the_end_of_its_log_as_its_termination_message():
    """What the condition quotes: a server that dies of an exception writes no termination message
    itself, so the kubelet's FallbackToLogsOnError must put its last log lines there."""
    j = job(**{"reward.rewardModels": [{"name": "rm", "path": "/models/rm"}], "model.path": "s3://models/qwen",
               "rollout.multiTurn": {"enable": True, "tools": ["python"]}})
    settings = OperatorSettings()
    deployments = [manifests.build_rollout_deployment(j, settings),
                   *manifests.build_rollout_dependencies(j, settings, rollout_replicas=1)]
    assert sorted(d["metadata"]["name"] for d in deployments) == ["demo-rm-rm", "demo-rollout", "demo-sandbox"]
    for d in deployments:
        spec = d["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert c["terminationMessagePolicy"] == "FallbackToLogsOnError", (d["metadata"]["name"], c["name"])
    rollout = deployments[0]["spec"]["template"]["spec"]
    assert [c["name"] for c in rollout["initContainers"]] == ["model"]    # the fetch is covered too


# -- what the pods say -------------------------------------------------------------------------

def test_a_crash_loop_names_the_pod_its_exit_code_and_the_end_of_its_log():
    (f,) = failures(healthy("demo-rollout-a"), pod("demo-rollout-b", "rollout", back_off(restarts=4)))
    assert (f.pod, f.role, f.reason, f.exit_code, f.restarts) == ("demo-rollout-b", "rollout", "CrashLoopBackOff", 1, 4)
    assert f.describe() == ("rollout server pod demo-rollout-b (container rollout): CrashLoopBackOff, exit code 1, "
                            f"4 restart(s): {IMPORT_ERROR}")


def test_between_back_offs_a_crashed_server_still_fails_until_it_is_ready():
    """Started again after its crash but not ready (loading its model): the crash loop goes on."""
    loading = container("reward", restarts=2, last=crashed(1, "OSError: /models/nope is not a folder"))
    (f,) = failures(pod("demo-rm-judge-1", "reward", loading, reward_model="judge"))
    assert (f.reason, f.exit_code, f.reward_model) == ("Error", 1, "judge")
    assert f.describe().startswith("reward model 'judge' server pod demo-rm-judge-1 (container reward): Error")
    # Ready again: a past crash (it ran for hours, then crashed once) is no failure.
    recovered = container("reward", restarts=2, ready=True, last=crashed(1, "OSError"))
    assert failures(pod("demo-rm-judge-1", "reward", recovered, reward_model="judge")) == ()


def test_a_terminated_container_an_image_a_config_error_and_an_init_container_fail():
    oom = container("sandbox", restarts=1, state={"terminated": crashed(137, "", "OOMKilled")})
    pull = container(state={"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}})
    fetch = back_off("model", 1, "error: s3://models/qwen: NoSuchKey", restarts=3)
    init_done = container("model", state={"terminated": crashed(0, "", "Completed")})
    got = failures(pod("demo-sandbox-a", "sandbox", oom),
                   pod("demo-rollout-a", "rollout", pull, phase="Pending"),
                   pod("demo-rollout-b", "rollout", container(), phase="Pending", init=[fetch]),
                   pod("demo-rollout-c", "rollout", container(ready=True), init=[init_done]))
    assert [(f.pod, f.container, f.reason, f.exit_code) for f in got] == [
        ("demo-rollout-b", "model", "CrashLoopBackOff", 1),          # the most restarts first
        ("demo-sandbox-a", "sandbox", "OOMKilled", 137),
        ("demo-rollout-a", "rollout", "ImagePullBackOff", None)]
    assert got[2].describe().endswith('ImagePullBackOff: Back-off pulling image "x"')


def test_trainer_and_deleted_pods_are_no_server_failures():
    trainer = pod("demo-trainer-0", "trainer", back_off("trainer"))
    trainer["metadata"]["labels"]["grpo.dev/attempt"] = "0"
    assert failures(trainer, pod("demo-rollout-a", "rollout", back_off(), deleting=True)) == ()


def test_a_bad_input_exit_comes_first():
    got = failures(pod("demo-rollout-a", "rollout", back_off(restarts=9, code=1)),
                   pod("demo-rm-rm-a", "reward", back_off("reward", code=2, restarts=1), reward_model="rm"))
    assert [f.pod for f in got] == ["demo-rm-rm-a", "demo-rollout-a"]


# -- what the job says -------------------------------------------------------------------------

def running_status():
    return GRPOJobStatus(phase=Phase.Running, observed_generation=1, start_time=fmt_time(T0))


def step(st, *pod_list, now=T0, trainer=TrainerJob(0)):
    trainers = [healthy(f"demo-trainer-{i}", "trainer") for i in range(2)]
    for p in trainers:
        p["metadata"]["labels"]["grpo.dev/attempt"] = "0"
    return decide(job(), [], st, Observed(generation=1, children_applied=True, trainer=trainer, rollout_replicas=2,
                                          pods=pods.view([*trainers, *pod_list], attempt=0)), now)


def test_a_crash_looping_reward_server_is_a_condition_an_event_and_the_reason_column():
    d = step(running_status(), healthy("demo-rollout-a"),
             pod("demo-rm-rm-a", "reward", back_off("reward", message="OSError: /models/rm: no such folder"),
                 reward_model="rm"))
    c = find(d.status.conditions, "ServersFailing")
    assert (c.status, c.reason) == ("True", "RewardServerFailing")
    assert c.message == ("reward model 'rm' server pod demo-rm-rm-a (container reward): CrashLoopBackOff, "
                         "exit code 1, 1 restart(s): OSError: /models/rm: no such folder")
    assert d.status.reason == "RewardServerFailing" and d.status.phase == Phase.Running
    assert [(e.type, e.reason, e.message) for e in d.events] == [("Warning", "RewardServerFailing", c.message)]
    # The next crash is no new event; the condition keeps the time it began.
    again = step(d.status, healthy("demo-rollout-a"),
                 pod("demo-rm-rm-a", "reward", back_off("reward", restarts=2), reward_model="rm"),
                 now=T0 + timedelta(seconds=40))
    assert again.events == [] and "2 restart(s)" in find(again.status.conditions, "ServersFailing").message
    assert find(again.status.conditions, "ServersFailing").last_transition_time == fmt_time(T0)
    # Serving again: False, and the Reason column is empty.
    fine = step(again.status, healthy("demo-rollout-a"), healthy("demo-rm-rm-a", "reward"),
                now=T0 + timedelta(seconds=80))
    c = find(fine.status.conditions, "ServersFailing")
    assert (c.status, c.reason) == ("False", "ServersRecovered") and fine.status.reason is None


def test_a_server_that_refuses_its_input_fails_the_job_at_once():
    """`reward.function: nosuch_module:score`: the rollout server exits 2 on start; a restart can't help."""
    d = step(running_status(), pod("demo-rollout-a", "rollout", back_off(code=2)), healthy("demo-rollout-b"))
    assert d.status.phase == Phase.Failed
    failed = find(d.status.conditions, "Failed")
    assert failed.reason == "RolloutServerFailing"
    assert failed.message.startswith("a server refused its input (exit code 2; not retried")
    assert failed.message.endswith("can't import nosuch_module: No module named 'nosuch_module'")
    # Everything stops: the trainer's Job, the rollout (and with it the reward and sandbox) servers.
    assert d.delete_trainer and d.rollout_replicas == 0 and d.create_trainer is None
    assert [e.reason for e in d.events] == ["RolloutServerFailing"] and "nosuch_module" in d.events[0].message


def test_a_server_that_keeps_crashing_fails_the_job_after_the_bound_only():
    st = step(running_status(), pod("demo-rollout-a", "rollout", back_off(restarts=1))).status
    late = T0 + timedelta(seconds=SERVER_FAILING_SECONDS)
    # Long enough but not restarted enough (a slow model load after one crash): still waiting.
    assert step(st, pod("demo-rollout-a", "rollout", back_off(restarts=2)), now=late).status.phase == Phase.Running
    # Restarted enough but not for long enough (a server that crashed now and then over days).
    early = late - timedelta(seconds=1)
    assert step(st, pod("demo-rollout-a", "rollout", back_off(restarts=5)), now=early).status.phase == Phase.Running
    d = step(st, pod("demo-rollout-a", "rollout", back_off(restarts=3)), now=late)
    assert d.status.phase == Phase.Failed and d.delete_trainer and d.rollout_replicas == 0
    failed = find(d.status.conditions, "Failed")
    assert failed.reason == "RolloutServerFailing"
    assert failed.message.startswith(f"a server kept failing (3 restarts, not serving for {SERVER_FAILING_SECONDS}s): "
                                     "rollout server pod demo-rollout-a")


def test_a_queued_job_has_no_servers_to_fail():
    """Not admitted yet: the servers are at zero, a pod on its way out says nothing."""
    queued = TrainerJob(0, suspended=True)
    d = step(GRPOJobStatus(phase=Phase.Pending, observed_generation=1), pod("demo-rollout-a", "rollout", back_off()),
             trainer=queued)
    assert find(d.status.conditions, "ServersFailing") is None and d.status.phase == Phase.Pending


def test_a_succeeded_or_suspended_job_no_longer_says_its_servers_fail():
    """One reward replica crash-looped while the other served: the job's end or its suspension
    leaves no failing-server reason in the Reason column."""
    st = step(running_status(), healthy("demo-rollout-a"),
              pod("demo-rm-rm-a", "reward", back_off("reward"), reward_model="rm")).status
    assert st.reason == "RewardServerFailing"
    done = step(st, trainer=TrainerJob(0, "succeeded"))
    assert done.status.phase == Phase.Succeeded and done.status.reason is None
    assert find(done.status.conditions, "ServersFailing").status == "False"
    suspended = decide(job(**{"runPolicy.suspend": True}), [], st,
                       Observed(generation=1, children_applied=True, rollout_replicas=2), T0)
    assert suspended.status.phase == Phase.Suspended and suspended.status.reason == "Suspended"
    assert find(suspended.status.conditions, "ServersFailing").status == "False"
