"""The learner, run under torchrun: components built from the spec, and a loop that calls them in
the order of docs/ARCHITECTURE.md §1.

- `RolloutSource` (rollouts.py): steps 1-2, the step's `RolloutBatch` and samples on every rank
  (data, sampler, dispatch, dynamic sampling, the maxStaleness 1 prefetch);
- `Actor` (actor.py): step 3, advantages and the policy update (policy, reference, optimizer;
  with PPO the `Critic`, critic.py, whose values make the advantages);
- `WeightPublisher` (publisher.py): step 4, the new weights to every rollout server;
- `Validator` (validation.py) and `Checkpointer` (checkpoint.py): each decides when it runs;
- metrics.py: the step's metrics and the loggers; progress.json is grpo_api.spec.Progress.

Rank 0 owns the data, talks to the rollout servers and writes progress; every rank holds an
FSDP2 shard of the policy (and reference) and takes its share of every mini-batch. What rank 0
decides reaches the others as JSON over a broadcast (nothing is pickled).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpo_api.contracts import STOPPED_EXIT_CODE
from grpo_api.model_cache import local_model
from grpo_api.records import RunLayout
from grpo_api.rpc import ClientAuth
from grpo_api.spec import GRPOJob, Progress
from grpo_api.storage import Storage, job_root
from grpo_trainer import rollouts
from grpo_trainer.actor import Actor
from grpo_trainer.checkpoint import Checkpointer, complete_checkpoints, open_compile_cache
from grpo_trainer.metrics import ProgressBar, open_metrics, setup_logging, step_metrics
from grpo_trainer.model import load_tokenizer, training_device
from grpo_trainer.publisher import WeightPublisher
from grpo_trainer.rollout_servers import RolloutServers, StoppedWaiting, static_or_dns_discovery
from grpo_trainer.validation import Validator

log = logging.getLogger("grpo.trainer")


@dataclass
class State:
    step: int = 0
    policy_version: int = 0


class Trainer:
    def __init__(self, job: GRPOJob, *, rollout_addresses: str, auth: ClientAuth, checkpoint_key: bytes,
                 local: bool, metrics_port: int | None = None):
        started = time.time()
        self._stop_flag = False      # set by SIGTERM (request_stop)
        self.job, self.spec = job, job.spec
        # The resolved job as checkpoints keep it: `grpo replay` retrains a step under it.
        self.job_json = job.model_dump(mode="json", by_alias=True, exclude={"status"})
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        setup_logging(self.rank)
        self.device = training_device(self.spec.trainer.device)
        torch.manual_seed(self.spec.trainer.seed)
        self.storage = Storage(self.spec.storage)
        self.layout = RunLayout(job_root(job, local=local))
        self.metrics_host = "127.0.0.1" if local else "0.0.0.0"     # `grpo run`: /metrics for this machine only
        # The model as the loaders see it: a fetched model's cache folder (spec.model keeps the
        # user's location: checkpoints record it).
        self.model_spec = local_model(self.spec.model, self.spec.storage,
                                      log=print if self.rank == 0 else lambda *_: None)
        self.compile_cache = open_compile_cache(self.spec.storage, self.storage, self.layout, checkpoint_key,
                                                device=self.device, compile=self.spec.trainer.use_torch_compile,
                                                model_path=self.model_spec.path)    # before anything compiles
        tokenizer = load_tokenizer(self.model_spec)
        self.lora_config = Actor.check(self.model_spec)      # before any write
        # Rank 0's clients of the rollout servers (the dispatcher's and the weight senders').
        self.servers = RolloutServers(static_or_dns_discovery(rollout_addresses), auth,
                                      stopping=lambda: self._stop_flag) if self.rank == 0 else None
        datasets, self.steps_per_epoch = rollouts.prepare(self.spec, tokenizer, self.storage, self.layout,
                                                          started=started, device=self.device, servers=self.servers,
                                                          job_uid=job.metadata.uid, model_spec=self.model_spec)
        self.total_steps = self.spec.trainer.total_steps or self.spec.trainer.total_epochs * self.steps_per_epoch
        self.actor = Actor(self.model_spec, self.spec, device=self.device, total_steps=self.total_steps,
                           pad_token_id=tokenizer.pad_token_id)
        self.checkpointer = Checkpointer(self.spec.trainer, resume=self.spec.resume, layout=self.layout,
                                         parts=self.actor.checkpoint_parts(), storage=self.storage, key=checkpoint_key,
                                         device=self.device, model_spec=self.model_spec, lora_config=self.lora_config,
                                         adapter=lambda: self.publisher.final_adapter())
        self._resume_and_connect(datasets, metrics_port)

    def _resume_and_connect(self, datasets, metrics_port: int | None) -> None:
        """Collective: the checkpoint spec.resume names (if any) into every component; the
        loggers, the rollout side and the validator connected."""
        resumed = self.checkpointer.resume()
        self.state = State(resumed.trainer.step, resumed.trainer.policy_version) if resumed else State()
        # The last progress.json written; a resumed start says so (the operator's Resumed event).
        self.progress = Progress(resumed_from_step=self.state.step,
                                 resumed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())) if resumed else None
        # This job's own checkpoint continues its tracker runs (not another job's, with resume: <uri>).
        self.metrics = open_metrics(self.job, self.layout, self.storage, device=self.device,
                                    resumed_step=self.state.step, metrics_port=metrics_port,
                                    metrics_host=self.metrics_host,
                                    tracker_runs=resumed.metrics.trackers if self.checkpointer.resumed_own else None)
        self._connect_rollouts(datasets)
        self.validator = Validator(self.spec, self.rollouts, generating=self.actor.offloader.off_gpu)
        if resumed:
            self.actor.load_state_dict(resumed.actor)
            self.rollouts.load_state_dict(resumed.rollouts, resumed.trainer)
            self.validator.load_state_dict(resumed.validator)

    def _connect_rollouts(self, datasets) -> None:
        """The weight publisher and the rollout source, sharing rank 0's clients of the servers."""
        servers = self.servers
        # In the rollout engines' dtype (spec.model.dtype) on GPU; float32 on CPU.
        rollout_dtype = getattr(torch, self.spec.model.dtype.value) if self.device.type == "cuda" else torch.float32
        self.publisher = WeightPublisher(self.actor.model, self.spec.weight_sync, dtype=rollout_dtype,
                                         device=self.device, servers=servers,
                                         lora_merge=bool(self.model_spec.lora and self.model_spec.lora.merge))
        self.rollouts = rollouts.RolloutSource.connect(self.spec, servers=servers, weights=self.publisher,
                                                       layout=self.layout, datasets=datasets, storage=self.storage,
                                                       total_steps=self.total_steps, device=self.device)

    # --- the loop ----------------------------------------------------------------------------

    def train(self) -> None:
        if self.rank == 0:
            log.info("Starting GRPO training loop... (%d steps, %d per epoch, world size %d, %s)",
                     self.total_steps, self.steps_per_epoch, self.world, self.device)
        # Rollout servers may hold the initial weights (a resumed run), or a later policy (a
        # trainer restarted before its first checkpoint): this policy goes out first.
        # A LoRA adapter to start from (model.lora.adapterPath) is not what the servers loaded.
        started_from_adapter = bool(self.model_spec.lora and self.model_spec.lora.adapter_path)
        self.publisher.catch_up(self.state.policy_version, force=self.state.step > 0 or started_from_adapter)
        if self.progress is not None and self.rank == 0:
            self._write_progress({})      # Step goes back to the checkpoint's at once, with the reason
        if self.spec.trainer.val_only:
            return self._validate_only()
        if (metrics := self.validator.before_training(self.state.step, self.state.policy_version)) and self.rank == 0:
            self.metrics.log(0, metrics)
        bar = ProgressBar(self.total_steps, self.state.step) if self.rank == 0 else None
        while self.state.step < self.total_steps:
            if self._stop_requested():
                self._stop()
            self.state.step += 1
            step, last = self.state.step, self.state.step == self.total_steps
            try:
                metrics = self.train_step(step)
            except StoppedWaiting as exc:
                log.warning("Stopping on SIGTERM during step %d, %s: a resume redoes it from %s", step, exc,
                            self.checkpointer.last or "the start")
                raise SystemExit(STOPPED_EXIT_CODE) from None
            metrics |= self.validator.maybe_validate(step, self.state.policy_version, last=last)
            metrics |= self.checkpointer.maybe_save(step, self._checkpoint_state, metrics, last=last,
                                                    weights=self.publisher.final_weights)
            if self.rank == 0:
                self.metrics.log(step, metrics)
                self._write_progress(metrics)
                self.rollouts.prune(step, checkpoints=self._checkpoint_steps)
                bar.update(metrics)
        weights, adapter = self.publisher.final_weights(), self.publisher.final_adapter()
        if self.rank == 0:
            bar.close()
            self.checkpointer.export(weights, self.layout.hf_export(self.state.step), adapter)
            self.metrics.close()
        dist.barrier()

    def _validate_only(self) -> None:
        """trainer.valOnly (verl: trainer.val_only): the policy as loaded or resumed, validated once;
        nothing trains, nothing is checkpointed or exported."""
        metrics = self.validator.validate(self.state.step, self.state.policy_version)
        if self.rank == 0:
            log.info("trainer.valOnly: validated the policy of step %d; exiting without training", self.state.step)
            self.metrics.log(self.state.step, metrics)
            self._write_progress({})
            self.metrics.close()
        dist.barrier()

    def train_step(self, step: int) -> dict[str, float]:
        """One step of docs/ARCHITECTURE.md §1: rollouts, advantages and the update, new weights."""
        start = time.perf_counter()
        # trainer.paramOffload: the policy leaves the GPUs that colocated engines generate on
        offloaded = self.actor.offloader.offload()
        # 1-2: prompts out, scored rollouts back (a Generate wakes a sleeping engine's KV cache)
        batch, samples = self.rollouts.next(step, self.state.policy_version)
        if self.rank == 0:
            self.rollouts.record_accepted(step, batch, world=self.world)
        slept = self.rollouts.sleep_engines()     # colocated: the GPUs' memory to the update
        onloaded = self.actor.offloader.onload()
        # 3: advantages, log-probs, the update
        update = self.actor.train_on(samples, off_policy=batch.off_policy, step=step)
        # 4: new weights to every rollout server, once the next step's generation (on these
        # weights) is done
        self.rollouts.settle()
        self.state.policy_version += 1
        woken = self.rollouts.wake_engines(("weights",))   # the engines' weights back, to take the new ones
        timings = {**batch.timings(), **update.timings, **offloaded, **onloaded, **slept, **woken,
                   **self.publisher.publish(self.state.policy_version)}
        timings["timing_s/step"] = time.perf_counter() - start
        if self.compile_cache is not None and self.rank == 0:
            self.compile_cache.save_if_grown()     # after the step: its first steps compile
        return {**step_metrics(step, self.state.policy_version, samples, batch, update, timings, world=self.world,
                               device=self.device), **self.rollouts.metrics()}

    # --- stopping, checkpoints, progress -------------------------------------------------------

    def request_stop(self) -> None:
        """From a SIGTERM handler: checkpoint at the next step boundary, then exit (suspend,
        preemption, Ctrl-C of `grpo run`)."""
        self._stop_flag = True

    def _stop_requested(self) -> bool:
        flag = torch.tensor([1.0 if self._stop_flag else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)   # every rank stops at the same step
        return bool(flag.item())

    def _stop(self) -> None:
        self.checkpointer.save(self.state.step, self._checkpoint_state())
        log.warning("Stopping on SIGTERM after a checkpoint at step %d", self.state.step)
        if self.rank == 0:
            self._write_progress({})      # its lastCheckpoint is the one a resume takes
            self.metrics.close(finished=False)
        raise SystemExit(STOPPED_EXIT_CODE)

    def _checkpoint_steps(self) -> list[int]:
        return [s for s, _ in complete_checkpoints(self.layout, self.storage)]

    def _checkpoint_state(self) -> dict:
        """What the components need back on resume, each its own part of state.TrainerState, which
        the checkpointer validates them into (rank 0's is the one kept)."""
        run = {"step": self.state.step, "policy_version": self.state.policy_version, "world_size": self.world,
               "total_steps": self.total_steps, "job": self.job_json, "lora_config": self.lora_config,
               "model": self.spec.model.model_dump(mode="json", by_alias=True)}
        return {"trainer": run, "rollouts": self.rollouts.state_dict(), "actor": self.actor.state_dict(),
                "validator": self.validator.state_dict(),
                "metrics": {"trackers": self.metrics.tracker_runs() if self.metrics else {}}}

    def _write_progress(self, metrics: dict[str, float]) -> None:
        """progress.json, which the operator copies into the status. Without a step's metrics (a
        stop) the last ones stay."""
        best = self.checkpointer.best
        self.progress = Progress.model_validate({
            **(self.progress or Progress()).model_dump(), "step": self.state.step, "total_steps": self.total_steps,
            "policy_version": self.state.policy_version, "validation_score": self.validator.score,
            "last_checkpoint": self.checkpointer.last,
            **({"epoch": metrics["training/epoch"], "reward_mean": metrics["critic/score/mean"],
                "reward_error_fraction": metrics["reward/error_fraction"],
                "tool_error_fraction": metrics.get("tool_calls/error_fraction")} if metrics else {}),
            **({"best_step": best["step"], "best_score": best["score"]} if best else {})})
        self.storage.write_bytes(self.layout.progress, self.progress.to_json())
