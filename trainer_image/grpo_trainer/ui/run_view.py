"""What `grpo ui` shows of a run, read from its storage (grpo_trainer.rollout_history, as `grpo rollouts
export` reads it): the curves from metrics.jsonl, the steps from the rollouts/ folder listing, one
step's groups from that step's accepted shards only, one prompt across a window of steps.

A page reads only the shards it shows: a step page one step's, the prompt page those of its
window (`PROMPT_WINDOW` steps by default). Nothing is written to the run.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from threading import Lock

import pyarrow as pa

from grpo_api.images import IMAGE_NAME, image_name
from grpo_trainer.rollout_history import RolloutHistory, export_table
from grpo_trainer.state import FILE as STATE_FILE
from grpo_trainer.state import TrainerState

# (title, metrics.jsonl names) of the overview's charts, under verl's names (grpo_trainer.metrics).
# The mean reward has a chart of its own: on one axis with the max and min (often 1 and 0) its
# movement, the one that matters, was a flat line.
PANELS = [
    ("Reward", ["critic/score/mean"]),
    ("Reward range", ["critic/score/max", "critic/score/min"]),
    ("Validation", ["val/score"]),
    ("KL", ["actor/kl_loss", "actor/ppo_kl", "actor/reward_kl_penalty"]),
    ("Entropy", ["actor/entropy"]),
    ("Response length", ["response_length/mean", "response_length/max"]),
    ("Step time (s)", ["timing_s/step", "timing_s/rollout", "timing_s/update_actor"]),
]
PROMPT_WINDOW = 20        # steps the prompt page reads by default
GROUPS_PER_PAGE = 20


@dataclass
class ViewFilters:
    """The step and prompt pages' filters, on samples; a group shows its samples that pass."""
    min_reward: float | None = None
    max_reward: float | None = None
    data_source: str | None = None
    text: str | None = None           # case-insensitive, in the prompt or the response

    def passes(self, s: Sample, prompt_text: str) -> bool:
        if self.min_reward is not None and not s.reward >= self.min_reward:
            return False
        if self.max_reward is not None and not s.reward <= self.max_reward:
            return False
        if self.data_source and s.data_source != self.data_source:
            return False
        if self.text:
            needle = self.text.lower()
            return needle in s.text.lower() or needle in prompt_text.lower()
        return True


@dataclass
class Sample:
    sample_index: int
    reward: float
    advantage: float | None
    length: int
    finish_reason: str
    policy_version: int
    worker: str
    data_source: str
    text: str
    response_ids: list[int]
    logprobs: list[float | None] | None   # behaviour log-probs, None on a tool's tokens; None: not recorded
    tokens: list[tuple[str, float | None]] | None = None    # (text, log-prob) per token, once shown


@dataclass
class Group:
    step: int
    uid: str
    prompt_key: str          # the dataset index, the same in every epoch (uid is "<epoch>-<index>")
    prompt_text: str
    ground_truth: str
    data_source: str
    samples: list[Sample] = field(default_factory=list)
    images: list[str] = field(default_factory=list)    # the prompt's stored images' names (RunLayout.image)

    @property
    def reward_mean(self) -> float:
        return sum(s.reward for s in self.samples) / len(self.samples) if self.samples else float("nan")


class RunView:
    def __init__(self, history: RolloutHistory, tokenizer, job: dict | None):
        """tokenizer: anything with batch_decode (a tokenizer, or grpo_trainer.ui.text's)."""
        self.history, self.tokenizer = history, tokenizer
        self._job, self._algorithm = job, _algorithm(job)
        self._cache: OrderedDict[int, list[Group]] = OrderedDict()     # the last steps read
        self._lock = Lock()

    @property
    def algorithm(self) -> tuple[str, bool, float]:
        """(advEstimator, normAdvByStd, gamma) of the run's job. A job's run records its job in
        its first checkpoint: until then it is looked for again on each use (the spec's defaults)."""
        if self._job is None:
            self._job = run_job(self.history)
            self._algorithm = _algorithm(self._job)
        return self._algorithm

    # --- the overview ------------------------------------------------------------------------

    def metrics(self) -> dict[int, dict]:
        """metrics.jsonl by step (a resumed run rewrote the steps after its checkpoint: the last line wins)."""
        try:
            text = self.history.storage.read_bytes(self.history.layout.metrics).decode()
        except FileNotFoundError:
            return {}
        by_step = {}
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                by_step[int(row.get("step", 0))] = row
        return dict(sorted(by_step.items()))

    def curves(self, metrics: dict[int, dict]) -> list[dict]:
        """Per panel: {title, steps, series: {name: values (null where not logged)}}."""
        panels = []
        for title, names in PANELS:
            series = {n: [_finite(m.get(n)) for m in metrics.values()] for n in names}
            series = {n: v for n, v in series.items() if any(x is not None for x in v)}
            if series:       # a sparse one (validation) is drawn across the steps it skips
                panels.append({"title": title, "steps": list(metrics), "series": series})
        return panels

    def steps(self, metrics: dict[int, dict]) -> list[dict]:
        """The steps with rollouts (the folder listing), newest first, with their logged reward."""
        trained, retention = self.history.trained_step(), self.history.retention()
        rows = []
        for step in reversed(self.rollout_steps()):
            if retention is not None and step in retention:
                continue
            m = metrics.get(step, {})
            rows.append({"step": step, "trained": step <= trained, "reward": _finite(m.get("critic/score/mean")),
                         "length": _finite(m.get("response_length/mean"))})
        return rows

    def rollout_steps(self) -> list[int]:
        """The steps with a rollouts folder, from step 1: step-0 holds only the validation before
        training (trainer.valBeforeTrain), no step's rollouts."""
        return [s for s in self.history.steps() if s >= 1]

    def deleted_note(self) -> str:
        retention = self.history.retention()
        return retention.describe() if retention is not None else ""

    # --- one step, one prompt ----------------------------------------------------------------

    def step_groups(self, step: int) -> list[Group]:
        """Step `step`'s groups, from its accepted shards (LookupError: not a trained step with rollouts)."""
        with self._lock:
            if step in self._cache:
                self._cache.move_to_end(step)
                return self._cache[step]
        if step < 1:
            raise LookupError(f"step {step}: training starts at step 1 (step 0's rollouts are the validation "
                              "before training)")
        retention = self.history.retention()
        if retention is not None and step in retention:
            raise LookupError(retention.describe(step, step))
        if step > self.history.trained_step():
            raise LookupError(f"step {step}: not trained yet")
        groups = self._groups(self._table(step), step)
        if not getattr(self.tokenizer, "final", True):      # token ids until the run's model is known
            return groups
        with self._lock:
            self._cache[step] = groups
            while len(self._cache) > 8:
                self._cache.popitem(last=False)
        return groups

    def prompt_across_steps(self, prompt_key: str, first: int, last: int) -> list[Group]:
        """The prompt's groups in the steps first..last that have rollouts (reads only those, and
        decodes only the prompt's samples of a step not read before)."""
        found = []
        retention, trained = self.history.retention(), self.history.trained_step()
        for step in self.history.steps():
            if not first <= step <= last or step > trained or (retention is not None and step in retention):
                continue
            with self._lock:
                cached = self._cache.get(step)
            if cached is not None:
                found += [g for g in cached if g.prompt_key == prompt_key]
            else:
                try:
                    found += self._groups(self._table(step), step, only=prompt_key)
                except LookupError:
                    continue
        return found

    def _table(self, step: int) -> pa.Table:
        shards = self.history.accepted_shards(step)
        if not shards:
            raise LookupError(f"step {step}: no rollouts")
        return pa.concat_tables(export_table(self.history.storage.read_table(uri), step, shard)
                                for shard, uri in shards.items())

    def image(self, name: str) -> bytes:
        """A prompt image the records name, by its name (the SHA-256 hex of its bytes): read only
        from the run's images/ (LookupError: not such a name, or none stored under it)."""
        if not IMAGE_NAME.fullmatch(name):
            raise LookupError(f"image {name!r}: not an image name (the SHA-256 hex of its bytes, 64 characters)")
        uri = self.history.layout.image(name)
        try:
            return self.history.storage.read_bytes(uri)
        except FileNotFoundError:
            raise LookupError(f"{uri}: no such image in the run") from None

    def tokenize(self, groups: list[Group]) -> None:
        """Each shown sample's response as (text, log-prob) per token (only the shown page's: a
        step can hold millions of tokens). A token's text is what it adds to the decoded text
        after the few tokens before it (as incremental detokenizers do), so spaces and
        multi-byte characters come out as in the whole decode."""
        for g in groups:
            for s in g.samples:
                if s.tokens is None:
                    ids = s.response_ids
                    windows = [ids[max(0, i - 4):i + 1] for i in range(len(ids))]
                    full = self.tokenizer.batch_decode(windows)
                    before = self.tokenizer.batch_decode([w[:-1] for w in windows])
                    s.tokens = [(f[len(b):] if f.startswith(b) else f, lp)
                                for f, b, lp in zip(full, before, s.logprobs or [None] * len(ids))]

    def _groups(self, table: pa.Table, step: int, only: str | None = None) -> list[Group]:
        """The step's groups (`only`: of that prompt key), advantages over the whole step."""
        rows = table.to_pylist()
        advantages = self._advantages(rows)
        if only is not None:
            kept = [i for i, r in enumerate(rows) if r["uid"].split("-", 1)[-1] == only]
            rows, advantages = [rows[i] for i in kept], [advantages[i] for i in kept]
        prompts = self.tokenizer.batch_decode([r["prompt_ids"] for r in rows])
        texts = self.tokenizer.batch_decode([r["response_ids"] for r in rows])
        groups: dict[str, Group] = {}
        order: dict[str, int] = {}        # the group's place in the batch
        for i, r in enumerate(rows):
            g = groups.get(r["uid"])
            if g is None:
                g = groups[r["uid"]] = Group(step, r["uid"], r["uid"].split("-", 1)[-1], prompts[i],
                                             r["ground_truth"] or "", r["data_source"] or "",
                                             images=[n for n in map(image_name, r["images"] or []) if n])
            order[r["uid"]] = min(order.get(r["uid"], r["prompt_index"]), r["prompt_index"])
            mask = r["response_mask"] or [1] * len(r["response_ids"])
            # null: the engine was asked for none (on-policy, without rollout.calculateLogProbs)
            logprobs = None if r["response_logprobs"] is None else \
                [lp if m else None for lp, m in zip(r["response_logprobs"], mask)]
            g.samples.append(Sample(r["sample_index"], float(r["reward"]), advantages[i], r["response_length"],
                                    r["finish_reason"] or "", r["policy_version"], r["worker"] or "",
                                    r["data_source"] or "", texts[i], r["response_ids"], logprobs))
        for g in groups.values():
            g.samples.sort(key=lambda s: s.sample_index)
        return sorted(groups.values(), key=lambda g: order[g.uid])

    def _advantages(self, rows: list[dict]) -> list[float | None]:
        """Each sample's advantage as the run's outcome estimator makes it from the step's rewards
        (on its first response token; grpo_trainer.algorithms.advantages). None for PPO (GAE
        needs the critic's values). With useKLInReward the trainer's token rewards also carry the
        KL penalty, which the records don't keep: these are the outcome part."""
        estimator, norm, gamma = self.algorithm
        if estimator == "gae" or not rows:
            return [None] * len(rows)
        import torch

        from grpo_trainer.algorithms.advantages import compute_advantages
        width = max(1, max(len(r["response_ids"]) for r in rows))
        rewards, mask = torch.zeros(len(rows), width, dtype=torch.float64), torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            m = r["response_mask"] or [1] * len(r["response_ids"])
            mask[i, :len(m)] = torch.tensor(m, dtype=mask.dtype)
            last = max((k for k, v in enumerate(m) if v), default=0)
            rewards[i, last] = r["reward"]
        adv, _ = compute_advantages(estimator, rewards, mask.to(rewards.dtype), [r["uid"] for r in rows],
                                    norm_adv_by_std=norm, gamma=gamma)
        first = [next((k for k, v in enumerate(r["response_mask"] or [1]) if v), 0) for r in rows]
        return [float(adv[i, k]) for i, k in enumerate(first)]


def _algorithm(job: dict | None) -> tuple[str, bool, float]:
    """(advEstimator, normAdvByStd, gamma) of the run's spec; the spec's defaults without one."""
    from grpo_api.spec import AlgorithmSpec
    try:
        algo = AlgorithmSpec.model_validate((job or {}).get("spec", {}).get("algorithm", {}))
    except ValueError:
        algo = AlgorithmSpec()
    return algo.adv_estimator.value, algo.norm_adv_by_std, algo.gamma


def _finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def run_job(history: RolloutHistory) -> dict | None:
    """The run's job: `grpo run`'s <run>/job.yaml, else the latest checkpoint's (trainer_state.json)."""
    import yaml

    from grpo_api.storage import StorageError
    storage, layout = history.storage, history.layout
    try:
        return yaml.safe_load(storage.read_bytes(layout.job_file))
    except (FileNotFoundError, StorageError):
        pass
    names = [u for u in storage.list(layout.checkpoints) if u.rsplit("/", 1)[-1].removeprefix("step-").isdigit()]
    for uri in sorted(names, key=lambda u: int(u.rsplit("-", 1)[-1]), reverse=True):
        try:
            return TrainerState.from_json(storage.read_bytes(f"{uri}/{STATE_FILE}")).trainer.job
        except FileNotFoundError:
            continue
    return None
