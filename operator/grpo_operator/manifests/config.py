"""The job's configuration children: the spec ConfigMap the pods read and the rpc Secret."""

from __future__ import annotations

import json
from typing import Any

from grpo_api.jobfile import dump_job
from grpo_api.spec import GRPOJob, ObjectMeta

from grpo_operator import names
from grpo_operator.manifests.common import object_meta
from grpo_operator.pki import JobTLS
from grpo_operator.settings import OperatorSettings


def pod_job(job: GRPOJob) -> GRPOJob:
    """What the pods read: the spec with defaults filled in, named (the uid places the run's
    files: grpo_api.storage.job_root), without status or API bookkeeping (managedFields, ...)."""
    meta = ObjectMeta(name=job.metadata.name, namespace=job.metadata.namespace, uid=job.metadata.uid)
    return GRPOJob(metadata=meta, spec=job.spec)


def build_config_map(job: GRPOJob, settings: OperatorSettings) -> dict[str, Any]:
    """The resolved spec the pods read, and the operator defaults the job's pods are built with
    (pinned when the job was first reconciled: reconciler.Reconciler._job_settings reads them
    back, so a changed operator default never reaches a running job)."""
    m = job.metadata
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": object_meta(job, names.config_map_name(m.name), "spec"),
            "data": {names.SPEC_KEY: dump_job(pod_job(job)),
                     names.DEFAULTS_KEY: json.dumps(settings.job_defaults(), indent=2, sort_keys=True) + "\n"}}


def build_rpc_secret(job: GRPOJob, settings: OperatorSettings, *, token: str, checkpoint_key: str,
                     tls: JobTLS) -> dict[str, Any]:
    """The secrets are arguments (kept pure); the reconciler makes them (`secrets.token_hex`,
    `grpo_api.signing.new_key`, `pki.make_job_tls`) and creates the Secret once: it is never
    re-applied, so running pods keep a valid token, certificate and key."""
    m = job.metadata
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": object_meta(job, names.secret_name(m.name), "rpc"),
            "stringData": {names.TOKEN_KEY: token, names.CHECKPOINT_KEY_KEY: checkpoint_key,
                           names.CA_CERT_KEY: tls.ca_cert, names.TLS_CERT_KEY: tls.cert, names.TLS_KEY_KEY: tls.key}}
