"""storage.keepRolloutsSteps (issue 35): a long run keeps the rollouts of its last N steps only.

Trainer rank 0 calls `prune_rollouts` after each step is trained, logged and checkpointed. What
a later reader needs is never deleted:
- the last N steps (the step just trained and the N-1 before it; the next step's folder, which
  may be generated ahead, is newer than all of them);
- step C+1 of every complete checkpoint C: a resume from C trains step C+1 next, on the batch
  the checkpoint names when it was generated ahead (rollout.maxStaleness 1), and `grpo replay
  --step C+1` reads the shards that step trained on. Replay of any other step is impossible
  anyway (it starts from the checkpoint before the step). A checkpoint removed later by
  trainer.keepCheckpoints frees its step at the next prune.
prompts/step-N/ (the rollouts' input shards) goes with rollouts/step-N/. The deleted steps are
recorded in rollouts/retention.json before they are deleted (export and `grpo ui` say so).
"""

from __future__ import annotations

import logging
import re

from grpo_api.records import RunLayout
from grpo_trainer.rollout_history import RetentionRecord
from grpo_api.storage import Storage, StorageError

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")


def steps_to_delete(stored: list[int], *, step: int, keep: int, checkpoints: list[int]) -> list[int]:
    """Of the steps with rollouts in storage, those to delete after step `step` (module docstring)."""
    needed = {c + 1 for c in checkpoints}
    return [s for s in sorted(stored) if s <= step - keep and s not in needed]


def stored_steps(layout: RunLayout, storage: Storage, kind: str = "rollouts") -> list[int]:
    root = f"{layout.root}/{kind}"
    return sorted(int(m.group(1)) for uri in storage.list(root) if (m := _STEP_DIR.match(uri.rsplit("/", 1)[-1])))


def prune_rollouts(layout: RunLayout, storage: Storage, *, step: int, keep: int, checkpoints: list[int]) -> list[int]:
    """Delete the rollouts (and prompts) of the steps `steps_to_delete` names; returns them.
    `checkpoints`: the steps of the run's complete checkpoints."""
    stored = sorted(set(stored_steps(layout, storage)) | set(stored_steps(layout, storage, "prompts")))
    doomed = steps_to_delete(stored, step=step, keep=keep, checkpoints=checkpoints)
    if not doomed:
        return []
    try:
        old = RetentionRecord.from_json(storage.read_bytes(layout.rollouts_retention), layout.rollouts_retention)
    except FileNotFoundError:
        old = RetentionRecord(keep)
    record = RetentionRecord(keep, old.deleted).with_deleted(doomed)
    try:
        storage.write_bytes(layout.rollouts_retention, record.to_json())
        for s in doomed:
            storage.delete_dir(layout.step_dir("rollouts", s))
            storage.delete_dir(layout.step_dir("prompts", s))
    except StorageError as exc:   # housekeeping: the next step tries again
        log.warning("storage.keepRolloutsSteps: could not delete the rollouts of steps %s: %s", doomed, exc)
        return []
    return doomed
