"""The GRPO learner, run under torchrun: one `Trainer.train()` loop, steps of docs/ARCHITECTURE.md §1.

Rank 0 owns the data, talks to the rollout servers and writes progress; every rank holds an
FSDP2 shard of the policy (and reference) and takes its share of every mini-batch. What rank 0
decides reaches the others as JSON over a broadcast (nothing is pickled).
"""

from __future__ import annotations

import io
import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from grpo_api.model_cache import local_model
from grpo_api.proto import rollout_pb2 as pb
from grpo_api.records import RunLayout
from grpo_api.rpc import ClientAuth
from grpo_api.spec import GRPOJob
from grpo_api.storage import Storage, StorageError, job_root
from grpo_trainer import actor, batch as batching, checkpoint
from grpo_trainer.collectives import broadcast_json
from grpo_trainer.data import DataError, EpochSampler, PromptRow, load_prompts, prompt_shard_table
from grpo_trainer.metrics import MetricsLogger, ProgressBar, setup_logging
from grpo_trainer.model import (build_optimizer, build_policy, build_reference, load_tokenizer,
                                num_parameters)
from grpo_trainer.prefetch import RolloutPrefetch
from grpo_trainer.publisher import WeightPublisher
from grpo_trainer.rollout_client import RolloutDispatcher, static_or_dns_discovery
from grpo_trainer.trackers import TrackerError

log = logging.getLogger("grpo.trainer")

# Dense bf16 peak FLOP/s for the MFU estimate; GRPO_PEAK_FLOPS overrides.
# DAPO dynamic sampling: generation rounds per step before topping up (verl: max_num_gen_batches).
MAX_GENERATION_ROUNDS = 10
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


class SetupError(RuntimeError):
    """The run can't start (bad data, unwritable storage); the message says what to fix."""


@dataclass
class State:
    step: int = 0
    policy_version: int = 0
    last_checkpoint: str | None = None
    validation_score: float | None = None
    reward_mean: float | None = None
    tracker_runs: dict[str, str] = field(default_factory=dict)   # W&B / MLflow run ids, continued on resume


class Trainer:
    def __init__(self, job: GRPOJob, *, rollout_addresses: str, auth: ClientAuth, checkpoint_key: bytes,
                 local: bool, metrics_port: int | None = None):
        started = time.time()
        self.job, self.spec = job, job.spec
        self.checkpoint_key = checkpoint_key
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        setup_logging(self.rank)
        self.device = self._device()
        torch.manual_seed(self.spec.trainer.seed)
        self.storage = Storage(self.spec.storage)
        self.layout = RunLayout(job_root(job, local=local))
        # The model as the loaders see it: a fetched model's cache folder (spec.model keeps the
        # user's location: checkpoints record it).
        self.model_spec = local_model(self.spec.model, self.spec.storage,
                                      log=print if self.rank == 0 else lambda *_: None)
        self.tokenizer = load_tokenizer(self.model_spec)
        self.state = State()
        self.sampler: EpochSampler | None = None
        problem = None
        if self.rank == 0:
            try:
                self._load_data()
                # Before any model is built: a storage location that can't be written fails now.
                self._check_storage()
            except (DataError, StorageError) as exc:
                problem = str(exc)
            else:
                self._clean_leftovers(started)
        # Rank 0 decides; every rank stops on its problem, with its message (not a broken pipe).
        setup = broadcast_json({"error": problem} if problem else
                               {"batches_per_epoch": self.sampler.batches_per_epoch if self.sampler else 0},
                               self.device)
        if "error" in setup:
            raise SetupError(setup["error"])
        batches_per_epoch = setup["batches_per_epoch"]
        self.total_steps = self.spec.trainer.total_steps or self.spec.trainer.total_epochs * batches_per_epoch
        self.steps_per_epoch = batches_per_epoch
        compile = self.spec.trainer.use_torch_compile
        self.model = build_policy(self.model_spec, self.device, compile=compile)
        self.ref = (build_reference(self.model_spec, self.device, cpu_offload=self.spec.trainer.ref_cpu_offload,
                                    compile=compile)
                    if self.spec.algorithm.use_kl_loss else None)
        self.optimizer, self.scheduler = build_optimizer(self.model, self.spec.trainer, self.total_steps)
        self.n_params = num_parameters(self.model)
        self.prefetch = RolloutPrefetch()   # rank 0, rollout.maxStaleness 1
        self._resume()
        self.dispatcher = self.metrics = None
        problem = None
        if self.rank == 0:
            try:
                self.metrics = MetricsLogger(job, self.layout, self.storage, metrics_port=metrics_port,
                                             tracker_runs=self.state.tracker_runs)
            except TrackerError as exc:
                problem = str(exc)
        if problem := broadcast_json(problem, self.device):
            raise SetupError(problem)
        if self.rank == 0:
            self.metrics.resume_from(self.state.step)
            self.dispatcher = RolloutDispatcher(
                discover=static_or_dns_discovery(rollout_addresses), auth=auth, layout=self.layout,
                storage=self.storage, timeout=self.spec.rollout.request_timeout_seconds,
                ensure_version=self._ensure_worker_version)
        # In the rollout engines' dtype (spec.model.dtype) on GPU; float32 on CPU.
        rollout_dtype = getattr(torch, self.spec.model.dtype.value) if self.device.type == "cuda" else torch.float32
        self.publisher = WeightPublisher(
            self.model, self.spec.weight_sync, dtype=rollout_dtype, device=self.device, auth=auth,
            workers=self.dispatcher.workers if self.dispatcher else None,
            info=self.dispatcher.info if self.dispatcher else None)

    # --- setup -------------------------------------------------------------------------------

    def _load_data(self) -> None:
        data = self.spec.data
        self.train_rows = load_prompts(data.train_files, data, self.tokenizer, self.storage)
        self.val_rows = load_prompts(data.val_files, data, self.tokenizer, self.storage) if data.val_files else None
        self.sampler = EpochSampler(len(self.train_rows.rows), data.train_batch_size, data.seed, data.shuffle)
        if self.train_rows.filtered:
            log.info("Filtered %d overlong prompts (data.filterOverlongPrompts)", self.train_rows.filtered)

    def _check_storage(self) -> None:
        try:
            self.storage.check_writable(self.layout.root)
        except StorageError as exc:
            raise StorageError(f"spec.storage.uri: can't write the run's files under {self.layout.root}: "
                               f"{exc}") from None

    def _clean_leftovers(self, started: float) -> None:
        """What writers of this job killed mid-write left (temporary files, incomplete S3 uploads),
        from before this start: never read, but they take space (and S3 bills the parts)."""
        try:
            removed = self.storage.clean_leftovers(self.layout.root, before=started)
        except (StorageError, OSError) as exc:
            log.warning("Can't remove leftovers of killed writers under %s (they are never read; on S3 a bucket "
                        "lifecycle rule can abort old incomplete uploads): %s", self.layout.root, exc)
            return
        if removed:
            log.info("Removed %d leftovers of writers killed mid-write under %s: %s", len(removed), self.layout.root,
                     ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else ""))

    def _device(self) -> torch.device:
        want = self.spec.trainer.device
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def _resume(self) -> None:
        uri = checkpoint.resolve_resume(self.spec.resume, self.layout, self.storage)
        if uri is None:
            return
        extras = checkpoint.load(uri, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                 storage=self.storage, key=self.checkpoint_key, device=self.device)
        self.state.step, self.state.policy_version = extras["step"], extras["policy_version"]
        self.state.last_checkpoint = uri
        self.state.validation_score = extras.get("validation_score")
        if uri.startswith(self.layout.checkpoints + "/"):
            # This job's own checkpoint: its tracker runs go on (not another job's, with resume: <uri>).
            self.state.tracker_runs = extras.get("trackers") or {}
        if self.sampler is not None:
            pending = extras.get("pending_rollouts")
            if pending and self.spec.rollout.max_staleness and all(map(self.storage.exists, pending["uris"])):
                # The batch an uninterrupted run trains next, generated before the checkpoint.
                self.sampler.load_state_dict(pending["sampler"])
                self.prefetch.restore(self.state.step + 1, pending, extras["sampler"])
            else:
                # Its prompts are drawn again and generated on this policy.
                self.sampler.load_state_dict(extras["sampler"])
        log.info("Resumed from %s (step %d, policy version %d)", uri, self.state.step, self.state.policy_version)

    # --- weights -----------------------------------------------------------------------------

    def _ensure_worker_version(self, worker: str, version: int) -> None:
        """Bring a worker that missed a sync (restarted, or a new replica) to `version`."""
        reply = self.dispatcher.health(worker)
        if reply.ready and reply.policy_version == version:
            return
        log.info("Re-syncing rollout worker %s from version %d to %d", worker, reply.policy_version, version)
        self.publisher.resync(worker, version)

    def _workers_elsewhere(self) -> bool:
        """Whether a reachable rollout worker is not at this policy version (decided on rank 0,
        known to every rank: publishing is collective). One that is down is re-synced when it
        is back (`_ensure_worker_version`)."""
        elsewhere = False
        if self.rank == 0:
            for worker in self.dispatcher.workers():
                try:
                    reply = self.dispatcher.health(worker)
                except grpc.RpcError:
                    continue
                elsewhere |= not reply.ready or reply.policy_version != self.state.policy_version
        return broadcast_json(elsewhere, self.device)

    def _publish_weights(self, bump: bool = True) -> dict[str, float]:
        start = time.perf_counter()
        self.state.policy_version += int(bump)
        times = self.publisher.publish(self.state.policy_version)
        return {"timing_s/weight_sync": time.perf_counter() - start, **times}

    # --- the loop ----------------------------------------------------------------------------

    def train(self) -> None:
        if self.rank == 0:
            log.info("Starting GRPO training loop... (%d steps, %d per epoch, world size %d, %s)",
                     self.total_steps, self.steps_per_epoch, self.world, self.device)
        if self.state.step > 0 or self._workers_elsewhere():
            # Rollout servers may hold the initial weights (a resumed run), or a later policy (a
            # trainer restarted before its first checkpoint): this policy goes out first.
            self._publish_weights(bump=False)
        if self.spec.trainer.val_before_train and self.state.step == 0 and self.spec.data.val_files:
            score = self.validate()
            if self.rank == 0:
                self.metrics.log(0, {"val/score": score})
        bar = ProgressBar(self.total_steps, self.state.step) if self.rank == 0 else None
        while self.state.step < self.total_steps:
            if self._stop_requested():
                self.save()
                log.warning("Stopping on SIGTERM after a checkpoint at step %d", self.state.step)
                if self.rank == 0:
                    self.metrics.close(finished=False)
                raise SystemExit(143)
            self.state.step += 1
            metrics = self.train_step(self.state.step)
            last = self.state.step == self.total_steps
            freq = self.spec.trainer.test_freq
            if self.spec.data.val_files and freq != -1 and (last or (freq > 0 and self.state.step % freq == 0)):
                metrics["val/score"] = self.validate()
            save = self.spec.trainer.save_freq
            if last or (save > 0 and self.state.step % save == 0):
                metrics["timing_s/checkpoint"] = self.save()
            if self.rank == 0:
                self.metrics.log(self.state.step, metrics)
                self._write_progress(metrics)
                bar.update(metrics)
        if not self.publisher.gathered:   # no step ran here (resumed at the last step): export needs them
            self.publisher.gather()
        if self.rank == 0:
            bar.close()
            self.export_final()
            self.metrics.close()
        dist.barrier()

    def request_stop(self) -> None:
        """From a SIGTERM handler: checkpoint at the next step boundary, then exit (suspend,
        preemption, Ctrl-C of `grpo run`)."""
        self._stop = True

    def _stop_requested(self) -> bool:
        flag = torch.tensor([1.0 if getattr(self, "_stop", False) else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)   # every rank stops at the same step
        return bool(flag.item())

    def _sample_batch(self) -> tuple[int, list[PromptRow]]:
        epoch, indices = self.sampler.next_batch()
        return epoch, [self.train_rows.rows[i] for i in indices]

    def _dispatch(self, step: int, tag: str, epoch: int, rows: list[PromptRow], *, n: int,
                  temperature: float, first_index: int = 0) -> tuple[list[str], float]:
        """Rank 0: prompt shards out; rollout shard URIs (one shard per worker) and the seconds
        spent scoring them back."""
        workers = self.dispatcher.workers()
        per = -(-len(rows) // len(workers))
        shards = {}
        for k in range(0, len(rows), per):
            table = prompt_shard_table(rows[k:k + per], epoch, first_index=first_index + k)
            sink = io.BytesIO()
            pq.write_table(table, sink)
            shards[f"{tag}-shard-{k // per:03d}"] = sink.getvalue()
        r = self.spec.rollout
        sampling = pb.SamplingParams(n=n, max_tokens=self.spec.data.max_response_length, temperature=temperature,
                                     top_p=r.top_p, top_k=r.top_k)
        # No seed: each server derives one from (rollout.seed, step, shard), so shards of a step
        # draw independent samples and a re-dispatched shard draws the same ones.
        results = self.dispatcher.generate(step, tag, shards, sampling, self.state.policy_version)
        # Rewards are scored on the rollout servers, shards in parallel: the slowest shard's time.
        return [res.reply.rollout_uri for res in results], max(res.reply.reward_seconds for res in results)

    def _read_rollouts(self, uris: list[str]) -> list[batching.Sample]:
        table = pa.concat_tables([self.storage.read_table(u) for u in uris])
        return batching.samples_from_table(table)

    def _plan_rollouts(self, step: int) -> dict:
        """Rank 0: the step's prompts out, its rollout shards back (all dynamic-sampling rounds).
        Runs in the background for a prefetched step, so it returns what it measured."""
        spec = self.spec
        epoch, rows = self._sample_batch()
        # The run's length is its steps (totalSteps may outlast totalEpochs); the epoch is the
        # same 0-based count as training/epoch and the job's status.
        log.info("Step %d / %d (epoch %d): Generating rollouts for %d prompts...", step, self.total_steps,
                 epoch, len(rows))
        uris, reward_s = self._dispatch(step, "train", epoch, rows, n=spec.rollout.n,
                                        temperature=spec.rollout.temperature)
        plan = {"uris": uris, "epoch": epoch, "prompts": len(rows), "reward_s": reward_s}
        if spec.algorithm.filter_groups:
            plan.update(self._informative_groups(step, uris, len(rows), reward_s))
        plan["sampler"] = self.sampler.state_dict()   # where the next step's prompts start
        return plan

    def train_step(self, step: int) -> dict[str, float]:
        """One step of docs/ARCHITECTURE.md §1: rollouts, advantages, logprobs, update, weights."""
        spec, t = self.spec, {}
        t0 = time.perf_counter()
        # 1-2: prompts out, scored rollouts back
        samples, plan, staleness = self._rollouts(step, t)
        # 3: advantages over the whole batch, then this rank's micro-batches and their logprobs
        if self.rank == 0:
            log.info("Computing group-relative advantages...")
        advantages = batching.advantages_per_sample(samples, spec.algorithm.adv_estimator.value,
                                                    norm_adv_by_std=spec.algorithm.norm_adv_by_std,
                                                    gamma=spec.algorithm.gamma)
        minibatches = self._micro_batches(samples, advantages)
        old_logp, ref_logp = self._logprobs(minibatches, t)
        if self.rank == 0:
            log.info("Updating actor model...")
        t3 = time.perf_counter()
        result = actor.update_policy(self.model, self.optimizer, self.scheduler, spec, minibatches, old_logp,
                                     ref_logp, self.world, self.device)
        t["timing_s/update_actor"] = time.perf_counter() - t3
        # 4: new weights to every rollout worker, once the next step's generation (on these
        # weights) is done
        if self.rank == 0:
            self.prefetch.wait()
        t.update(self._publish_weights())
        t["timing_s/step"] = time.perf_counter() - t0
        metrics = self._step_metrics(samples, advantages, plan, result, t)
        metrics["rollout/staleness"] = staleness
        return {**metrics, **result.metrics, **t}

    def _rollouts(self, step: int, t: dict[str, float]) -> tuple[list[batching.Sample], dict, float]:
        """The step's samples on every rank: rank 0 dispatches (or takes the batch generated
        during the last step) and the others wait for the shard list; then, with maxStaleness 1,
        step t+1's generation starts in the background."""
        spec, t0 = self.spec, time.perf_counter()
        plan = None
        if self.rank == 0:
            try:
                plan = self.prefetch.take(step) or self._plan_rollouts(step)
            except Exception as exc:  # noqa: BLE001 - tell the other ranks before failing
                broadcast_json({"error": repr(exc)}, self.device)
                raise
        plan = broadcast_json(plan, self.device)
        if "error" in plan:
            raise RuntimeError(f"rank 0 failed: {plan['error']}")
        # Prefetched: the time the trainer waited for the batch (before the last publish), not
        # the generation's; that one is timing_s/generate_overlapped.
        t["timing_s/rollout"] = time.perf_counter() - t0 + plan.get("waited_s", 0.0)
        if "generate_s" in plan:
            t["timing_s/generate_overlapped"] = plan["generate_s"]
        t["timing_s/reward"] = plan["reward_s"]       # part of the rollout time (scored as generated)
        samples = self._read_rollouts(plan["uris"])
        if "keep" in plan:
            samples = batching.keep_prompts(samples, plan["keep"])
        batching.check_complete(samples, spec.data.train_batch_size, spec.rollout.n)
        staleness = batching.check_staleness(samples, self.state.policy_version, spec.rollout.max_staleness)
        if self.rank == 0 and spec.rollout.max_staleness and step < self.total_steps:
            # Step t+1 generates on this policy while this step trains; one update behind.
            self.prefetch.start(step + 1, lambda: self._plan_rollouts(step + 1), self.sampler.state_dict())
        if self.rank == 0:
            log.info("Got %d responses (%d×%d), computing rewards...", len(samples), plan["prompts"], spec.rollout.n)
        return samples, plan, staleness

    def _logprobs(self, minibatches, t: dict[str, float]) -> tuple[dict, dict | None]:
        """Old logprobs (the PPO ratio's denominator) and reference logprobs (the KL loss), by
        id(micro-batch). Old ones are computed only when an update is off-policy; missing ones
        mean the current logprobs, detached (ratio 1)."""
        spec = self.spec
        flat = [mb for mbs in minibatches for mb in mbs]
        old_logp, t["timing_s/old_log_prob"] = {}, 0.0    # 0: no forward pass (perf/mfu counts them)
        if spec.rollout.max_staleness:
            # The samples may come from the policy before the last update: the ratio is taken
            # against the policy that generated them, as the engine scored each token.
            old_logp = {id(mb): mb.behaviour_logprobs for mb in flat}
        elif spec.trainer.ppo_epochs > 1 or len(minibatches) > 1:   # off-policy updates need them
            t1 = time.perf_counter()
            self.model.eval()
            old_logp = dict(zip(map(id, flat), actor.compute_logprobs(self.model, flat, spec.rollout.temperature)))
            t["timing_s/old_log_prob"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        ref_logp = (dict(zip(map(id, flat), actor.compute_logprobs(self.ref, flat, spec.rollout.temperature)))
                    if self.ref is not None else None)
        t["timing_s/ref"] = time.perf_counter() - t2
        return old_logp, ref_logp

    def _informative_groups(self, step: int, uris: list[str], generated: int, reward_s: float) -> dict:
        """DAPO dynamic sampling (rank 0): drop groups whose rewards are all equal (their GRPO
        advantage is 0) and generate more prompts until trainBatchSize informative groups are
        found, at most MAX_GENERATION_ROUNDS rounds; then top up with uninformative ones."""
        spec, batch = self.spec, self.spec.data.train_batch_size
        informative, other = [], []
        rewards: dict[int, set[float]] = {}
        new_uris = uris
        for round_ in range(MAX_GENERATION_ROUNDS):
            if round_:
                epoch, rows = self._sample_batch()
                new_uris, round_reward_s = self._dispatch(step, f"train-r{round_}", epoch, rows, n=spec.rollout.n,
                                                          temperature=spec.rollout.temperature, first_index=generated)
                uris = uris + new_uris
                generated += len(rows)
                reward_s += round_reward_s          # the rounds run one after another
            for s in self._read_rollouts(new_uris):     # only this round's shards
                rewards.setdefault(s.prompt_index, set()).add(s.reward)
            informative = sorted(p for p, r in rewards.items() if len(r) > 1)
            other = sorted(p for p, r in rewards.items() if len(r) == 1)
            if len(informative) >= batch:
                break
        if len(informative) < batch:
            log.warning("Dynamic sampling: %d informative groups after %d rounds; topping up with groups "
                        "whose rewards are all equal", len(informative), MAX_GENERATION_ROUNDS)
        keep = sorted((informative + other)[:batch])
        return {"uris": uris, "keep": keep, "prompts": generated, "filtered_groups": generated - len(informative),
                "reward_s": reward_s}

    def _micro_batches(self, samples, advantages) -> list[list[batching.MicroBatch]]:
        spec, n = self.spec, self.spec.rollout.n
        per_mini = spec.trainer.mini_batch_size * n
        out = []
        for start in range(0, len(samples), per_mini):
            share = batching.rank_share(list(range(start, start + per_mini)), self.rank, self.world)
            groups = batching.micro_batches(share, samples, max_count=spec.trainer.micro_batch_size_per_gpu,
                                            max_tokens=spec.trainer.max_tokens_per_gpu)
            out.append([batching.collate(g, samples, advantages, self.tokenizer.pad_token_id, self.device)
                        for g in groups])
        return out

    def _step_metrics(self, samples, advantages, plan, result, t) -> dict[str, float]:
        rewards = [s.reward for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        adv = torch.cat(advantages)
        tokens = sum(s.length for s in samples)
        self.state.reward_mean = statistics.fmean(rewards)
        m = {
            "training/step": self.state.step, "training/epoch": plan["epoch"],
            "training/policy_version": self.state.policy_version,
            "critic/score/mean": self.state.reward_mean, "critic/rewards/mean": self.state.reward_mean,
            "critic/score/max": max(rewards), "critic/score/min": min(rewards),
            "critic/advantages/mean": float(adv.mean()), "critic/advantages/std": float(adv.std()) if len(adv) > 1 else 0.0,
            "response_length/mean": statistics.fmean(lengths), "response_length/max": max(lengths),
            "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "prompt_length/mean": statistics.fmean(len(s.prompt_ids) for s in samples),
            "perf/total_num_tokens": tokens,
            "perf/throughput": tokens / t["timing_s/step"] / self.world,
        }
        if self.dispatcher is not None:
            m["rollout/redispatched_shards"] = self.dispatcher.redispatched
        if "filtered_groups" in plan:
            m["rollout/filtered_groups"] = plan["filtered_groups"]
        peak = self._peak_flops()
        if peak:
            train_time = t["timing_s/update_actor"] + t["timing_s/ref"] + t["timing_s/old_log_prob"]
            passes = 3 * self.spec.trainer.ppo_epochs + (1 if self.ref is not None else 0) + \
                (1 if t["timing_s/old_log_prob"] > 0 else 0)
            m["perf/mfu"] = 2 * self.n_params * tokens * passes / train_time / (peak * self.world)
        return m

    def _peak_flops(self) -> float | None:
        if "GRPO_PEAK_FLOPS" in os.environ:
            return float(os.environ["GRPO_PEAK_FLOPS"])
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        return next((v for k, v in _PEAK_FLOPS.items() if k in name), None)

    # --- validation, checkpoints, export --------------------------------------------------------

    def validate(self) -> float | None:
        score = None
        if self.rank == 0 and self.val_rows is not None:
            rows = self.val_rows.rows
            size = self.spec.data.val_batch_size or len(rows)
            uris = []
            for k in range(0, len(rows), size):
                uris += self._dispatch(self.state.step, f"val{k // size}", 0, rows[k:k + size], n=1,
                                       temperature=self.spec.rollout.val_temperature)[0]
            samples = self._read_rollouts(uris)
            score = statistics.fmean(s.reward for s in samples)
            epoch = self.sampler.epoch if self.sampler else 0
            log.info("Validation accuracy: %.1f%% (epoch %d)", 100 * score, epoch)
            self.state.validation_score = score
        dist.barrier()
        return score

    def save(self) -> float:
        start = time.perf_counter()
        uri = self.layout.checkpoint(self.state.step)
        # With a prefetched batch: the sampler before it was drawn, and the batch (rank 0's).
        sampler, pending = broadcast_json(list(self.prefetch.checkpoint_state(self.sampler.state_dict()))
                                          if self.sampler else [None, None], self.device)
        state = {"step": self.state.step, "policy_version": self.state.policy_version,
                 "sampler": sampler, "pending_rollouts": pending,
                 "validation_score": self.state.validation_score,
                 "trackers": self.metrics.tracker_runs() if self.metrics else {},
                 "model": self.spec.model.model_dump(mode="json", by_alias=True)}
        checkpoint.save(uri, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                        trainer_state=state, storage=self.storage, keep=self.spec.trainer.keep_checkpoints,
                        layout=self.layout, key=self.checkpoint_key, device=self.device)
        self.state.last_checkpoint = uri
        if self.rank == 0:
            log.info("Saved checkpoint to %s", uri)
        return time.perf_counter() - start

    def export_final(self) -> None:
        from grpo_trainer.export import save_hf
        uri = self.layout.hf_export(self.state.step)
        save_hf(self.publisher.cpu_state_dict(), self.model_spec, uri, self.storage)
        log.info("Exported the final policy to %s", uri)

    def _write_progress(self, metrics: dict[str, float]) -> None:
        self.metrics.write_progress({
            "step": self.state.step, "totalSteps": self.total_steps, "epoch": metrics.get("training/epoch", 0),
            "policyVersion": self.state.policy_version, "rewardMean": self.state.reward_mean,
            "validationScore": self.state.validation_score, "lastCheckpoint": self.state.last_checkpoint,
            "tokensPerSecond": metrics.get("perf/throughput"), "updatedAt": time.time(),
        })
