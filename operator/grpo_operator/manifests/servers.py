"""The job's gRPC server pools: the rollout servers (`grpo rollout`), each reward model's (`grpo
reward`, spec.reward.rewardModels[]) and the python tool's sandbox (`grpo sandbox`). Each pool is
a `Server`, and one builder makes its Deployment, headless Service and NetworkPolicy: the pools
differ only in what their `Server` says."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_api import model_cache
from grpo_api.contracts import LOG_URI_ENV, REWARD_ADDRESSES_ENV, SANDBOX_ADDRESSES_ENV, reward_addresses
from grpo_api.records import RunLayout
from grpo_api.rpc import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TOKEN_ENV
from grpo_api.spec import GRPOJob
from grpo_api.storage import job_root

from grpo_operator import names
from grpo_operator.manifests.common import (MODEL_VOLUME, common_env, container_resources, from_secret, object_meta,
                                            pod_template)
from grpo_operator.manifests.policies import network_policy, pods_of, scraped
from grpo_operator.manifests.services import headless_service
from grpo_operator.names import GRPC_PORT, METRICS_PORT, REWARD, ROLLOUT, SANDBOX, SPEC_PATH, TRAINER
from grpo_operator.settings import OperatorSettings


@dataclass
class Server:
    """A pool of one job's gRPC servers, in the rollout image: what its objects are built from."""

    role: str
    """The component label (names.labels); the NetworkPolicy covers every pod of the role."""
    name: str
    """The Deployment's and the Service's."""
    selector: dict[str, str]
    """The labels that select the pool's pods."""
    args: list[str]
    env: list[dict[str, Any]]
    resources: dict[str, Any]
    replicas: int
    """The Deployment's, unless its builder is given others."""
    template: dict | None
    """The user's pod template for the pool, at `template_field` of the spec (named in errors)."""
    template_field: str
    grace: int
    """terminationGracePeriodSeconds."""
    callers: list[dict[str, Any]]
    """The NetworkPolicy peers that may call the gRPC port (policies.pods_of)."""
    policy_name: str | None = None
    """The NetworkPolicy's name (default: `name`)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Labels besides the role's, on the Deployment, the Service and the pods."""
    live_path: str = "/live"
    startup_probe: bool = True
    """Liveness waits until the server first got ready: loading a large model may take an hour."""
    fetch_model: bool = False
    """The pods fetch the policy model first (pod_template's `model` init container)."""
    one_at_a_time: bool = True
    """GPUs are scarce: replace pods one at a time instead of surging past the quota."""
    scratch: tuple[dict, dict] | None = None
    """pod_template's: a read-only root filesystem with this scratch volume."""
    extra_ingress: list[dict[str, Any]] = field(default_factory=list)
    deny_egress: bool = False


def server_deployment(job: GRPOJob, settings: OperatorSettings, server: Server, replicas: int | None) -> dict[str, Any]:
    container = {
        "name": server.role,
        "image": settings.rollout_image,
        "command": ["grpo"],
        "args": server.args,
        "env": server.env,
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": server.resources,
        # The gRPC Health RPC needs the job's token, which a kubelet probe can't send: the
        # server answers the same readiness (model loaded, serving) on its metrics port.
        "readinessProbe": _probe("/ready", period=5, timeout=3, failures=3),
        **({"startupProbe": _probe("/ready", period=10, timeout=3, failures=360)} if server.startup_probe else {}),
        "livenessProbe": _probe(server.live_path, period=30, timeout=5, failures=2),
    }
    template = pod_template(job, settings, server.role, container, grace=server.grace, override=server.template,
                            extra_labels=server.labels, template_field=server.template_field,
                            fetch_model=server.fetch_model, scratch=server.scratch)
    meta = object_meta(job, server.name, server.role)
    meta["labels"].update(server.labels)
    spec: dict[str, Any] = {"replicas": server.replicas if replicas is None else replicas,
                            "selector": {"matchLabels": dict(server.selector)}}
    if server.one_at_a_time:
        spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    spec.update(revisionHistoryLimit=2, template=template)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


def server_service(job: GRPOJob, server: Server) -> dict[str, Any]:
    """Only ready servers (model loaded) are in DNS, so no caller dials a loading one."""
    service = headless_service(job, server.name, server.role, [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"},
    ], publish_not_ready=False, selector=dict(server.selector))
    service["metadata"]["labels"].update(server.labels)
    return service


def server_network_policy(job: GRPOJob, settings: OperatorSettings, server: Server) -> dict[str, Any]:
    """gRPC only from the callers' pods, the metrics port from the scrapers."""
    ingress = [{"from": server.callers, "ports": [{"protocol": "TCP", "port": GRPC_PORT}]},
               scraped(settings), *server.extra_ingress]
    return network_policy(job, server.policy_name or server.name, server.role, ingress, deny_egress=server.deny_egress)


def _probe(path: str, *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "metrics"},
            "periodSeconds": period, "timeoutSeconds": timeout, "failureThreshold": failures}


def _args(command: str, *flags: str) -> list[str]:
    return [command, "--spec", SPEC_PATH, *flags, "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT)]


def _server_env(job: GRPOJob, *extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The token and the server certificate, none of the storage credentials."""
    return [from_secret(job, TOKEN_ENV, names.TOKEN_KEY),
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"}, *extra, *_tls_env(job)]


def _tls_env(job: GRPOJob) -> list[dict[str, Any]]:
    """The servers serve TLS; they never get the checkpoint key (the rollout servers run the
    user's reward code, and could otherwise sign a checkpoint)."""
    return [from_secret(job, TLS_CERT_ENV, names.TLS_CERT_KEY), from_secret(job, TLS_KEY_ENV, names.TLS_KEY_KEY)]


# --- the rollout servers ------------------------------------------------------------------------

def rollout_server(job: GRPOJob, settings: OperatorSettings) -> Server:
    """Ingress: gRPC only from the job's trainer pods; with the nccl weight sync, any port from the
    job's trainer and rollout pods (the collective's connections use ephemeral ports, and NCCL
    rings connect the rollout servers to each other)."""
    m, r = job.metadata, job.spec.rollout
    trainer = pods_of(job, TRAINER)
    nccl = [{"from": [trainer, pods_of(job, ROLLOUT)]}] if job.spec.weight_sync.backend == "nccl" else []
    return Server(
        role=ROLLOUT, name=names.rollout_name(m.name), selector=names.selector(m.name, ROLLOUT),
        args=[*_args("rollout"), "--worker-id", "$(POD_NAME)"],
        env=[*common_env(job), *_tls_env(job), *_client_env(job), *_log_uri_env(job)],
        resources=container_resources(settings.rollout_resources, rollout_gpus(job), settings),
        replicas=r.replicas, template=r.template, template_field="spec.rollout.template",
        grace=settings.rollout_termination_grace_seconds, callers=[trainer], fetch_model=True,
        # A Generate call still in flight after twice the trainer's request timeout (the trainer
        # gave up on it long ago) means the engine hangs: restart the server.
        live_path=f"/live?stuckAfterSeconds={2 * r.request_timeout_seconds:g}", extra_ingress=nccl)


def rollout_callers(job: GRPOJob) -> dict[str, Any]:
    """The pods the rollout servers run in, which call the reward and sandbox servers: the
    trainer's with placement colocated."""
    return pods_of(job, TRAINER if job.spec.colocated else ROLLOUT)


def colocated_server_env(job: GRPOJob) -> list[dict[str, Any]]:
    """What a trainer pod adds for its colocated rollout servers: their certificate and the
    servers they call (the trainer already has the job's CA)."""
    return [*_tls_env(job), *(e for e in _client_env(job) if e["name"] != TLS_CA_ENV)]


def rollout_gpus(job: GRPOJob) -> int:
    """vLLM needs its tensor-parallel GPUs; the hf engine is the CPU/dev engine."""
    r = job.spec.rollout
    return r.tensor_parallel_size if r.engine == "vllm" else 0


def _client_env(job: GRPOJob) -> list[dict[str, Any]]:
    """The servers the rollout servers call: the reward models' (one dns:/// name per model) and the
    python tool's sandbox servers, with the job's CA to check them by (the name checked is the
    Service's, which the certificate carries)."""
    m = job.metadata
    env = []
    models = [rm.name for rm in job.spec.reward.reward_models]
    if models:
        env.append({"name": REWARD_ADDRESSES_ENV,
                    "value": reward_addresses({model: names.reward_address(m.name, m.namespace, model) for model in models})})
    if sandbox_replicas(job):
        env.append({"name": SANDBOX_ADDRESSES_ENV, "value": names.sandbox_address(m.name, m.namespace)})
    return [*env, from_secret(job, TLS_CA_ENV, names.CA_CERT_KEY)] if env else []


def _log_uri_env(job: GRPOJob) -> list[dict[str, Any]]:
    """Where a rollout pod keeps its log after the job scales it away (grpo_rollout.log_mirror).
    A job without storage.uri is refused on Kubernetes; `grpo validate` builds its pods anyway."""
    if job.spec.storage.uri is None:
        return []
    return [{"name": LOG_URI_ENV, "value": RunLayout(job_root(job, local=False)).log("$(POD_NAME)")}]


def build_rollout_deployment(job: GRPOJob, settings: OperatorSettings, *, replicas: int | None = None
                             ) -> dict[str, Any]:
    """`replicas` defaults to spec.rollout.replicas (0 once the job finished)."""
    return server_deployment(job, settings, rollout_server(job, settings), replicas)


def build_rollout_service(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """The trainer re-resolves it every step."""
    return server_service(job, rollout_server(job, settings))


def build_network_policy(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Who reaches the rollout pods (rollout_server)."""
    return server_network_policy(job, settings, rollout_server(job, settings))


# --- the reward models' servers (issue 31) ------------------------------------------------------

def reward_server(job: GRPOJob, settings: OperatorSettings, index: int) -> Server:
    """spec.reward.rewardModels[index]'s servers. They get the job's token and TLS certificate, not
    the checkpoint key nor the storage credentials (they read only their model). gRPC only from the
    job's rollout pods (the trainer never calls them); one NetworkPolicy covers every model's."""
    m, rm = job.metadata, job.spec.reward.reward_models[index]
    return Server(
        role=REWARD, name=names.reward_model_name(m.name, rm.name), selector=names.reward_selector(m.name, rm.name),
        labels={names.REWARD_MODEL_LABEL: rm.name}, args=_args("reward", "--model", rm.name), env=_server_env(job),
        resources=container_resources(settings.rollout_resources, rm.gpus, settings),
        replicas=rm.replicas, template=rm.template, template_field=f"spec.reward.rewardModels[{index}].template",
        grace=settings.rollout_termination_grace_seconds, callers=[rollout_callers(job)], policy_name=f"{m.name}-reward")


def build_reward_deployment(job: GRPOJob, settings: OperatorSettings, index: int, *, replicas: int | None = None
                            ) -> dict[str, Any]:
    """`grpo reward` in the rollout image. `replicas` defaults to the model's replicas (0 while the
    rollout servers are at 0: a finished or queued job holds no GPUs). With spec.model.cache the
    cache volume is mounted read-only, so a reward model placed in it is found; the reward model's
    path is a local folder (nothing to fetch, so no init container)."""
    deployment = server_deployment(job, settings, reward_server(job, settings, index), replicas)
    cache = job.spec.model.cache
    if cache:
        pod = deployment["spec"]["template"]["spec"]
        pod["volumes"].append({"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}})
        pod["containers"][0]["volumeMounts"].append(
            {"name": MODEL_VOLUME, "mountPath": model_cache.MOUNT_PATH, "readOnly": True})
    return deployment


def build_reward_service(job: GRPOJob, settings: OperatorSettings, model: str) -> dict[str, Any]:
    """One reward model's servers; the rollout servers dial it (gRPC's dns resolver, round robin)."""
    index = [rm.name for rm in job.spec.reward.reward_models].index(model)
    return server_service(job, reward_server(job, settings, index))


def build_reward_network_policy(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """Of a job with reward models: one for every model's servers (it selects the role)."""
    return server_network_policy(job, settings, reward_server(job, settings, 0))


# --- the python tool's sandbox servers (issue 32) ------------------------------------------------

def sandbox_replicas(job: GRPOJob) -> int:
    return job.spec.rollout.multi_turn.sandbox_replicas(kubernetes=True)


def sandbox_server(job: GRPOJob, settings: OperatorSettings) -> Server:
    """The python tool's sandbox servers, for model-written code (docs/RELIABILITY.md). Least
    privilege: the job's token and server certificate (to serve the rollout servers), nothing else:
    no storage credentials, no checkpoint key, no model, no service-account token, a read-only root
    filesystem with a size-limited /tmp; no egress at all (not even DNS, enforced by a network
    plugin that implements NetworkPolicy's Egress), gRPC only from the job's rollout pods. The
    memory limit fits `concurrency` programs at their address-space limit."""
    m, py = job.metadata, job.spec.rollout.multi_turn.python
    memory = f"{py.concurrency * py.memory_mb + 256}Mi"
    # Each program may write 64 files of 16 MiB (its rlimits): /tmp holds every slot's worth.
    scratch = ({"name": "tmp", "emptyDir": {"sizeLimit": f"{py.concurrency}Gi"}}, {"name": "tmp", "mountPath": "/tmp"})
    return Server(
        role=SANDBOX, name=names.sandbox_name(m.name), selector=names.selector(m.name, SANDBOX), args=_args("sandbox"),
        env=_server_env(job, {"name": "TMPDIR", "value": "/tmp"}),
        resources={"requests": {"cpu": "250m", "memory": "256Mi"},
                   "limits": {"cpu": str(py.concurrency), "memory": memory}},
        replicas=sandbox_replicas(job), template=py.template, template_field="spec.rollout.multiTurn.python.template",
        grace=10, callers=[rollout_callers(job)], startup_probe=False, one_at_a_time=False, scratch=scratch, deny_egress=True)


def build_sandbox_deployment(job: GRPOJob, settings: OperatorSettings, *, replicas: int | None = None
                             ) -> dict[str, Any]:
    """`grpo sandbox` in the rollout image. `replicas` defaults to spec.rollout.multiTurn.python's."""
    return server_deployment(job, settings, sandbox_server(job, settings), replicas)


def build_sandbox_service(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    return server_service(job, sandbox_server(job, settings))


def build_sandbox_network_policy(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    return server_network_policy(job, settings, sandbox_server(job, settings))


def build_rollout_dependencies(job: GRPOJob, settings: OperatorSettings, *, rollout_replicas: int
                               ) -> list[dict[str, Any]]:
    """The Deployments of the servers the rollout servers call: every reward model's and the python
    tool's sandbox; at zero whenever the rollout servers, their only callers, are."""
    deployments = [build_reward_deployment(job, settings, i, replicas=None if rollout_replicas else 0)
                   for i in range(len(job.spec.reward.reward_models))]
    if sandbox_replicas(job):
        deployments.append(build_sandbox_deployment(job, settings, replicas=None if rollout_replicas else 0))
    return deployments
