"""Training progress for the status: the trainer (rank 0) rewrites `progress.json` under the job's
storage prefix every step (grpo_api.spec.Progress.to_json); the operator reads it on every
resync into the same model, which the status holds.

Reading must never block or fail a reconcile: a missing file (the first step hasn't finished)
or unreadable JSON give no progress, and the status keeps the last. Storage the operator can't
read (no credentials for s3://, most often) is returned as the reason, which the status shows
as the ProgressUnreadable condition.
"""

from __future__ import annotations

from collections.abc import Mapping

from grpo_api.spec import GRPOJob, Progress

SCORE_DIGITS = 4
"""Significant digits of the scores the status shows (`kubectl get gj`'s Reward, Val and Best print
the whole float, 17 digits of a mean over a batch); progress.json and metrics.jsonl keep them all."""


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
        return for_status(Progress.from_json(storage.read_bytes(uri))), None
    except (OSError, ValueError) as exc:
        # Never the credentials: StorageError messages name only the operation and the URI.
        return None, str(exc)


def for_status(progress: Progress | None) -> Progress | None:
    """The progress with its scores and failure fractions rounded to SCORE_DIGITS significant digits."""
    if progress is None:
        return None
    scores = {"reward_mean": progress.reward_mean, "validation_score": progress.validation_score,
              "best_score": progress.best_score, "reward_error_fraction": progress.reward_error_fraction,
              "tool_error_fraction": progress.tool_error_fraction}
    return progress.model_copy(update={k: float(f"{v:.{SCORE_DIGITS}g}") for k, v in scores.items() if v is not None})
