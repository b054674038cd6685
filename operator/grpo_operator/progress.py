"""Training progress for the status: the trainer (rank 0) rewrites `progress.json` under the job's
storage prefix every step (grpo_trainer.metrics.MetricsLogger.write_progress); the operator reads
it on every resync and copies the keys the status has (grpo_api.spec.Progress).

Reading must never block or fail a reconcile: a missing file (the first step hasn't finished),
storage that is down or unreadable JSON all give None, and the status keeps the last progress.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from pydantic import ValidationError

from grpo_api.spec import GRPOJob, Progress

log = logging.getLogger("grpo.operator")
_FIELDS = {f.alias or name: name for name, f in Progress.model_fields.items()}


def parse_progress(data: bytes) -> Progress | None:
    """The Progress in a progress.json document (extra keys ignored), or None if unreadable."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    known = {k: v for k, v in doc.items() if k in _FIELDS and v is not None}
    for key in ("step", "epoch", "policyVersion", "totalSteps"):
        if isinstance(known.get(key), float):
            known[key] = int(known[key])
    try:
        return Progress.model_validate(known)
    except ValidationError:
        return None


def read_progress(job: GRPOJob, env: Mapping[str, str]) -> Progress | None:
    """Read the job's progress.json; `env` carries the S3 credentials (AWS_*) for s3:// storage."""
    from grpo_api.records import RunLayout
    from grpo_api.storage import Storage, job_root

    try:
        uri = RunLayout(job_root(job, local=False)).progress
        storage = Storage(job.spec.storage, env=env, attempts=2, backoff_seconds=0.2)
        if not storage.exists(uri):
            return None
        return parse_progress(storage.read_bytes(uri))
    except (OSError, ValueError) as exc:
        # Never the credentials: StorageError messages name only the operation and the URI.
        log.warning("%s/%s: can't read progress: %s", job.metadata.namespace, job.metadata.name, exc)
        return None
