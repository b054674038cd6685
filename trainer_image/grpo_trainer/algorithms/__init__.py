"""The algorithm core: advantages, policy losses, KL estimators, loss aggregation, logprobs. Pure torch.

Names and formulas follow verl's ``verl/trainer/ppo/core_algos.py``, one concept per module:

- ``advantages``: ``compute_advantages`` and the estimators grpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline, opo (``ADV_ESTIMATORS`` registry); PPO's GAE
  (``compute_gae_advantage_return``), which needs the critic's values. ``advantages_group``: gpg,
  grpo_passk, grpo_vectorized, rloo_vectorized.
- ``losses``: ``policy_loss`` with vanilla (dual-clip PPO, clip-higher) and gspo (``POLICY_LOSSES``);
  the critic's clipped ``value_loss``. ``losses_entropy``: clip_cov, kl_cov; ``losses_ratio``: cispo,
  sapo, geo_mean (GMPO), gpg; ``losses_trust``: dppo_tv, dppo_kl, dro.
- ``aggregation``: ``aggregate_loss`` and ``LossNormalizer`` (exact gradient accumulation).
- ``kl``: ``kl_penalty`` (k1, abs, k2, k3 and their ``+`` straight-through variants) and the
  ``KLController`` of a KL penalty in the reward (fixed, adaptive).
- ``logprobs``: chunked ``logprobs_from_logits`` / ``entropy_from_logits``, and
  ``fused_linear_logprobs`` from the LM head's input without the logits.

DAPO's dynamic sampling is the rollout source's (``RolloutSource._keep_informative_groups``) and its overlong
shaping is scored with the reward on the rollout servers (``grpo_rollout.rewards.overlong``).
"""

from .advantages import compute_advantages, compute_gae_advantage_return
from . import advantages_group  # noqa: F401  (it registers its estimators)
from .aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss, loss_denominator, loss_numerator
from .groups import Groups
from .kl import KL_TYPES, KLController, kl_penalty
from .logprobs import entropy_from_logits, fused_linear_logprobs, logprobs_from_logits
from .losses import policy_loss, value_loss
from . import losses_entropy, losses_ratio, losses_trust  # noqa: F401  (they register their losses)
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .registry import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_TYPES",
    "KLController",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "Groups",
    "LossNormalizer",
    "Registry",
    "aggregate_loss",
    "compute_advantages",
    "compute_gae_advantage_return",
    "entropy_from_logits",
    "fused_linear_logprobs",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_denominator",
    "loss_numerator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "register_adv_est",
    "register_policy_loss",
    "value_loss",
]
