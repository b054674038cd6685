"""Steps 1-2 of docs/ARCHITECTURE.md §1, the trainer's side: one step's rollouts, as a
`RolloutBatch`, on every rank.

`RolloutSource` owns all of it: the datasets and the epoch sampler (rank 0), prompt shards out
and rollout shards back (the dispatcher), DAPO's dynamic-sampling rounds, reading and checking
the samples on every rank, and with `rollout.maxStaleness: 1` the next step's batch generated in
the background while this one trains (`Prefetch`). It also makes the one off-policy decision:
in that mode a batch may come from the policy one update behind, so every batch's PPO ratio is
taken against the engine's log-probs (`RolloutBatch.off_policy`); and whether the engines report
those log-probs at all (`engine_logprobs_needed`).

A batch generated ahead is part of a checkpoint (`state_dict`): where the sampler stood before
it was drawn, and the batch (its shards are in storage), so a resumed run trains on exactly the
batch an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.records import RunLayout
from grpo_api.spec import GRPOJobSpec, ModelSpec
from grpo_api.storage import Storage, StorageError
from grpo_trainer import batch as batching
from grpo_trainer import retention
from grpo_trainer.collectives import from_rank0
from grpo_trainer.data import DataError, Datasets, PromptRow, image_store, load_datasets, prompt_shard_table
from grpo_trainer.engine_sleep import EngineSleep
from grpo_trainer.lease import LeaseHeld, RunLease
from grpo_trainer.reward_checks import RewardFailureCheck
from grpo_trainer.rollout_client import RolloutDispatcher, RolloutRefused, VersionKeeper
from grpo_trainer.rollout_history import AcceptedRollouts, format_ranges, spec_digest, step_ranges
from grpo_trainer.rollout_servers import RolloutServers
from grpo_trainer.state import RolloutsState, RunState

log = logging.getLogger("grpo.trainer")

# DAPO dynamic sampling: generation rounds per step before topping up (verl: max_num_gen_batches).
MAX_GENERATION_ROUNDS = 10


@dataclass
class RolloutBatch:
    """One step's rollouts: what was generated, by which policy, for which prompts, in how long.
    Its JSON form is what rank 0 broadcasts and what a checkpoint keeps of a batch generated ahead."""

    step: int
    epoch: int
    policy_version: int                 # of the weights that generated it
    uris: list[str]                     # rollout shards; together every generated prompt exactly once
    prompts: int                        # prompts generated, over every round
    sampler_before: dict                # the sampler before this batch's prompts were drawn
    sampler_after: dict | None = None   # ... and after (where the next batch starts)
    off_policy: bool = False            # the ratio's old policy is the engine's (behaviour log-probs)
    rounds: int = 1                     # generation rounds (dynamic sampling)
    keep: list[int] | None = None       # dynamic sampling: the prompts trained on
    filtered_groups: int | None = None  # dynamic sampling: generated groups with all-equal rewards
    reward_s: float = 0.0               # scoring, part of the generation (the slowest shard, per round)
    generate_s: float | None = None     # generated in the background: how long that took
    waited_s: float = 0.0               # how long the trainer waited for the batch
    staleness: float = 0.0              # mean policy updates between generation and training

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RolloutBatch:
        return cls(**data)

    @classmethod
    def from_checkpoint(cls, pending: dict, state: RolloutsState, run: RunState) -> RolloutBatch:
        """A pending batch as a checkpoint keeps it. Checkpoints written before this class kept a
        plain dict (no step, version or sampler_before; `sampler` is the sampler after)."""
        if "sampler_after" in pending:
            return cls.from_json(pending)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in pending.items() if k in known}, step=run.step + 1,
                   policy_version=run.policy_version - 1, sampler_before=state.sampler,
                   sampler_after=pending["sampler"], off_policy=True)

    def timings(self) -> dict[str, float]:
        # Prefetched: timing_s/rollout is the wait for the batch, its generation is generate_overlapped.
        out = {"timing_s/rollout": self.waited_s, "timing_s/reward": self.reward_s}
        if self.generate_s is not None:
            out["timing_s/generate_overlapped"] = self.generate_s
        return out


class Prefetch:
    """Step t+1's batch, generated in a background thread while step t trains (rank 0).

    `wait` is called before step t's new weights are published: the weights must not change
    under a generation (the servers would refuse a request for a version they no longer hold),
    and this way the dispatcher and the weight publisher are never used by two threads at once.
    So between steps nothing is in flight, and validation, checkpoints and a SIGTERM stop see at
    most one finished batch."""

    def __init__(self):
        self._step: int | None = None
        self._thread: threading.Thread | None = None
        self._batch: RolloutBatch | None = None
        self._error: BaseException | None = None
        self._sampler_before: dict | None = None
        self._waited = 0.0

    def start(self, step: int, generate: Callable[[], RolloutBatch], sampler_before: dict) -> None:
        """Run `generate()` (step `step`'s batch) in the background. `sampler_before`: the
        sampler before it draws its prompts (what a checkpoint records if it fails)."""
        if self._step is not None:
            raise RuntimeError(f"rollouts of step {self._step} are still pending")
        self._step, self._batch, self._error, self._waited = step, None, None, 0.0
        self._sampler_before = sampler_before

        def run() -> None:
            start = time.perf_counter()
            try:
                self._batch = generate()
                self._batch.generate_s = time.perf_counter() - start
            except BaseException as exc:  # noqa: BLE001 - raised in the trainer's thread by `take`
                self._error = exc

        # A daemon: a trainer that fails mid-step exits without waiting for the generation.
        self._thread = threading.Thread(target=run, name=f"rollout-prefetch-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the background generation is done (its error, if any, is raised by `take`)."""
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.join()
            self._thread = None
            self._waited = time.perf_counter() - start

    def take(self, step: int) -> RolloutBatch | None:
        """Step `step`'s batch, its `waited_s` set, or None when none was generated ahead."""
        if self._step is None:
            return None
        if self._step != step:
            raise RuntimeError(f"prefetched rollouts are for step {self._step}, not {step}")
        self.wait()
        batch, error = self._batch, self._error
        self._step = self._batch = self._error = self._sampler_before = None
        if error is not None:
            raise error
        batch.waited_s = self._waited
        return batch

    def restore(self, batch: RolloutBatch) -> None:
        """A finished batch from a checkpoint."""
        self._step, self._batch, self._error, self._waited = batch.step, batch, None, 0.0
        self._sampler_before = batch.sampler_before

    def checkpoint_state(self, sampler_now: dict) -> tuple[dict, RolloutBatch | None]:
        """(the sampler before any pending batch, the pending batch or None). A failed batch is
        not kept: a resumed run draws the same prompts again and generates them."""
        if self._step is None:
            return sampler_now, None
        if self._thread is not None:
            raise RuntimeError("a checkpoint while rollouts are being generated")
        return self._sampler_before, self._batch if self._error is None else None


def prepare(spec: GRPOJobSpec, tokenizer, storage: Storage, layout: RunLayout, *, started: float,
            device: torch.device, servers: RolloutServers | None = None,
            job_uid: str | None = None, model_spec: ModelSpec | None = None) -> tuple[Datasets | None, int]:
    """Collective, before any model is built: rank 0 reads the datasets, checks that the run's
    storage can be written and takes the run's lease (RunLease: one trainer at a time writes a run,
    not a second `grpo run` beside an orphaned rank), so bad data or storage or
    another trainer of the run fails now (a SetupError on every rank); it removes what writers
    killed mid-write left. With the tool agent loop, a tool agent's prompt is
    measured with the tools the rollout servers render it with (rank 0 asks `servers` for them).
    A VL `model_spec` (the local copy of spec.model) renders the rows' images and stores them in
    the run (data.ImageStore). Returns (the datasets on rank 0, batches per epoch)."""
    datasets = None

    def load() -> int:
        nonlocal datasets
        mt = spec.rollout.multi_turn
        tools = servers.tool_schemas() if servers is not None and mt.enable else None
        datasets = load_datasets(spec.data, tokenizer, storage, tool_schemas=tools,
                                 images=image_store(model_spec or spec.model, tokenizer, storage, layout,
                                                     patch_size=spec.data.image_patch_size),
                                 reward=spec.reward)
        try:
            storage.check_writable(layout.root)
        except StorageError as exc:
            raise StorageError(f"spec.storage.uri: can't write the run's files under {layout.root}: {exc}") from None
        # before anything else is written (or cleaned) in the run; renewed until the trainer exits
        RunLease(storage, layout.lease, job_uid=job_uid).acquire()
        _clean_leftovers(storage, layout, started)
        # colocated: the engines give the GPUs' memory to the models every rank is about to build
        # (the first weight sync or Generate wakes them)
        EngineSleep(spec, servers, rank=0).sleep()
        return datasets.sampler.batches_per_epoch

    batches_per_epoch = from_rank0(load, device, setup_errors=(DataError, StorageError, LeaseHeld))
    return datasets, batches_per_epoch


def _clean_leftovers(storage: Storage, layout: RunLayout, started: float) -> None:
    """What writers of this job killed mid-write left (temporary files, incomplete S3 uploads),
    from before this start: never read, but they take space (and S3 bills the parts)."""
    try:
        removed = storage.clean_leftovers(layout.root, before=started)
    except (StorageError, OSError) as exc:
        log.warning("Can't remove leftovers of killed writers under %s (they are never read; on S3 a bucket "
                    "lifecycle rule can abort old incomplete uploads): %s", layout.root, exc)
        return
    if removed:
        log.info("Removed %d leftovers of writers killed mid-write under %s: %s", len(removed), layout.root,
                 ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else ""))


def engine_logprobs_needed(spec: GRPOJobSpec) -> bool:
    """Whether the rollout servers report each sampled token's behaviour log-prob: what the
    actor reads of them (Actor._logprobs, _correct_for_the_rollout) is the old policy of an
    off-policy step (maxStaleness 1) or of rollout correction's bypass mode, and the ratio
    decoupled rollout correction weighs or rejects tokens by. An on-policy step takes its own
    log-probs as the old policy, so the engine skips them (vLLM: ~0.6 s of a 4.4 s generation)
    unless rollout.calculateLogProbs keeps them for the records."""
    return (spec.rollout.max_staleness > 0 or spec.algorithm.rollout_correction is not None
            or spec.rollout.calculate_log_probs)


class RolloutSource:
    def __init__(self, spec: GRPOJobSpec, *, datasets: Datasets | None, dispatcher: RolloutDispatcher | None,
                 storage: Storage, total_steps: int, device: torch.device, engines: EngineSleep | None = None):
        """datasets, dispatcher: rank 0's (None on the other ranks); engines: the colocated servers'
        sleep and wake (grpo_trainer.engine_sleep)."""
        self.spec, self.datasets, self.dispatcher, self.storage = spec, datasets, dispatcher, storage
        self.engines = engines or EngineSleep(spec, None, rank=0)
        self.total_steps, self.device = total_steps, device
        self.rank0 = dispatcher is not None
        self.off_policy = spec.rollout.max_staleness > 0
        self.engine_logprobs = engine_logprobs_needed(spec)
        self._ahead = Prefetch()
        self.reward_check = RewardFailureCheck(spec.reward.max_error_fraction, say=self.rank0)
        # The spec's digest, as each step's record names it (`grpo replay` finds the spec a step
        # was trained under by it).
        self.spec_sha256 = spec_digest(spec.model_dump(mode="json", by_alias=True))

    @classmethod
    def connect(cls, spec: GRPOJobSpec, *, servers: RolloutServers | None, weights: VersionKeeper, layout: RunLayout,
                storage: Storage, **kwargs) -> RolloutSource:
        """With rank 0's clients of the servers (None on the other ranks): their dispatcher, which
        has `weights` (the weight publisher) bring a server to the policy version before it generates."""
        dispatcher = RolloutDispatcher(servers, weights=weights, layout=layout, storage=storage,
                                       timeout=spec.rollout.request_timeout_seconds) if servers else None
        return cls(spec, dispatcher=dispatcher, storage=storage, engines=EngineSleep(spec, servers, rank=0), **kwargs)

    def sleep_engines(self) -> dict[str, float]:
        """Colocated and on-policy: the servers' engines free the GPUs for the update (timing_s/sleep)."""
        return self.engines.sleep()

    def wake_engines(self, parts: tuple[str, ...] = ()) -> dict[str, float]:
        """Collective: the engines take the GPUs back (`parts` of them; all when empty) before the new
        weights reach them (timing_s/wake)."""
        return self.engines.wake(parts)

    # --- every rank ---------------------------------------------------------------------------

    def next(self, step: int, version: int) -> tuple[RolloutBatch, list[batching.Sample]]:
        """Collective: step `step`'s batch and its samples, trained by policy `version`. Rank 0
        takes the batch generated ahead or generates it now; then, with maxStaleness 1, starts
        step `step`+1's generation on this policy (one update behind when it trains)."""
        t0 = time.perf_counter()
        batch = RolloutBatch.from_json(from_rank0(
            lambda: (self._ahead.take(step) or self._generate_batch(step, version)).to_json(), self.device,
            setup_errors=(RolloutRefused,)))      # every rank stops with the server's message
        batch.waited_s += time.perf_counter() - t0
        samples = self.read(batch.uris)
        self.reward_check.check(step, samples)    # every sample generated, before dynamic sampling's choice
        if batch.keep is not None:
            samples = batching.keep_prompts(samples, batch.keep)
        rollout = self.spec.rollout
        batching.check_complete(samples, self.spec.data.train_batch_size, rollout.n)
        batch.staleness = batching.check_staleness(samples, version, rollout.max_staleness)
        if self.rank0 and self.off_policy and step < self.total_steps:
            self._ahead.start(step + 1, lambda: self._generate_batch(step + 1, version),
                              self.datasets.sampler.state_dict())
        if self.rank0:
            log.info("Got %d responses (%d×%d), computing rewards...", len(samples), batch.prompts, rollout.n)
        return batch, samples

    def settle(self) -> None:
        """Before the weights change: wait for the batch being generated on them (rank 0)."""
        self._ahead.wait()

    def read(self, uris: list[str]) -> list[batching.Sample]:
        # A VL model's images: each distinct one read once (a prompt's n samples name the same ones).
        return batching.samples_from_table(pa.concat_tables([self.storage.read_table(u) for u in uris]),
                                           read_image=functools.cache(self.storage.read_bytes))

    # --- rank 0 -------------------------------------------------------------------------------

    def record_accepted(self, step: int, batch: RolloutBatch, *, world: int) -> None:
        """Which rollout shards step `step` trains on, beside them (before the update): export and
        replay read these, never a guess from the attempt numbers (a restart counts them anew)."""
        record = AcceptedRollouts(step=step, shards=[uri.rsplit("/", 1)[-1] for uri in batch.uris], keep=batch.keep,
                                  off_policy=batch.off_policy, world_size=world, spec_sha256=self.spec_sha256)
        self.storage.write_bytes(self.dispatcher.layout.accepted_rollouts(step), record.to_json())

    def prune(self, step: int, *, checkpoints: Callable[[], list[int]]) -> None:
        """storage.keepRolloutsSteps: the rollouts of older steps go, once step `step` is logged;
        `checkpoints()`: the steps of the run's complete checkpoints (theirs stay)."""
        if (keep := self.spec.storage.keep_rollouts_steps) is None:
            return
        if deleted := retention.prune_rollouts(self.dispatcher.layout, self.storage, step=step, keep=keep,
                                               checkpoints=checkpoints()):
            log.info("storage.keepRolloutsSteps %d: deleted the rollouts of steps %s", keep,
                     format_ranges(step_ranges(deleted)))

    @property
    def epoch(self) -> int:
        return self.datasets.sampler.epoch

    def metrics(self) -> dict[str, float]:
        return {"rollout/redispatched_shards": self.dispatcher.redispatched} if self.rank0 else {}

    def state_dict(self) -> RolloutsState:
        """For the checkpoint: the sampler (before any batch generated ahead) and that batch."""
        if not self.rank0:
            return RolloutsState()
        sampler, pending = self._ahead.checkpoint_state(self.datasets.sampler.state_dict())
        return RolloutsState(sampler=sampler, pending_rollouts=pending.to_json() if pending else None)

    def load_state_dict(self, state: RolloutsState, run: RunState) -> None:
        """`run`: the trainer's part (a pending batch of an old checkpoint is placed by its step)."""
        if not self.rank0:
            return
        pending = state.pending_rollouts
        if pending and self.off_policy and all(map(self.storage.exists, pending["uris"])):
            # The batch an uninterrupted run trains next, generated before the checkpoint.
            batch = RolloutBatch.from_checkpoint(pending, state, run)
            self.datasets.sampler.load_state_dict(batch.sampler_after)
            self._ahead.restore(batch)
        else:
            # Its prompts are drawn again and generated on this policy.
            self.datasets.sampler.load_state_dict(state.sampler)

    def generate(self, step: int, tag: str, epoch: int, rows: list[PromptRow], *, n: int, temperature: float,
                 version: int, first_index: int = 0) -> tuple[list[str], float]:
        """Prompt shards out (one per server); the rollout shard URIs and the seconds spent
        scoring them back."""
        workers = self.dispatcher.servers.addresses()
        per = -(-len(rows) // len(workers))
        shards = {}
        for k in range(0, len(rows), per):
            sink = io.BytesIO()
            pq.write_table(prompt_shard_table(rows[k:k + per], epoch, first_index=first_index + k), sink)
            shards[f"{tag}-shard-{k // per:03d}"] = sink.getvalue()
        r = self.spec.rollout
        sampling = pb.SamplingParams(n=n, max_tokens=self.spec.data.max_response_length, temperature=temperature,
                                     top_p=r.top_p, top_k=r.top_k, logprobs=self.engine_logprobs)
        # No seed: each server derives one from (rollout.seed, step, shard), so shards of a step
        # draw independent samples and a re-dispatched shard draws the same ones.
        results = self.dispatcher.generate(step, tag, shards, sampling, version)
        # Rewards are scored on the rollout servers, shards in parallel: the slowest shard's time.
        return [res.reply.rollout_uri for res in results], max(res.reply.reward_seconds for res in results)

    def _draw(self) -> tuple[int, list[PromptRow]]:
        epoch, indices = self.datasets.sampler.next_batch()
        return epoch, [self.datasets.train.rows[i] for i in indices]

    def _generate_batch(self, step: int, version: int) -> RolloutBatch:
        """The step's prompts out, its rollout shards back (every dynamic-sampling round). Runs in
        the background for a batch generated ahead."""
        sampler_before = self.datasets.sampler.state_dict()
        epoch, rows = self._draw()
        # The run's length is its steps (totalSteps may outlast totalEpochs); the epoch is the
        # same 0-based count as training/epoch and the job's status.
        log.info("Step %d / %d (epoch %d): Generating rollouts for %d prompts...", step, self.total_steps,
                 epoch, len(rows))
        uris, reward_s = self.generate(step, "train", epoch, rows, n=self.spec.rollout.n,
                                       temperature=self.spec.rollout.temperature, version=version)
        batch = RolloutBatch(step=step, epoch=epoch, policy_version=version, uris=uris, prompts=len(rows),
                             sampler_before=sampler_before, off_policy=self.off_policy, reward_s=reward_s)
        if self.spec.algorithm.filter_groups:
            self._keep_informative_groups(batch)
        batch.sampler_after = self.datasets.sampler.state_dict()
        return batch

    def _keep_informative_groups(self, batch: RolloutBatch) -> None:
        """DAPO dynamic sampling: drop groups whose rewards are all equal (their GRPO advantage
        is 0) and generate more prompts until trainBatchSize informative groups are found, at
        most MAX_GENERATION_ROUNDS rounds; then top up with uninformative ones."""
        size = self.spec.data.train_batch_size
        rewards: dict[int, set[float]] = {}
        new_uris = batch.uris
        while True:
            round_samples = self.read(new_uris)     # only this round's shards
            for s in round_samples:
                rewards.setdefault(s.prompt_index, set()).add(s.reward)
            informative = sorted(p for p, r in rewards.items() if len(r) > 1)
            if len(informative) >= size or batch.rounds == MAX_GENERATION_ROUNDS:
                break
            if self.reward_check.exceeded(round_samples):
                break       # a broken reward function: `next` stops the run, no more rounds of zeros
            epoch, rows = self._draw()
            new_uris, reward_s = self.generate(batch.step, f"train-r{batch.rounds}", epoch, rows,
                                               n=self.spec.rollout.n, temperature=self.spec.rollout.temperature,
                                               version=batch.policy_version, first_index=batch.prompts)
            batch.uris, batch.prompts, batch.rounds = batch.uris + new_uris, batch.prompts + len(rows), batch.rounds + 1
            batch.reward_s += reward_s          # the rounds run one after another
        if len(informative) < size:
            log.warning("Dynamic sampling: %d informative groups after %d rounds; topping up with groups "
                        "whose rewards are all equal", len(informative), MAX_GENERATION_ROUNDS)
        other = sorted(p for p, r in rewards.items() if len(r) == 1)
        batch.keep = sorted((informative + other)[:size])
        batch.filtered_groups = batch.prompts - len(informative)
