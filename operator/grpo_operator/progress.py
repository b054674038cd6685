"""Training progress for the status: the trainer (rank 0) rewrites `progress.json` under the job's
storage prefix every step (grpo_trainer.metrics.MetricsLogger.write_progress); the operator reads
it on every resync and copies the keys the status has (grpo_api.spec.Progress).

Reading must never block or fail a reconcile: a missing file (the first step hasn't finished)
or unreadable JSON give no progress, and the status keeps the last. Storage the operator can't
read (no credentials for s3://, most often) is returned as the reason, which the status shows
as the ProgressUnreadable condition.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pydantic import ValidationError

from grpo_api.spec import GRPOJob, Progress

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


def read_progress(job: GRPOJob, env: Mapping[str, str]) -> tuple[Progress | None, str | None]:
    """The job's progress.json (None while there is none) and why it can't be read (None when
    it can); `env` carries the S3 credentials (AWS_*) for s3:// storage."""
    from grpo_api.records import RunLayout
    from grpo_api.storage import Storage, job_root

    try:
        uri = RunLayout(job_root(job, local=False)).progress
        storage = Storage(job.spec.storage, env=env, attempts=2, backoff_seconds=0.2)
        if not storage.exists(uri):
            return None, None
        return parse_progress(storage.read_bytes(uri)), None
    except (OSError, ValueError) as exc:
        # Never the credentials: StorageError messages name only the operation and the URI.
        return None, str(exc)
