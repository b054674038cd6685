"""Operator settings: what the cluster admin decides once for every GRPOJob (images, default
resources, security context, monitoring), as opposed to the job's own spec.

Each field is read from a CLI flag (`--trainer-image`), else the environment
(`GRPO_OPERATOR_TRAINER_IMAGE`), else the default here. The Helm chart sets the environment from
its values, so every field is a chart value. Dict fields (resources, labels) are JSON; tuple fields
are comma-separated.

Callers: `grpo operator` (commands.py) builds one `OperatorSettings` and passes it to the
manifest builders and the reconciler; nothing reads the environment after that.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ENV_PREFIX = "GRPO_OPERATOR_"


@dataclass(frozen=True, kw_only=True)
class OperatorSettings:
    # --- what to watch ---------------------------------------------------------------------
    namespaces: tuple[str, ...] = ()
    """Namespaces whose GRPOJobs this operator serves; empty serves every namespace (and then
    needs a ClusterRole; the chart's `watchNamespaces` value sets both)."""

    # --- images ----------------------------------------------------------------------------
    trainer_image: str = "ghcr.io/grpo-operator/trainer:0.1.0"
    """Image of the trainer pods (Dockerfile.trainer); a job may override it in its template."""
    rollout_image: str = "ghcr.io/grpo-operator/rollout:0.1.0"
    """Image of the rollout pods (Dockerfile.rollout, pinned vLLM)."""
    colocated_image: str = ""
    """Image of the trainer pods of a job with rollout.placement colocated: they run `grpo rollout`
    beside the trainer, so it needs the trainer's and the rollout's packages (and vLLM for engine
    vllm). Empty: the rollout image, which carries the trainer's extra too (Dockerfile.rollout)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Pull policy of both images."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets (in the job's namespace) to pull the images with."""

    # --- resources -------------------------------------------------------------------------
    trainer_resources: dict[str, Any] = field(default_factory=lambda: {
        "requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}})
    """CPU/memory of one trainer pod (GPUs are added from spec.trainer.nprocPerNode)."""
    rollout_resources: dict[str, Any] = field(default_factory=lambda: {
        "requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}})
    """CPU/memory of one rollout pod (GPUs are added from spec.rollout.tensorParallelSize)."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of a GPU."""
    shm_size: str = "16Gi"
    """Size limit of the memory-backed /dev/shm (NCCL and dataloader workers need more than the
    container runtime's 64 MiB default)."""

    # --- security --------------------------------------------------------------------------
    run_as_user: int = 1000
    """UID (and GID) the pods run as; the images' user is 1000."""
    trainer_termination_grace_seconds: int = 1800
    """How long a trainer pod may take to stop: on SIGTERM (suspend, preemption) the trainer
    finishes its step and checkpoints, which for a large model takes minutes."""
    rollout_termination_grace_seconds: int = 60
    """How long a rollout pod may take to stop (finish in-flight requests)."""
    keep_failed_trainer_pods: bool = True
    """Keep a failed trainer attempt's pods, for `kubectl logs`, until the next attempt runs (and
    the last attempt's for good). They hold no GPUs: their containers have exited. Off: they go
    with the failed Job."""

    gang_scheduler_name: str = "scheduler-plugins-scheduler"
    """Scheduler of gang-scheduled trainer pods (spec.runPolicy.schedulingPolicy): one that runs
    scheduler-plugins' coscheduling plugin (the name its Helm chart deploys by default)."""

    # --- networking and monitoring -----------------------------------------------------------
    network_policy: bool = True
    """Create a NetworkPolicy per job: the rollout pods accept gRPC (and NCCL) only from the
    job's own pods, and metrics scrapes as below."""
    metrics_namespace: str | None = None
    """Namespace whose pods may scrape the job's metrics port (e.g. monitoring); null allows
    any pod in the job's own namespace."""
    pod_monitor: Literal["auto", "true", "false"] = "auto"
    """Create a PodMonitor per job: auto does when the monitoring.coreos.com CRDs exist."""
    pod_monitor_labels: dict[str, str] = field(default_factory=dict)
    """Extra labels on the PodMonitors (e.g. release: kube-prometheus-stack, for its selector)."""

    # --- operator process ------------------------------------------------------------------
    resync_seconds: float = 10.0
    """How often every job is re-examined even without a watch event: this reads progress.json,
    enforces deadlines and the TTL."""
    metrics_port: int = 8080
    """Port of the operator's own Prometheus metrics (0 disables them)."""
    liveness_endpoint: str = "http://0.0.0.0:8081/healthz"
    """kopf's liveness endpoint, for the Deployment's livenessProbe ('' disables it)."""
    read_storage_secrets: bool = False
    """Read a job's spec.storage.secretRef Secret to fetch progress.json from s3:// storage. Off
    by default: that needs `get` on Secrets; the operator's own AWS_* environment (a read-only
    credential) is used instead."""
    field_manager: str = "grpo-operator"
    """Server-side apply field manager of the children."""
    missing_secret_grace_seconds: float = 60.0
    """How long a job's pods may wait for a Secret the job names (spec.storage.secretRef,
    spec.trainer.trackerSecretRef, a template's env) that doesn't exist before the job fails
    (reason SecretNotFound), instead of waiting the whole pending deadline."""

    # --- per job -----------------------------------------------------------------------------

    def job_defaults(self) -> dict[str, Any]:
        """The defaults a job's pods are built with (JOB_DEFAULTS), as JSON values: pinned per job
        when it is first reconciled (reconciler.Reconciler._job_settings), so that changing them
        (`helm upgrade` of jobDefaults) reaches only new jobs."""
        return {name: list(v) if isinstance(v := getattr(self, name), tuple) else copy.deepcopy(v)
                for name in JOB_DEFAULTS}

    def with_job_defaults(self, pinned: Mapping[str, Any]) -> "OperatorSettings":
        """These settings with a job's pinned defaults (job_defaults()) put back. A default the
        pinned record lacks (one a later operator version added) keeps its current value; a
        malformed record is a ValueError."""
        hints = typing.get_type_hints(type(self))
        values: dict[str, Any] = {}
        for name in JOB_DEFAULTS:
            if name not in pinned:
                continue
            value, hint = pinned[name], hints[name]
            if typing.get_origin(hint) is tuple:
                if not isinstance(value, list):
                    raise ValueError(f"{name}: expected a list (got {value!r})")
                value = tuple(str(v) for v in value)
            elif typing.get_origin(hint) is dict and not isinstance(value, dict):
                raise ValueError(f"{name}: expected an object (got {value!r})")
            values[name] = value
        return dataclasses.replace(self, **values)

    # --- reading -----------------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
                 ) -> "OperatorSettings":
        """Defaults < environment (GRPO_OPERATOR_*) < overrides (already typed, e.g. CLI flags).
        A malformed value is a ValueError naming the variable."""
        env = os.environ if env is None else env
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name = ENV_PREFIX + f.name.upper()
            if name in env:
                try:
                    values[f.name] = parse_value(hints[f.name], env[name])
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls(**values)

    def __post_init__(self) -> None:
        if self.resync_seconds <= 0:
            raise ValueError(f"resync_seconds must be > 0 (got {self.resync_seconds})")
        if self.run_as_user <= 0:
            raise ValueError(f"run_as_user must be a non-root UID > 0 (got {self.run_as_user})")


JOB_DEFAULTS = (
    "trainer_image", "rollout_image", "colocated_image", "image_pull_policy", "image_pull_secrets", "trainer_resources",
    "rollout_resources", "gpu_resource", "shm_size", "run_as_user", "trainer_termination_grace_seconds",
    "rollout_termination_grace_seconds", "gang_scheduler_name")
"""The settings that shape a job's pods (the chart's `jobDefaults`: images, resources, security,
grace periods, scheduler): fixed per job when it is first reconciled and recorded in its
`<job>-spec` ConfigMap, as Kubeflow Trainer pins a TrainJob to its runtime. The rest (network
policy, PodMonitor, keeping failed pods, the operator process's own) applies to every job at once:
changing them restarts no pod."""


def parse_value(hint: Any, raw: str) -> Any:
    """A string (environment, CLI) as the field's type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false (got {raw!r})")
    if hint is int or hint is float:
        try:
            return hint(raw)
        except ValueError:
            raise ValueError(f"expected a number (got {raw!r})") from None
    if origin is tuple:
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    if origin is dict:
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"expected a JSON object ({exc.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object (got {raw!r})")
        return value
    if origin is Literal:
        if raw not in args:
            raise ValueError(f"expected one of {', '.join(args)} (got {raw!r})")
        return raw
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        return None if raw in ("", "null") else parse_value(next(a for a in args if a is not type(None)), raw)
    return raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per field (strings, parsed like the environment); unset flags are None."""
    for f in dataclasses.fields(OperatorSettings):
        doc = _DOCS.get(f.name, "")
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, metavar="VALUE",
                            help=f"{doc} (env {ENV_PREFIX}{f.name.upper()})")


def from_arguments(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> OperatorSettings:
    hints = typing.get_type_hints(OperatorSettings)
    overrides = {}
    for f in dataclasses.fields(OperatorSettings):
        raw = getattr(args, f.name, None)
        if raw is not None:
            try:
                overrides[f.name] = parse_value(hints[f.name], raw)
            except ValueError as exc:
                raise ValueError(f"--{f.name.replace('_', '-')}: {exc}") from None
    return OperatorSettings.from_env(env, overrides)


def _field_docs() -> dict[str, str]:
    """Field docstrings (the attribute docstrings above), for --help."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(OperatorSettings))
    docs, body = {}, tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


try:
    _DOCS = _field_docs()
except (OSError, TypeError):  # no source (zipapp, frozen): --help without descriptions
    _DOCS = {}
