"""The actor: the policy (an FSDP2 shard on every rank), its reference model, optimizer and
schedule, and what turns one step's samples into one update (verl's dp_actor, in short):
advantages, this rank's micro-batches, old and reference log-probs, ppoEpochs of updates.

Gradient accumulation is exact: each micro-batch's loss is its partial sum over the whole
mini-batch's denominator (`LossNormalizer`), FSDP2 averages gradients over ranks and the
normalizer's dp_size factor cancels that.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grpo_api.spec import GRPOJobSpec, ModelSpec
from grpo_trainer import batch as batching
from grpo_trainer import lora
from grpo_trainer.algorithms import (KLController, LossNormalizer, compute_advantages, entropy_from_logits,
                                     kl_penalty, logprobs_from_logits, masked_mean, policy_loss)
from grpo_trainer.algorithms.rollout_correction import (correction_metrics, rollout_is_weights,
                                                        rollout_rejection_mask)
from grpo_trainer.batch import MicroBatch, Sample
from grpo_trainer.attention import varlen_kwargs
from grpo_trainer.critic import Critic
from grpo_trainer.lm_head import fused_head
from grpo_trainer.collectives import SetupError
from grpo_trainer.model import build_optimizer, build_policy, build_reference, model_config, num_parameters
from grpo_trainer.offload import PhaseOffload
from grpo_trainer.state import ActorState
from grpo_trainer import vision
from grpo_trainer.vision import forward_inputs

log = logging.getLogger("grpo.trainer")


def forward_logprobs(model, mb: MicroBatch, temperature: float, *, with_entropy: bool = False,
                     entropy_grad: bool = False):
    """Per-position logprob of the next token (and entropy), [b, L-1], at the sampling
    temperature as verl does (logits / T). The entropy is a metric unless `entropy_grad`.
    Logits are computed only from the first response position on (`logits_to_keep`): the
    vocabulary projection and softmax of prompt positions would be thrown away; with the fused
    head (`grpo_trainer.lm_head`) only the responses' positions, never as logits. Other
    positions read 0 (the response mask excludes them everywhere)."""
    if mb.packed is not None:
        return _packed_logprobs(model, mb, temperature, with_entropy, entropy_grad)
    start = mb.response_start
    width = mb.input_ids.shape[1]
    head = fused_head(model)
    with forward_inputs(model, mb.input_ids, mb.attention_mask, mb.pixels) as vision:  # a VL model's images, positions
        if head is not None:
            # The head sees positions start..width-1; the last one predicts nothing.
            select = F.pad(mb.predicts_response[:, start:], (0, 1))
            with head.request(select, mb.targets[:, start:][mb.predicts_response[:, start:]], temperature,
                              with_entropy=with_entropy, entropy_grad=entropy_grad and torch.is_grad_enabled()):
                out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                            logits_to_keep=width - start, **vision).logits
            out = F.pad(out[:, :-1], (0, 0, start, 0))
            return out[..., 0], out[..., 1] if with_entropy else None
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                       logits_to_keep=width - start, **vision).logits
    logits = logits[:, :-1]
    if temperature > 0:
        logits = logits / temperature
    logp = F.pad(logprobs_from_logits(logits, mb.targets[:, start:]), (start, 0))
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = F.pad(entropy_from_logits(logits if entropy_grad else logits.detach()), (start, 0))
    return logp, entropy


def _packed_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool, entropy_grad: bool):
    """forward_logprobs on the micro-batch packed into one row (model.useRemovePadding): the
    head sees only the positions that predict a response token, whose results go back into the
    padded [b, L-1] layout of the losses."""
    packed, (b, width) = mb.packed, mb.targets.shape
    where, dest = packed.scored, packed.scored_dest
    labels = mb.targets.flatten()[dest]
    inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, logits_to_keep=where,
                  **varlen_kwargs(model, packed))
    head = fused_head(model)
    entropy = None
    if head is not None:
        with head.request(None, labels, temperature,     # the model's outputs are only the scored positions
                          with_entropy=with_entropy, entropy_grad=entropy_grad and torch.is_grad_enabled()):
            out = model(**inputs).logits[0]
        logp, entropy = out[:, 0], out[:, 1] if with_entropy else None
    else:
        logits = model(**inputs).logits[0]
        if temperature > 0:
            logits = logits / temperature
        logp = logprobs_from_logits(logits, labels)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = entropy_from_logits(logits if entropy_grad else logits.detach())

    def padded(values):
        return None if values is None else values.new_zeros(b * width).index_put((dest,), values).view(b, width)
    return padded(logp), padded(entropy)


def check_engine_logprobs(micro_batches: list[MicroBatch]) -> None:
    """An off-policy update or rollout correction reads the engine's log-probs: rollouts
    generated for an on-policy step carry none (grpo_trainer.rollouts.engine_logprobs_needed)."""
    if any(mb.behaviour_logprobs is None for mb in micro_batches):
        raise ValueError("this step's rollouts carry no behaviour log-probs (they were generated for an on-policy "
                         "step: rollout.maxStaleness 0, no algorithm.rolloutCorrection), but the update reads them "
                         "(maxStaleness 1 or rolloutCorrection); set rollout.calculateLogProbs: true where such "
                         "rollouts are generated")


@torch.no_grad()
def compute_logprobs(model, micro_batches: list[MicroBatch], temperature: float) -> list[torch.Tensor]:
    return [forward_logprobs(model, mb, temperature)[0].detach() for mb in micro_batches]


@dataclass
class UpdateResult:
    metrics: dict[str, float]
    tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0            # of the forward and backward passes (for perf/mfu)
    train_seconds: float = 0.0    # their time


class Actor:
    @staticmethod
    def check(model_spec: ModelSpec) -> dict | None:
        """The policy's spec.model against the model's config alone, before the trainer writes
        anything: with LoRA, its targets and adapterPath. Returns LoRA's PEFT config (JSON-able:
        checkpoints and exports keep it), None without LoRA."""
        return lora.check_spec(model_spec) if model_spec.lora else None

    def __init__(self, model_spec: ModelSpec, spec: GRPOJobSpec, *, device: torch.device, total_steps: int,
                 pad_token_id: int):
        self.spec, self.device, self.pad_token_id = spec, device, pad_token_id
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if spec.algorithm.adv_estimator.value == "gae" and vision.is_vision_language(model_config(model_spec)):
            raise SetupError("spec.algorithm.advEstimator: gae (PPO's critic) on a vision-language model is not built "
                             "yet (issue 45); use grpo, rloo, reinforce_plus_plus or another outcome estimator")
        compile = spec.trainer.use_torch_compile
        self.model = build_policy(model_spec, device, compile=compile, wrap=lora.wrapper(model_spec),
                                  freeze_vision=spec.trainer.freeze_vision_tower)
        algo = spec.algorithm
        self.lora = model_spec.lora is not None
        self.pack = model_spec.use_remove_padding or model_spec.share_prompts   # packed micro-batches (batch.Packed)
        # A VL model's images, per micro-batch (grpo_trainer.vision); its rows are never packed.
        self.image_processor = vision.load_image_processor(model_spec) if vision.is_vision_language(
            self.model.config) else None
        if self.image_processor is not None and self.pack:
            self.pack = False
            if self.rank == 0:
                log.warning("spec.model.useRemovePadding, sharePrompts: a vision-language model's micro-batches are "
                            "padded, not packed (its mrope positions are not packed yet, issue 45)")
        self.share_prompts = self.pack and model_spec.share_prompts
        if self.share_prompts and self.rank == 0:
            log.info("model.sharePrompts: each prompt once in its micro-batch's row (perf/layer_tokens)")
        # With LoRA the reference is the policy with its adapters off (`_reference`): no copy.
        self.uses_reference = algo.use_kl_loss or algo.use_kl_in_reward
        self.ref = (build_reference(model_spec, device, cpu_offload=spec.trainer.ref_cpu_offload, compile=compile)
                    if self.uses_reference and not self.lora else None)
        self.kl_ctrl = KLController(algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl,
                                    algo.kl_ctrl.horizon)
        self.optimizer, self.scheduler = build_optimizer(self.model, spec.trainer, total_steps)
        self.n_params = num_parameters(self.model)
        # trainer.paramOffload / optimizerOffload: off the GPU while the colocated engines generate
        self.offloader = PhaseOffload(self.model, self.optimizer, params=spec.trainer.param_offload,
                                      optimizer_state=spec.trainer.optimizer_offload, device=device)
        # PPO's value model: its values make the advantages (GAE) instead of the group's rewards.
        self.critic = (Critic(model_spec, spec, device=device, total_steps=total_steps)
                       if spec.algorithm.adv_estimator.value == "gae" else None)

    def state_dict(self) -> ActorState:
        """For the checkpoint, beside the models: the KL penalty's coefficient (adaptive, it moves)."""
        return ActorState(kl_coef=self.kl_ctrl.value)

    def load_state_dict(self, state: ActorState) -> None:
        if state.kl_coef is not None:      # None: a checkpoint older than the adaptive coefficient
            self.kl_ctrl.value = state.kl_coef

    def checkpoint_parts(self) -> dict:
        """What a checkpoint holds: (model, optimizer, scheduler) by name."""
        parts = {"policy": (self.model, self.optimizer, self.scheduler)}
        if self.critic is not None:
            parts["critic"] = (self.critic.model, self.critic.optimizer, self.critic.scheduler)
        return parts

    def train_on(self, samples: list[Sample], *, off_policy: bool, step: int) -> UpdateResult:
        """Collective: this rank's share of every mini-batch, its log-probs, the advantages over
        the whole batch, then the critic's update (PPO) and ppoEpochs of policy updates; during
        trainer.criticWarmup only the critic's. `off_policy`: the samples may come from an older
        policy, so the ratio is taken against the engine's log-probs."""
        trainer = self.spec.trainer
        start = time.perf_counter()
        minibatches = self._micro_batches(samples, trainer.micro_batch_size_per_gpu, trainer.max_tokens_per_gpu)
        # the forward and backward passes' times (perf/mfu's), and the rest of the update's
        timings: dict[str, float] = {}
        other = {"timing_s/collate": time.perf_counter() - start}
        old_logp, ref_logp = self._logprobs(samples, minibatches, off_policy, timings)
        start = time.perf_counter()
        rewards, mask = batching.token_rewards(samples)
        rewards, metrics = self._kl_in_reward(samples, minibatches, rewards, mask, old_logp, ref_logp)
        metrics |= self._correct_for_the_rollout(minibatches, old_logp)
        advantages = self._advantages(samples, minibatches, rewards, mask, timings)
        # verl's timing_s/adv: the token rewards (KL penalty), rollout correction and advantages;
        # the critic's forward has its own timing_s/values
        other["timing_s/adv"] = time.perf_counter() - start - timings.get("timing_s/values", 0.0)
        adv = torch.cat(advantages)
        metrics |= {"critic/advantages/mean": float(adv.mean()),
                    "critic/advantages/std": float(adv.std()) if len(adv) > 1 else 0.0}
        tokens = sum(s.length for s in samples)
        if self.share_prompts:   # the layers ran on each prompt once per micro-batch: count what ran
            own = [mb for mbs in minibatches for mb in mbs]
            tokens = round(tokens * sum(mb.packed.input_ids.shape[1] for mb in own) / sum(mb.num_tokens for mb in own))
            metrics["perf/layer_tokens"] = tokens
        passes = 0
        if self.critic is not None:
            metrics |= self.critic.update(timings)
            flops = 2 * self.critic.n_params * tokens * self.critic.forward_passes()
        else:
            flops = 0.0
        result = UpdateResult({}, 0)
        if self.critic is None or step > self.spec.trainer.critic_warmup:
            if self.rank == 0:
                log.info("Updating actor model...")
            start = time.perf_counter()
            result = update_policy(self.model, self.optimizer, self.scheduler, self.spec, minibatches, old_logp,
                                   ref_logp, self.world, self.device)
            timings["timing_s/update_actor"] = time.perf_counter() - start
            passes = 3 * self.spec.trainer.ppo_epochs
        elif self.rank == 0:
            log.info("Critic warm-up (step %d of trainer.criticWarmup=%d): the policy stays as it is",
                     step, self.spec.trainer.critic_warmup)
        # one pass per log-prob computation done
        passes += self.uses_reference + (timings["timing_s/old_log_prob"] > 0)
        result.metrics = {**metrics, **result.metrics}
        result.flops = flops + 2 * self.n_params * tokens * passes
        result.train_seconds = sum(timings.values())
        result.timings = timings | other
        return result

    def _correct_for_the_rollout(self, minibatches, old_logp: dict) -> dict[str, float]:
        """algorithm.rolloutCorrection (decoupled): each micro-batch's importance weights
        pi_old / pi_rollout, and its response mask without the rejected tokens. Metrics over this
        rank's tokens."""
        rc = self.spec.algorithm.rollout_correction
        if rc is None or rc.bypass_mode:
            return {}
        ratios, kept, rejected, weights, seq_ratios = [], [], [], [], []
        for mb in (mb for mbs in minibatches for mb in mbs):
            mask = mb.response_mask
            log_ratio = (old_logp[id(mb)] - mb.behaviour_logprobs) * mask
            if rc.rollout_is:
                mb.is_weights = rollout_is_weights(log_ratio, mask, rc.rollout_is, upper=rc.rollout_is_threshold,
                                                   lower=rc.rollout_is_threshold_lower)
                weights.append(mb.is_weights[mask.bool()])
                seq_ratios.append(log_ratio.sum(dim=-1)[mask.sum(dim=-1) > 0])
            if rc.rollout_rs:
                mb.response_mask = rollout_rejection_mask(log_ratio, mask, rc.rollout_rs, upper=rc.rollout_rs_threshold,
                                                          lower=rc.rollout_rs_threshold_lower)
            ratios.append(log_ratio[mask.bool()])
            kept.append(mb.response_mask[mask.bool()])
            rejected.append((mb.response_mask < mask).any(dim=-1))
        return correction_metrics(torch.cat(ratios), torch.cat(kept), torch.cat(rejected),
                                  torch.cat(weights) if weights else None,
                                  torch.cat(seq_ratios) if rc.rollout_is == "sequence" else None,
                                  icepop=rc.rollout_is_threshold_lower is not None)

    def _kl_in_reward(self, samples: list[Sample], minibatches, rewards: torch.Tensor, mask: torch.Tensor,
                      old_logp: dict, ref_logp: dict | None) -> tuple[torch.Tensor, dict[str, float]]:
        """The token-level `rewards` [N, T], with algorithm.useKLInReward minus klCtrl's
        coefficient x KL(old policy || reference) on every token (verl's apply_kl_penalty),
        gathered over the ranks. The coefficient then adapts to the step's mean KL."""
        algo = self.spec.algorithm
        if not algo.use_kl_in_reward:
            return rewards, {}
        flat = [mb for mbs in minibatches for mb in mbs]
        kld = batching.gather_response_values(
            flat, [kl_penalty(old_logp[id(mb)], ref_logp[id(mb)], algo.kl_penalty) for mb in flat], samples,
            width=rewards.shape[1])
        if self.world > 1:
            dist.all_reduce(kld)   # each sample's KL comes from the one rank that holds it
        kld = kld.cpu() * mask
        beta = self.kl_ctrl.value
        current_kl = float(masked_mean(kld, mask, dim=-1).mean())
        self.kl_ctrl.update(current_kl, n_steps=len(samples))
        return rewards - beta * kld, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}

    def _advantages(self, samples: list[Sample], minibatches, rewards: torch.Tensor, mask: torch.Tensor,
                    timings: dict[str, float]) -> list[torch.Tensor]:
        """Per sample, written into the micro-batches too: GAE from the critic's values, or the
        outcome estimator's over the step's (token-level) rewards."""
        algo = self.spec.algorithm
        if self.critic is not None:
            trainer, critic = self.spec.trainer, self.spec.critic
            own = self._micro_batches(samples, critic.micro_batch_size_per_gpu or trainer.micro_batch_size_per_gpu,
                                      critic.max_tokens_per_gpu or trainer.max_tokens_per_gpu)
            padded = self.critic.estimate(samples, own, rewards, mask, timings)
        else:
            if self.rank == 0:
                log.info("Computing group-relative advantages...")
            padded, _ = compute_advantages(algo.adv_estimator.value, rewards, mask, [s.uid for s in samples],
                                           norm_adv_by_std=algo.norm_adv_by_std, gamma=algo.gamma)
        batching.set_response_values([mb for mbs in minibatches for mb in mbs], samples, "advantages", padded)
        return [padded[i, :len(s.response_ids)] for i, s in enumerate(samples)]

    def _micro_batches(self, samples: list[Sample], max_count: int, max_tokens: int | None) -> list[list[MicroBatch]]:
        """This rank's share of every mini-batch, cut into micro-batches (by count or tokens)."""
        per_mini = self.spec.trainer.mini_batch_size * self.spec.rollout.n
        groups = [batching.micro_batches(batching.rank_share(list(range(start, start + per_mini)), self.rank, self.world),
                                         samples, max_count=max_count, max_tokens=max_tokens, packed=self.pack,
                                         share_prompts=self.share_prompts)
                  for start in range(0, len(samples), per_mini)]
        return [self._collate(samples, g) for g in self._as_many_on_every_rank(groups, max_tokens)]

    def _as_many_on_every_rank(self, groups: list[list[list[int]]], max_tokens: int | None) -> list[list[list[int]]]:
        """Each part's micro-batches split until every rank has as many as the one with the most
        (a collective; by count, equal shares make equal numbers already)."""
        if max_tokens is None or self.world == 1:
            return groups
        counts = torch.tensor([len(g) for g in groups], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        return [batching.split_to(g, n) for g, n in zip(groups, counts.tolist())]

    def _collate(self, samples: list[Sample], groups: list[list[int]]) -> list[MicroBatch]:
        mbs = [batching.collate(g, samples, None, self.pad_token_id, self.device, pack=self.pack,
                                share_prompts=self.share_prompts) for g in groups]
        if self.image_processor is not None:
            for mb in mbs:
                pixels = vision.pixel_inputs(self.image_processor, [b for i in mb.indices for b in samples[i].images])
                mb.pixels = pixels.to(self.device) if pixels is not None else None
        return mbs

    def _forward_only(self, samples: list[Sample], flat: list[MicroBatch]):
        """model -> its log-probs {id(update micro-batch): [b, L-1]}. With
        trainer.logProbMaxTokensPerGPU the forward passes run on micro-batches of their own (they
        keep no activations for a backward pass, so larger ones fit) and their results go back
        into the update's layout."""
        temperature = self.spec.rollout.temperature
        budget = self.spec.trainer.log_prob_max_tokens_per_gpu
        if budget is None:
            return lambda model: dict(zip(map(id, flat), compute_logprobs(model, flat, temperature)))
        indices = [i for mb in flat for i in mb.indices]
        width = max(len(samples[i].response_ids) for i in indices)
        forward: list[MicroBatch] = []     # collated at the first pass that needs them

        def logprobs(model):
            if not forward:
                groups = batching.micro_batches(indices, samples, max_count=len(indices), max_tokens=budget,
                                                packed=self.pack, share_prompts=self.share_prompts)
                forward.extend(self._collate(samples, self._as_many_on_every_rank([groups], budget)[0]))
            per_sample = batching.gather_response_values(forward, compute_logprobs(model, forward, temperature),
                                                         samples, width)
            return {id(mb): batching.scatter_response_values(mb, per_sample, samples, like=mb.response_mask.float())
                    for mb in flat}
        return logprobs

    def _logprobs(self, samples: list[Sample], minibatches, off_policy: bool,
                  timings: dict[str, float]) -> tuple[dict, dict | None]:
        """Old logprobs (the PPO ratio's denominator) and reference logprobs (the KL loss), by
        id(micro-batch). Old ones are computed only when an update is off-policy; missing ones
        mean the current logprobs, detached (ratio 1)."""
        flat = [mb for mbs in minibatches for mb in mbs]
        forward = self._forward_only(samples, flat)
        old_logp, timings["timing_s/old_log_prob"] = {}, 0.0    # 0: no forward pass (perf/mfu counts them)
        rc = self.spec.algorithm.rollout_correction
        if off_policy or rc is not None:        # what follows reads the engine's log-probs
            check_engine_logprobs(flat)
        if rc is not None and rc.bypass_mode:   # verl's bypass: the engine's log-probs are the old policy
            old_logp = {id(mb): mb.behaviour_logprobs for mb in flat}
        elif off_policy and rc is None:
            # The policy that generated the samples, as the engine scored each token.
            old_logp = {id(mb): mb.behaviour_logprobs for mb in flat}
        elif (self.spec.trainer.ppo_epochs > 1 or len(minibatches) > 1     # later updates are off-policy
              or self.spec.algorithm.use_kl_in_reward                     # the reward's KL is the old policy's
              or rc is not None):                                         # decoupled: pi_old against pi_rollout
            start = time.perf_counter()
            self.model.eval()
            old_logp = forward(self.model)
            self._finished()
            timings["timing_s/old_log_prob"] = time.perf_counter() - start
        start = time.perf_counter()
        ref_logp = None
        if self.uses_reference:
            with self._reference() as ref:
                ref_logp = forward(ref)
            self._finished()
        timings["timing_s/ref"] = time.perf_counter() - start
        return old_logp, ref_logp

    def _finished(self) -> None:
        """Wait for the passes launched so far: the forward passes queue their kernels without
        waiting for any, so a phase's timer stops when its GPU work is done, not when it is queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _reference(self):
        """The reference model: its own copy, or with LoRA the policy with its adapters
        disabled (the base model, exactly: PEFT's layers then compute only their base layer)."""
        if not self.lora:
            yield self.ref
            return
        from grpo_trainer.lora import adapters_off
        self.model.eval()
        with adapters_off(self.model):
            yield self.model


def update_policy(model, optimizer, scheduler, spec: GRPOJobSpec, minibatches: list[list[MicroBatch]],
                  old_logp: dict[int, torch.Tensor], ref_logp: dict[int, torch.Tensor] | None,
                  world: int, device: torch.device) -> UpdateResult:
    """ppoEpochs x mini-batches x micro-batches; one optimizer step per mini-batch.
    `old_logp`/`ref_logp` are keyed by id(micro-batch); missing old logprobs mean on-policy
    (the current logprobs, detached: ratio 1)."""
    algo, temperature = spec.algorithm, spec.rollout.temperature
    scale = algo.loss_scale_factor or spec.data.max_response_length
    # Summed as tensors on the device and read once at the end: reading one (.item()) between a
    # forward and its backward would leave the GPU idle while the host launches the backward.
    sums: dict[str, torch.Tensor | float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    tokens = 0
    model.train()
    for _ in range(spec.trainer.ppo_epochs):
        for mbs in minibatches:
            norm = LossNormalizer.from_masks(algo.loss_agg_mode, [mb.response_mask for mb in mbs],
                                             scale_factor=scale, dp_size=world)
            for mb in mbs:
                logp, entropy = forward_logprobs(model, mb, temperature, with_entropy=True,
                                                 entropy_grad=algo.entropy_coeff != 0)
                old = old_logp.get(id(mb), logp.detach())
                pg_loss, pg_metrics = policy_loss(
                    algo.policy_loss, old, logp, mb.advantages, mb.response_mask,
                    clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
                    clip_ratio_c=algo.clip_ratio_c, loss_agg_mode=algo.loss_agg_mode, normalizer=norm,
                    weights=mb.is_weights, config=algo.policy_loss_config)
                loss = pg_loss
                sums["actor/pg_loss"] += _summand(pg_loss) / world
                if algo.use_kl_loss and ref_logp is not None:
                    kl_loss = norm(kl_penalty(logp, ref_logp[id(mb)], algo.kl_loss_type), mb.response_mask)
                    loss = loss + algo.kl_loss_coef * kl_loss
                    sums["actor/kl_loss"] += _summand(kl_loss) / world
                ent_loss = norm(entropy, mb.response_mask)
                sums["actor/entropy"] += _summand(ent_loss) / world
                if algo.entropy_coeff != 0:
                    loss = loss - algo.entropy_coeff * ent_loss
                loss.backward()
                tokens += mb.num_tokens
                for k, v in pg_metrics.items():
                    sums[f"actor/{k}"] += _summand(v)
                    counts[f"actor/{k}"] += 1
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.grad_clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if torch.isfinite(torch.tensor(grad_norm)):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sums["actor/grad_norm"] += grad_norm
            counts["actor/grad_norm"] += 1
    num_updates = spec.trainer.ppo_epochs * len(minibatches)
    sums = _read(sums)
    metrics = {k: v / counts[k] if counts[k] else v / num_updates for k, v in sums.items()}
    # Losses are per-rank partial sums: add them up over ranks.
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        if key in metrics and world > 1:
            metrics[key] = all_reduce_sum(metrics[key], device)
    metrics["actor/lr"] = scheduler.get_last_lr()[0]
    scheduler.step()
    return UpdateResult(metrics, tokens)


def _summand(value: torch.Tensor | float) -> torch.Tensor | float:
    return value.detach().to(torch.float64) if isinstance(value, torch.Tensor) else float(value)


def _read(sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """The sums as floats, the device's in one transfer."""
    on_device = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([sums[k].reshape(()) for k in on_device]).tolist() if on_device else []
    return {k: float(v) for k, v in sums.items() if k not in on_device} | dict(zip(on_device, values))


def all_reduce_sum(value: float, device: torch.device) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t)
