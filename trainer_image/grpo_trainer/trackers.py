"""The experiment trackers of spec.trainer.loggers: Weights & Biases (`wandb`) and MLflow
(`mlflow`), logged to as verl logs to them. Rank 0 only (metrics.MetricsLogger owns them).

- trainer.projectName is the W&B project and the MLflow experiment, trainer.experimentName the
  run's name; the resolved spec is the run's config (W&B) or params (MLflow, flattened to
  dotted keys such as `trainer.lr`); every step's metrics go in under verl's names at that step.
- Credentials and endpoints come from each library's own environment variables (WANDB_API_KEY,
  WANDB_MODE, WANDB_BASE_URL, MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, ...), which the
  operator sets from spec.trainer.trackerSecretRef. Nothing here logs them.
- Each run's id goes into every checkpoint (`run_id`); a resumed job passes it back and continues
  the same run, so a restarted job draws one curve, not two.

The libraries are imported only when their logger is on (the `wandb` and `mlflow` extras).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from grpo_api.spec import GRPOJob

log = logging.getLogger("grpo.trainer")


class TrackerError(RuntimeError):
    """A tracker can't start a run; the message says what to set."""


def _not_installed(extra: str) -> TrackerError:
    return TrackerError(f"spec.trainer.loggers: {extra} needs the `{extra}` package "
                        f"(pip install 'grpo-operator[{extra}]'; the trainer image has it)")


class WandbRun:
    name = "wandb"

    def __init__(self, job: GRPOJob, run_id: str | None):
        try:
            import wandb
        except ImportError:
            raise _not_installed("wandb") from None
        t = job.spec.trainer
        try:
            # resume="allow": the checkpoint's run is continued, or made when the server lacks it.
            self._run = wandb.init(project=t.project_name, name=t.experiment_name, config=spec_dict(job),
                                   id=run_id, resume="allow" if run_id else None)
        except Exception as exc:  # noqa: BLE001 - wandb raises many types; all mean "no run"
            raise TrackerError(f"spec.trainer.loggers: wandb could not start a run: {exc} (W&B reads WANDB_API_KEY, "
                               f"WANDB_BASE_URL and WANDB_MODE from the environment; on Kubernetes from the Secret "
                               f"named in spec.trainer.trackerSecretRef)") from None
        self.run_id = self._run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self, finished: bool) -> None:
        if not finished:
            self._run.mark_preempting()     # stopped to be resumed (suspend, preemption)
        self._run.finish(exit_code=0 if finished else 143)


class MlflowRun:
    name = "mlflow"

    def __init__(self, job: GRPOJob, run_id: str | None):
        try:
            import mlflow
        except ImportError:
            raise _not_installed("mlflow") from None
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        self._Metric, self._MlflowException = Metric, MlflowException
        t = job.spec.trainer
        try:
            self._client = mlflow.MlflowClient()       # MLFLOW_TRACKING_URI and its credentials
            if run_id and self._exists(run_id):
                # Params are write-once in MLflow: a resumed run keeps the spec it started with.
                self._client.update_run(run_id, status="RUNNING")
            else:
                experiment = self._client.get_experiment_by_name(t.project_name)
                experiment_id = experiment.experiment_id if experiment else \
                    self._client.create_experiment(t.project_name)
                run_id = self._client.create_run(experiment_id, run_name=t.experiment_name).info.run_id
                params = [Param(k, v) for k, v in flat_params(spec_dict(job)).items()]
                self._client.log_batch(run_id, params=params)
        except Exception as exc:  # noqa: BLE001 - a refused request, no server, no local store: all mean "no run"
            where = "" if os.environ.get("MLFLOW_TRACKING_URI") else \
                "MLFLOW_TRACKING_URI is not set, so MLflow uses its local default; "
            raise TrackerError(f"spec.trainer.loggers: mlflow could not start a run: "
                               f"{getattr(exc, 'message', None) or exc!r} ({where}MLflow reads MLFLOW_TRACKING_URI and "
                               f"its credentials from the environment; on Kubernetes from the Secret named in "
                               f"spec.trainer.trackerSecretRef)") from None
        self.run_id = run_id

    def _exists(self, run_id: str) -> bool:
        try:
            self._client.get_run(run_id)
            return True
        except self._MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            log.warning("mlflow: the checkpoint's run %s is not on this tracking server; starting a new run", run_id)
            return False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        # verl's renaming: MLflow refuses '@' in metric names.
        batch = [self._Metric(k.replace("@", "_at_"), float(v), now, step) for k, v in metrics.items()]
        try:
            self._client.log_batch(self.run_id, metrics=batch)
        except self._MlflowException as exc:
            # A tracking-server outage must not end a training run: metrics.jsonl has the step.
            log.warning("mlflow: step %d not logged: %s", step, exc.message)

    def close(self, finished: bool) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


TRACKERS = {"wandb": WandbRun, "mlflow": MlflowRun}


def start_trackers(job: GRPOJob, run_ids: dict[str, str]) -> list[WandbRun | MlflowRun]:
    """The runs of the job's tracker loggers; `run_ids` (from the checkpoint) are continued."""
    return [TRACKERS[name](job, run_ids.get(name)) for name in job.spec.trainer.loggers if name in TRACKERS]


def spec_dict(job: GRPOJob) -> dict[str, Any]:
    """The resolved spec as the job file writes it (camelCase, defaults filled in)."""
    return job.spec.model_dump(mode="json", by_alias=True)


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"trainer": {"lr": 1e-06}}` -> `{"trainer.lr": "1e-06"}`; list items by index, as verl does."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, list) and value:
            value = {str(i): v for i, v in enumerate(value)}
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out
