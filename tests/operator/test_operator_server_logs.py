"""The reward and sandbox pods' logs, kept in the run before the operator scales them away (issue
48 item 16: the sandbox pod's log was lost with it). Those pods can't write storage themselves (no
credentials; the sandbox no egress at all), so the operator reads them through the API and writes
`<run>/logs/<pod>.log`, as the rollout pods' own mirror names theirs. In process: a fake API with
the pods and their logs, file:// storage."""

from grpo_api.spec import GRPOJobStatus
from grpo_operator import names
from grpo_operator.kube import KubeError
from grpo_operator.lifecycle import Decision
from grpo_operator.metrics import OperatorMetrics
from grpo_operator.reconciler import Reconciler
from grpo_operator.server_logs import keep_server_logs
from grpo_operator.settings import OperatorSettings
from operator_helpers import UID, job

S = OperatorSettings()
REWARD_POD, SANDBOX_POD = "demo-rm-judge-7d9f-abcde", "demo-sandbox-5c6b-fghij"


class FakeKube:
    """The pods of each role, their logs by (pod, previous); every call in order."""

    def __init__(self, logs, restarts=None):
        self.logs, self.restarts, self.calls = logs, restarts or {}, []
        self.events = []

    def list(self, api_version, kind, namespace, selector):
        self.calls.append(("list", selector[names.ROLE_LABEL]))
        pod_names = {names.REWARD: [REWARD_POD], names.SANDBOX: [SANDBOX_POD]}.get(selector[names.ROLE_LABEL], [])
        return [{"metadata": {"name": n}, "status": {"containerStatuses": [{"restartCount": self.restarts.get(n, 0)}]}}
                for n in pod_names]

    def pod_log(self, namespace, name, *, previous=False):
        self.calls.append(("log", name, previous))
        log = self.logs[(name, previous)]
        if isinstance(log, Exception):
            raise log
        return log

    def apply(self, obj):
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"], obj["spec"].get("replicas")))
        return obj

    def get(self, *args):
        return None

    def post_event(self, involved, type_, reason, message, now):
        self.events.append((type_, reason, message))


def _job(tmp_path):
    return job(**{"storage.uri": f"file://{tmp_path}", "storage.secretRef": None,
                  "reward.rewardModels": [{"name": "judge", "path": "/models/judge", "gpus": 1}],
                  "rollout.multiTurn": {"enable": True, "tools": ["python"]}})


def _kept(tmp_path, pod):
    path = tmp_path / "team-a" / "demo" / UID / "logs" / f"{pod}.log"
    return path.read_bytes() if path.exists() else None


def test_each_reward_and_sandbox_pods_log_is_written_to_the_run(tmp_path):
    """A restarted sandbox keeps the crashed container's log (its traceback) before the current one."""
    kube = FakeKube({(REWARD_POD, False): b"reward server judge listening on port 50051\n",
                     (SANDBOX_POD, True): b"Traceback (most recent call last):\nMemoryError\n",
                     (SANDBOX_POD, False): b"run t1-0: ok in 0.08s\n"}, restarts={SANDBOX_POD: 1})
    assert keep_server_logs(kube, _job(tmp_path), {}) == []
    assert _kept(tmp_path, REWARD_POD) == b"reward server judge listening on port 50051\n"
    assert _kept(tmp_path, SANDBOX_POD) == (b"[the container before restart 1]\nTraceback (most recent call last):\n"
                                            b"MemoryError\n[the container since restart 1]\nrun t1-0: ok in 0.08s\n")


def test_a_log_that_cannot_be_read_is_named_and_the_others_are_kept(tmp_path):
    kube = FakeKube({(REWARD_POD, False): KubeError(403, "Forbidden", 'cannot get resource "pods/log"'),
                     (SANDBOX_POD, False): b"run t1-0: ok in 0.08s\n"})
    failed = keep_server_logs(kube, _job(tmp_path), {})
    assert len(failed) == 1 and failed[0].startswith(REWARD_POD + ":") and "pods/log" in failed[0], failed
    assert _kept(tmp_path, REWARD_POD) is None and _kept(tmp_path, SANDBOX_POD) == b"run t1-0: ok in 0.08s\n"


def test_the_operator_keeps_them_before_it_scales_the_servers_to_zero(tmp_path):
    kube = FakeKube({(REWARD_POD, False): b"r\n", (SANDBOX_POD, False): b"s\n"})
    j = _job(tmp_path)
    obj = {"metadata": {"namespace": "team-a", "name": "demo", "uid": UID}}
    Reconciler(kube, S, OperatorMetrics(), env={})._act(obj, j, Decision(status=GRPOJobStatus(), rollout_replicas=0), S)
    assert _kept(tmp_path, REWARD_POD) == b"r\n" and _kept(tmp_path, SANDBOX_POD) == b"s\n"
    first_scale = next(i for i, c in enumerate(kube.calls) if c[0] == "apply")
    assert [c[1] for c in kube.calls[:first_scale] if c[0] == "log"] == [REWARD_POD, SANDBOX_POD]
    assert {(c[2], c[3]) for c in kube.calls if c[0] == "apply"} >= {("demo-rm-judge", 0), ("demo-sandbox", 0)}
    assert kube.events == []


def test_storage_the_operator_cannot_write_is_one_warning_event(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the run's folder would be")
    kube = FakeKube({(REWARD_POD, False): b"r\n", (SANDBOX_POD, False): b"s\n"})
    j = job(**{"storage.uri": f"file://{blocked}", "storage.secretRef": None,
               "rollout.multiTurn": {"enable": True, "tools": ["python"]}})
    obj = {"metadata": {"namespace": "team-a", "name": "demo", "uid": UID}}
    Reconciler(kube, S, OperatorMetrics(), env={})._act(obj, j, Decision(status=GRPOJobStatus(), rollout_replicas=0), S)
    ((type_, reason, message),) = kube.events
    assert (type_, reason) == ("Warning", "ServerLogsNotKept")
    assert SANDBOX_POD in message and "operator.readStorageSecrets" in message, message
