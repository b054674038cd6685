"""What a rollout server does, without the gRPC: serve a Generate request end to end (read the
prompt shard, generate, score, write the rollout shard), and report health. The servicer
(grpo_rollout.server) only translates to and from protobuf.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from grpo_api.spec import GRPOJobSpec
from grpo_api.storage import Storage
from grpo_rollout.agent_loop import build_agent_loop, reward_extra_info
from grpo_rollout.engine import SLEEP_PARTS, Engine, EngineInfo, SamplingParams
from grpo_rollout.metrics import RolloutMetrics
from grpo_rollout.rewards import RewardPool, RewardRequest, overlong_penalty
from grpo_rollout.shard import Prompt, Scored, rollout_table
from grpo_rollout.weights import UNKNOWN_VERSION, WeightReceiver, WeightSyncConflict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingOverrides:
    """What a request asked for; None means "the job's default" (proto3 can't say "unset" for 0)."""

    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool | None = None


@dataclass(frozen=True)
class GenerateJob:
    request_id: str
    prompt_uri: str
    output_uri: str
    sampling: SamplingOverrides
    expected_policy_version: int
    step: int = 0
    shard: str = ""


@dataclass(frozen=True)
class GenerateResult:
    rollout_uri: str
    num_prompts: int
    num_samples: int
    policy_version: int
    generated_tokens: int
    generate_seconds: float
    reward_seconds: float
    reward_errors: int


@dataclass(frozen=True)
class Health:
    ready: bool
    policy_version: int
    status: str
    weight_sync_error: str
    weight_sync_version: int


def derive_seed(base: int, step: int, shard: str) -> int:
    """A request's seed when it names none: stable across restarts, different per step and shard."""
    digest = hashlib.sha256(f"{base}/{step}/{shard}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


def resolve_sampling(spec: GRPOJobSpec, job: GenerateJob) -> SamplingParams:
    o, r = job.sampling, spec.rollout
    return SamplingParams(
        n=o.n or r.n,
        max_tokens=o.max_tokens or spec.data.max_response_length,
        temperature=r.temperature if o.temperature is None else o.temperature,
        top_p=r.top_p if o.top_p is None else o.top_p,
        top_k=r.top_k if o.top_k is None else o.top_k,
        seed=derive_seed(r.seed, job.step, job.shard) if o.seed is None else o.seed,
        stop=tuple(o.stop),
        logprobs=True if o.logprobs is None else o.logprobs,
    )


class RolloutWorker:
    def __init__(self, *, spec: GRPOJobSpec, engine: Engine, rewards: RewardPool, storage: Storage,
                 worker_id: str, metrics: RolloutMetrics, reward_models=None, lora_adapters: bool = True,
                 sandbox=None):
        """lora_adapters: take a LoRA policy's adapters alone when the engine can (grpo_rollout.weights).
        sandbox: the `python` tool's sandbox servers (tools.sandbox_client.SandboxClient), or None."""
        self.spec = spec
        self.engine = engine
        self.rewards = rewards
        self.reward_models = reward_models   # grpo_rollout.reward_client.RewardModels, or None
        self.storage = storage
        self.worker_id = worker_id
        self.metrics = metrics
        self.engine_lock = threading.Lock()  # generation and weight loading take turns
        self.weights = WeightReceiver(engine, self.engine_lock, metrics, lora_adapters=lora_adapters)
        self.agent_loop = build_agent_loop(spec, engine, sandbox)   # rollout.multiTurn: tool-using trajectories
        metrics.set_policy_version(engine.policy_version)
        self.asleep: frozenset[str] = frozenset()   # the engine's SLEEP_PARTS asleep (placement colocated)
        self.sleep_level = 0

    def health(self) -> Health:
        version = self.weights.version
        if self.weights.syncing:
            status = "syncing weights"
        elif version == UNKNOWN_VERSION:
            status = "weights unknown: " + (self.weights.sync_error or "a weight update did not complete")
        else:
            status = "ready"
        ready = status == "ready"      # asleep too: a Generate wakes what sleeps
        if self.asleep:
            status += f" (asleep at level {self.sleep_level}: {', '.join(sorted(self.asleep))})"
        return Health(ready=ready, policy_version=version, status=status,
                      weight_sync_error=self.weights.sync_error, weight_sync_version=self.weights.sync_version)

    def info(self) -> EngineInfo:
        return self.engine.info()

    def tool_schemas(self) -> list[dict]:
        """The tools a tool agent's prompt is rendered with (none without the tool agent loop)."""
        return list(getattr(self.agent_loop, "schemas", None) or [])

    def generate(self, job: GenerateJob) -> GenerateResult:
        params = resolve_sampling(self.spec, job)
        prompts = Prompt.rows(self.storage.read_table(job.prompt_uri))     # Prompt.rows reads older shards too
        images = self._images(prompts)
        with self.metrics.in_flight(), self.engine_lock:
            self._wake_locked()
            version = self._check_version(job.expected_policy_version)
            started = time.monotonic()
            if self.agent_loop is not None:
                groups = self.agent_loop.generate(prompts, params)
            else:
                groups = self.engine.generate([p.prompt_ids for p in prompts], params,
                                              **({"images": images} if images else {}))
            generate_seconds = time.monotonic() - started
            texts = [[self.engine.decode(s.token_ids) for s in g] for g in groups]
        samples = sum(len(g) for g in groups)
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        self.metrics.generated(samples, tokens, generate_seconds)

        started = time.monotonic()
        scored, errors = self._score(prompts, groups, texts, job.request_id)
        reward_seconds = time.monotonic() - started
        self.metrics.rewarded(reward_seconds, errors)

        table = rollout_table(prompts, scored, policy_version=version, worker=self.worker_id)
        self.storage.write_table(job.output_uri, table)
        log.info("request %s: %d prompts x %d samples, %d tokens in %.2fs, rewards in %.2fs -> %s",
                 job.request_id, len(prompts), params.n, tokens, generate_seconds, reward_seconds, job.output_uri)
        return GenerateResult(rollout_uri=job.output_uri, num_prompts=len(prompts), num_samples=samples,
                              policy_version=version, generated_tokens=tokens, generate_seconds=generate_seconds,
                              reward_seconds=reward_seconds, reward_errors=sum(errors.values()))

    # --- sleep mode (rollout.placement colocated) ---------------------------------------------

    def _images(self, prompts: list[Prompt]) -> list[list[bytes]] | None:
        """The prompts' images (encoded bytes, each distinct one read once), None when none has any."""
        if not any(p.images for p in prompts):
            return None
        if not self.engine.accepts_images:
            raise ValueError(f"the prompts have images, but {self.engine.info().model} is not a vision-language "
                             f"model (its config has no vision_config)")
        if self.agent_loop is not None:
            raise ValueError("prompts with images in an agent loop (rollout.multiTurn, rollout.agentLoop) are not "
                             "supported yet (issue 45)")
        read: dict[str, bytes] = {}
        for uri in {u for p in prompts for u in p.images}:
            read[uri] = self.storage.read_bytes(uri)
        return [[read[u] for u in p.images] for p in prompts]

    def sleep(self, level: int) -> tuple[float, bool]:
        """Free the engine's GPU memory for the trainer; returns the seconds it took and whether
        the weights were dropped (their version is then unknown: the trainer's next sync is a full
        one, and a Generate before it is refused as for a server that missed an update)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (got {level})")
        with self.engine_lock:
            started = time.monotonic()
            dropped = False
            if not self.asleep:        # partly awake (only its weights): stays so, as vLLM does
                dropped = self.engine.sleep(level)
                self.asleep, self.sleep_level = frozenset(SLEEP_PARTS), level
                if dropped:
                    self.weights.forget()
            return time.monotonic() - started, dropped

    def wake_up(self, parts: Iterable[str] | None = None) -> float:
        """Take back `parts` of the engine's memory (all that sleeps when None): a weight sync wakes
        the weights alone, so that the trainer can move its own tensors off the GPU before the KV
        cache comes back (trainer.paramOffload; verl's multi-stage wake-up)."""
        with self.engine_lock:
            started = time.monotonic()
            self._wake_locked(parts)
            return time.monotonic() - started

    def _wake_locked(self, parts: Iterable[str] | None = None) -> None:
        """Wake what sleeps of `parts` (under the engine lock): generation wakes it all."""
        if unknown := set(parts or ()) - set(SLEEP_PARTS):
            raise ValueError(f"wake-up parts must be among {', '.join(SLEEP_PARTS)} (got {', '.join(sorted(unknown))})")
        waking = self.asleep if parts is None else self.asleep & set(parts)
        if waking:
            self.engine.wake_up(sorted(waking))
            self.asleep -= waking
            log.info("engine awake%s (policy version %d)",
                     f" but for its {', '.join(sorted(self.asleep))}" if self.asleep else "", self.weights.version)

    def _check_version(self, expected: int) -> int:
        health = self.health()
        if not health.ready:
            raise WeightSyncConflict(f"not ready to generate: {health.status}")
        if health.policy_version != expected:
            raise WeightSyncConflict(f"weights are at policy version {health.policy_version}, "
                                     f"the request expects {expected}")
        return health.policy_version

    def _score(self, prompts: list[Prompt], groups, texts, request_id: str = "") -> tuple[list[list[Scored]], Counter]:
        requests = [RewardRequest(p.data_source, text, p.ground_truth, reward_extra_info(p.extra_info, sample))
                    for p, group, group_texts in zip(prompts, groups, texts)
                    for sample, text in zip(group, group_texts)]
        results = iter(self.rewards.score(requests))
        model_scores = iter(self._score_with_models(prompts, texts, request_id))
        shaping = self.spec.reward.overlong_buffer
        errors: Counter = Counter()
        scored = []
        for group in groups:
            out = []
            for sample in group:
                r = next(results)
                extra = dict(r.extra)
                reward = r.score
                if r.error:
                    errors[r.error] += 1
                if self.reward_models is not None:     # issue 31: reward models, combined with the rule
                    reward = self._combine(r.score, next(model_scores), extra)
                if shaping.enable:
                    penalty = overlong_penalty(len(sample.token_ids), self.spec.data.max_response_length,
                                               shaping.len, shaping.penalty_factor)
                    extra.update(overlong_reward=penalty, overlong=penalty < 0)
                    reward += penalty
                out.append(Scored(sample, reward, extra, r.error))
            scored.append(out)
        return scored, errors

    def _score_with_models(self, prompts: list[Prompt], texts, request_id: str) -> list[dict]:
        """Each sample's {model name: score} from the reward servers (a RewardModelUnavailable fails
        the call, and the trainer re-dispatches the shard); [] without reward models."""
        if self.reward_models is None:
            return []
        from grpo_rollout.reward_client import ScoreItem
        items = []
        for p, group_texts in zip(prompts, texts):
            # A shard without raw_prompt: the policy's own rendering, decoded, as one user message.
            messages = list(p.messages) or [{"role": "user", "content": self.engine.decode(p.prompt_ids)}]
            items.extend(ScoreItem(messages, text, p.ground_truth) for text in group_texts)
        return self.reward_models.score(request_id, items)

    def _combine(self, rule: float, scores: dict, extra: dict) -> float:
        from grpo_rollout.rewards.combine import combine_rewards
        extra["rule_score"] = rule
        for name, s in scores.items():
            extra[f"rm/{name}"] = s.score
            if s.judge_output or not s.parsed:
                extra[f"rm/{name}/parsed"] = s.parsed
        return combine_rewards(rule, {name: s.score for name, s in scores.items()}, self.spec.reward)

