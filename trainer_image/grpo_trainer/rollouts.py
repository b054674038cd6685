"""Steps 1-2 of docs/ARCHITECTURE.md §1, the trainer's side: one step's rollouts, as a
`RolloutBatch`, on every rank.

`RolloutSource` owns all of it: the datasets and the epoch sampler (rank 0), prompt shards out
and rollout shards back (the dispatcher), DAPO's dynamic-sampling rounds, reading and checking
the samples on every rank, and with `rollout.maxStaleness: 1` the next step's batch generated in
the background while this one trains (`Prefetch`). It also makes the one off-policy decision:
in that mode a batch may come from the policy one update behind, so every batch's PPO ratio is
taken against the engine's log-probs (`RolloutBatch.off_policy`).

A batch generated ahead is part of a checkpoint (`state_dict`): where the sampler stood before
it was drawn, and the batch (its shards are in storage), so a resumed run trains on exactly the
batch an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
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
from grpo_api.spec import GRPOJobSpec
from grpo_api.storage import Storage, StorageError
from grpo_trainer import batch as batching
from grpo_trainer.collectives import from_rank0
from grpo_trainer.data import DataError, Datasets, PromptRow, load_datasets, prompt_shard_table
from grpo_trainer.rollout_client import RolloutDispatcher, RolloutServers

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
    def from_checkpoint(cls, pending: dict, trainer_state: dict) -> RolloutBatch:
        """A pending batch as a checkpoint keeps it. Checkpoints written before this class kept a
        plain dict (no step, version or sampler_before; `sampler` is the sampler after)."""
        if "sampler_after" in pending:
            return cls.from_json(pending)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in pending.items() if k in known}, step=trainer_state["step"] + 1,
                   policy_version=trainer_state["policy_version"] - 1, sampler_before=trainer_state["sampler"],
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
            device: torch.device, servers: RolloutServers | None = None) -> tuple[Datasets | None, int]:
    """Collective, before any model is built: rank 0 reads the datasets and checks that the run's
    storage can be written, so bad data or storage fails now (a SetupError on every rank); it
    removes what writers killed mid-write left. With the tool agent loop, a tool agent's prompt is
    measured with the tools the rollout servers render it with (rank 0 asks `servers` for them).
    Returns (the datasets on rank 0, batches per epoch)."""
    datasets = None

    def load() -> int:
        nonlocal datasets
        mt = spec.rollout.multi_turn
        tools = servers.tool_schemas() if servers is not None and mt.enable else None
        datasets = load_datasets(spec.data, tokenizer, storage, tool_schemas=tools)
        try:
            storage.check_writable(layout.root)
        except StorageError as exc:
            raise StorageError(f"spec.storage.uri: can't write the run's files under {layout.root}: {exc}") from None
        _clean_leftovers(storage, layout, started)
        return datasets.sampler.batches_per_epoch

    batches_per_epoch = from_rank0(load, device, setup_errors=(DataError, StorageError))
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


class RolloutSource:
    def __init__(self, spec: GRPOJobSpec, *, datasets: Datasets | None, dispatcher: RolloutDispatcher | None,
                 storage: Storage, total_steps: int, device: torch.device):
        """datasets, dispatcher: rank 0's (None on the other ranks)."""
        self.spec, self.datasets, self.dispatcher, self.storage = spec, datasets, dispatcher, storage
        self.total_steps, self.device = total_steps, device
        self.rank0 = dispatcher is not None
        self.off_policy = spec.rollout.max_staleness > 0
        self._ahead = Prefetch()

    # --- every rank ---------------------------------------------------------------------------

    def next(self, step: int, version: int) -> tuple[RolloutBatch, list[batching.Sample]]:
        """Collective: step `step`'s batch and its samples, trained by policy `version`. Rank 0
        takes the batch generated ahead or generates it now; then, with maxStaleness 1, starts
        step `step`+1's generation on this policy (one update behind when it trains)."""
        t0 = time.perf_counter()
        batch = RolloutBatch.from_json(from_rank0(
            lambda: (self._ahead.take(step) or self._generate_batch(step, version)).to_json(), self.device))
        batch.waited_s += time.perf_counter() - t0
        samples = self.read(batch.uris)
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
        return batching.samples_from_table(pa.concat_tables([self.storage.read_table(u) for u in uris]))

    # --- rank 0 -------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.datasets.sampler.epoch

    def metrics(self) -> dict[str, float]:
        return {"rollout/redispatched_shards": self.dispatcher.redispatched} if self.rank0 else {}

    def state_dict(self) -> dict:
        """For the checkpoint: the sampler (before any batch generated ahead) and that batch."""
        if not self.rank0:
            return {}
        sampler, pending = self._ahead.checkpoint_state(self.datasets.sampler.state_dict())
        return {"sampler": sampler, "pending_rollouts": pending.to_json() if pending else None}

    def load_state_dict(self, trainer_state: dict) -> None:
        if not self.rank0:
            return
        pending = trainer_state.get("pending_rollouts")
        if pending and self.off_policy and all(map(self.storage.exists, pending["uris"])):
            # The batch an uninterrupted run trains next, generated before the checkpoint.
            batch = RolloutBatch.from_checkpoint(pending, trainer_state)
            self.datasets.sampler.load_state_dict(batch.sampler_after)
            self._ahead.restore(batch)
        else:
            # Its prompts are drawn again and generated on this policy.
            self.datasets.sampler.load_state_dict(trainer_state["sampler"])

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
                                     top_p=r.top_p, top_k=r.top_k)
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
            for s in self.read(new_uris):     # only this round's shards
                rewards.setdefault(s.prompt_index, set()).add(s.reward)
            informative = sorted(p for p, r in rewards.items() if len(r) > 1)
            if len(informative) >= size or batch.rounds == MAX_GENERATION_ROUNDS:
                break
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
