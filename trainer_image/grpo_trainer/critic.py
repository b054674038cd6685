"""PPO's critic (algorithm.advEstimator gae; verl's critic worker, in short): a value model with
its own optimizer and schedule, FSDP2-sharded on every trainer rank like the policy.

Each step, before the policy's update: the critic's values of every response token (each rank
computes its share of the batch; an all-reduce gives every rank all of them), GAE's advantages and
returns over the whole batch (verl's `compute_gae_advantage_return`, whitened over the batch), and
then ppoEpochs of the clipped value loss on the same mini- and micro-batches as the policy.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from grpo_api.spec import GRPOJobSpec, ModelSpec
from grpo_trainer import batch as batching
from grpo_trainer.algorithms import LossNormalizer, compute_gae_advantage_return, masked_mean, value_loss
from grpo_trainer.attention import varlen_kwargs
from grpo_trainer.batch import MicroBatch, Sample
from grpo_trainer.model import build_critic, build_optimizer, num_parameters

log = logging.getLogger("grpo.trainer")


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """How much of the returns' variance the critic's values explain, over the response tokens:
    1 - Var(returns - values) / (Var(returns) + 1e-5), unbiased variances (verl's
    critic/vf_explained_var). 1: the values predict the returns; 0 or less: no better than their mean."""
    keep = mask.bool()
    r, v = returns[keep].double(), values[keep].double()
    if r.numel() < 2:
        return float("nan")
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))


def forward_values(model, mb: MicroBatch) -> torch.Tensor:
    """[b, L-1]: position t's value is the state's before token t+1 (as the log-probs are aligned)."""
    if mb.packed is not None:    # one row without padding: the values go back to [b, L-1]
        packed, (b, width) = mb.packed, mb.targets.shape
        values = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                       **varlen_kwargs(model, packed)).logits[0, :, 0]
        if packed.expand is not None:     # shared prompts: each full position's value
            values = values[packed.expand]
        valid = packed.source >= 0
        out = values.float().new_zeros(b * width)
        return out.index_put((packed.source[valid],), values[valid].float()).view(b, width)
    values = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    return values.squeeze(-1)[:, :-1].float()


class Critic:
    def __init__(self, model_spec: ModelSpec, spec: GRPOJobSpec, *, device: torch.device, total_steps: int):
        self.spec, self.device = spec, device
        self.world = dist.get_world_size()
        self.model = build_critic(model_spec, spec.critic, device)
        self.optimizer, self.scheduler = build_optimizer(self.model, spec.critic, total_steps)
        self.n_params = num_parameters(self.model)
        self.epochs = spec.critic.ppo_epochs or spec.trainer.ppo_epochs

    def estimate(self, samples: list[Sample], minibatches: list[list[MicroBatch]], rewards: torch.Tensor,
                 mask: torch.Tensor, timings: dict[str, float]) -> torch.Tensor:
        """Collective, on this rank's share of the batch in the critic's own micro-batches (kept
        for `update`): the values, then GAE's advantages over the whole batch from the token-level
        `rewards` [N, T] over the response `mask`, by sample index (every rank gets all of them). The returns and values
        go into the micro-batches."""
        self.minibatches = minibatches
        start = time.perf_counter()
        flat = [mb for mbs in minibatches for mb in mbs]
        self.model.eval()
        with torch.no_grad():
            values = batching.gather_response_values(flat, [forward_values(self.model, mb) for mb in flat], samples,
                                                     width=max(len(s.response_ids) for s in samples))
        if self.world > 1:
            dist.all_reduce(values)   # each sample's values come from the one rank that holds it
        timings["timing_s/values"] = time.perf_counter() - start
        algo = self.spec.algorithm
        advantages, returns = compute_gae_advantage_return(rewards, values.cpu(), mask, gamma=algo.gamma, lam=algo.lam)
        for name, per_sample in (("returns", returns), ("old_values", values.cpu())):
            batching.set_response_values(flat, samples, name, per_sample)
        self.metrics = {"critic/values/mean": float(masked_mean(values.cpu(), mask)),
                        "critic/returns/mean": float(masked_mean(returns, mask)),
                        "critic/vf_explained_var": explained_variance(returns, values.cpu(), mask)}
        return advantages

    def update(self, timings: dict[str, float]) -> dict[str, float]:
        """Collective, after `estimate`: ppoEpochs x mini-batches of the clipped value loss, one
        optimizer step per mini-batch (exact gradient accumulation over micro-batches and ranks,
        as the policy's)."""
        start, minibatches = time.perf_counter(), self.minibatches
        algo, critic = self.spec.algorithm, self.spec.critic
        scale = algo.loss_scale_factor or self.spec.data.max_response_length
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        self.model.train()
        for _ in range(self.epochs):
            for mbs in minibatches:
                norm = LossNormalizer.from_masks(algo.loss_agg_mode, [mb.response_mask for mb in mbs],
                                                 scale_factor=scale, dp_size=self.world)
                for mb in mbs:
                    vpreds = forward_values(self.model, mb)
                    loss, m = value_loss(vpreds, mb.returns, mb.old_values, mb.response_mask,
                                         cliprange_value=critic.cliprange_value, loss_agg_mode=algo.loss_agg_mode,
                                         normalizer=norm)
                    loss.backward()
                    sums["critic/vf_loss"] += loss.item() / self.world
                    for key, value in (("critic/vf_clipfrac", m["vf_clipfrac"]),
                                       ("critic/vpred_mean", masked_mean(vpreds.detach(), mb.response_mask))):
                        sums[key] += float(value)
                        counts[key] += 1
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), critic.grad_clip)
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                if torch.isfinite(torch.tensor(grad_norm)):
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                sums["critic/grad_norm"] += grad_norm
                counts["critic/grad_norm"] += 1
        updates = self.epochs * len(minibatches)
        metrics = {k: v / counts[k] if counts[k] else v / updates for k, v in sums.items()}
        if self.world > 1:   # the loss is a per-rank partial sum
            total = torch.tensor(metrics["critic/vf_loss"], dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            metrics["critic/vf_loss"] = float(total)
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        timings["timing_s/update_critic"] = time.perf_counter() - start
        return {**self.metrics, **metrics}

    def forward_passes(self) -> int:
        """Passes' worth of matmuls per step: the values, and forward + backward per epoch."""
        return 1 + 3 * self.epochs
