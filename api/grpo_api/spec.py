"""The GRPOJob API (grpo.dev/v1alpha1): the single source of truth for every part.

The CRD schema is generated from these models (`grpo_api.crd`), the operator and `grpo validate`
validate with them, the trainer and rollout pods read them. Field docstrings become the schema
descriptions that `kubectl explain` shows. Defaults follow verl where verl has one, and live only
here. Cross-field rules are declared once in `CROSS_FIELD_RULES` with both a Python check and the
CEL expression the API server evaluates, so `grpo validate` and `kubectl apply` agree.

No torch import here: `grpo validate` and the operator must start fast.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic.alias_generators import to_camel

API_GROUP = "grpo.dev"
API_VERSION = "v1alpha1"
KIND = "GRPOJob"
PLURAL = "grpojobs"

# verl's group-based estimators compare samples of one prompt: they need n >= 2.
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus_baseline", "opo",
                    "gpg", "grpo_passk")
# Policy losses whose objective is a mean over sequences: verl aggregates them as seq-mean-token-mean whatever
# actor.loss_agg_mode says, so the job must say so.
SEQUENCE_LOSSES = ("gspo", "sapo", "geo_mean")
# A Kubernetes object name (DNS-1123 subdomain), as Secrets are named.
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
MAX_TOTAL_LENGTH = 131072


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )


class DType(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class ModelCacheSpec(_Model):
    claim_name: str = Field(pattern=SECRET_NAME_PATTERN, max_length=253)
    """PersistentVolumeClaim (in the job's namespace) that holds fetched models: each pod's init container copies model.path into it once (hub id or object storage; the first pod downloads, the others wait for it), then the pods load from it, read-only. ReadWriteMany when the pods may land on several nodes; reused by every job of the same model."""


class LoRASpec(_Model):
    rank: int | None = Field(default=None, ge=1)
    """Rank of every adapter (verl: actor_rollout_ref.model.lora_rank); required unless adapterPath is set."""
    alpha: float = Field(default=16.0, gt=0)
    """Scaling numerator: an adapter adds alpha / rank x B @ A to its layer's weight (verl: lora_alpha)."""
    target_modules: list[str] = Field(default=["all-linear"], min_length=1)
    """Module names (or name suffixes) that get adapters; `all-linear` is every linear layer but the LM head (verl: target_modules)."""
    exclude_modules: str | None = Field(default=None, min_length=1)
    """A regular expression (Python's, matched against each module's full name, as PEFT and verl do): the modules it matches get no adapter and stay as loaded, e.g. `.*visual.*` for a vision tower (verl: exclude_modules)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on each adapter's input while training."""
    adapter_path: str | None = None
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from instead of new adapters; a local or mounted path (verl: lora_adapter_path). Its rank, alpha and target modules are the adapter's own."""
    merge: bool = False
    """Send the rollout servers the merged weights (W + alpha / rank x B @ A) at every weight sync (verl: lora.merge). False: only the adapters go to servers whose engine applies them itself (the hf engine; 8 % of the bytes for a Qwen3-1.7B at rank 64), merged weights to the others (vLLM, for now)."""

    @field_validator("exclude_modules")
    @classmethod
    def _exclude_is_a_regex(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"not a regular expression ({e}): {pattern!r}") from None
        return pattern


class ModelSpec(_Model):
    path: str = Field(min_length=1)
    """Hugging Face model id, local folder, or object-storage folder (s3://bucket/prefix, file:///path; read with spec.storage's endpoint and credentials) of the policy (verl: actor_rollout_ref.model.path)."""
    tokenizer_path: str | None = None
    """Tokenizer location when it differs from `path` (the same kinds of location)."""
    cache: ModelCacheSpec | None = None
    """Fetch the model once into a shared volume instead of into every pod. Null: a hub model is downloaded by each pod, a model in object storage is fetched into each pod's own emptyDir."""
    dtype: DType = DType.bfloat16
    """Parameter dtype for training compute and rollout (float32 master weights are kept by FSDP2 mixed precision on GPU)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass to save memory (verl: enable_gradient_checkpointing)."""
    trust_remote_code: bool = False
    """Allow model code from the model repository (verl: trust_remote_code)."""
    use_fused_kernels: bool = True
    """Compute the policy's and reference's log-probs and entropies chunk by chunk from the LM head's input, forward and backward, never the [tokens x vocab] logits (Liger's fused linear cross-entropy; verl: actor_rollout_ref.model.use_fused_kernels). Same numbers to float32 rounding, several GB less memory per micro-batch; false: the logits path."""
    use_remove_padding: bool = False
    """Pack each micro-batch's samples into one row without padding, each with its own positions from 0, for the policy, the reference and the critic (verl: actor_rollout_ref.model.use_remove_padding); each sample attends only to itself (on a GPU in bf16/fp16 through flash attention's varlen kernel, torch.nn.attention.varlen; elsewhere through sdpa with transformers' block-diagonal causal mask, which computes the whole row). With maxTokensPerGPU the budget counts the samples' tokens, not count x longest. Same numbers as padded rows to float32 rounding."""
    share_prompts: bool = False
    """Pack each prompt once with the responses to it in a micro-batch (verl: actor_rollout_ref.actor.use_prefix_grouper): the layers run on a prompt's tokens once rather than once per response, and attention gives each response its prompt's keys and values. rollout.n responses to a P-token prompt save (n - 1) x P tokens of the policy's, the reference's and the critic's forward and backward; micro-batches keep a prompt's responses together and count its tokens once. Implies useRemovePadding's packed rows (not for vision-language models, which are never packed). Same numbers as without, to float rounding."""
    lora: LoRASpec | None = None
    """Train LoRA adapters on the frozen model instead of every weight; the reference model is the model with its adapters disabled. Null: full-parameter training."""


class DataSpec(_Model):
    train_files: list[str] = Field(min_length=1)
    """Training parquet files in verl's layout (prompt, data_source, reward_model.ground_truth, extra_info)."""
    val_files: list[str] = []
    """Validation parquet files; validation is skipped when empty."""
    prompt_key: str = Field(default="prompt", min_length=1)
    """Column holding the chat messages (verl: data.prompt_key)."""
    image_key: str = Field(default="images", min_length=1)
    """Column holding each row's images, a list of {bytes, path} (verl: data.image_key), one per `<image>` placeholder in the prompt, for a vision-language model (Qwen2.5-VL, Qwen3-VL; the hf and vllm engines); a model without a vision tower refuses rows that have images. Each image is stored once in the run (images/<sha256>) and the prompt and rollout records name it."""
    image_patch_size: int | None = Field(default=None, ge=1)
    """verl: data.image_patch_size. The model's image processor sizes the images at its own patch size; a value here must equal it, checked when the trainer starts (another size fails the job with exit code 2 instead of training on differently sized images than verl would). Null: the processor's, as verl's default."""
    train_batch_size: int = Field(default=1024, ge=1)
    """Prompts per training step (verl: data.train_batch_size)."""
    val_batch_size: int | None = Field(default=None, ge=1)
    """Prompts per validation request; null sends the whole validation set at once."""
    max_prompt_length: int = Field(default=512, ge=1)
    """Longest prompt in tokens after the chat template (verl: data.max_prompt_length)."""
    max_response_length: int = Field(default=512, ge=1)
    """Most tokens generated per response (verl: data.max_response_length)."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than maxPromptLength before training (verl: data.filter_overlong_prompts)."""
    truncation: Literal["error", "left", "right"] = "error"
    """What to do with a prompt longer than maxPromptLength that was not filtered: stop with the row named, or keep its left/right part."""
    shuffle: bool = True
    """Shuffle the training set every epoch (seeded)."""
    seed: int = 1
    """Seed of the epoch-aware sampler (verl: data.seed)."""


class AdvEstimator(str, Enum):
    grpo = "grpo"
    rloo = "rloo"
    reinforce_plus_plus = "reinforce_plus_plus"
    reinforce_plus_plus_baseline = "reinforce_plus_plus_baseline"
    opo = "opo"
    gae = "gae"
    gpg = "gpg"
    grpo_vectorized = "grpo_vectorized"
    rloo_vectorized = "rloo_vectorized"
    grpo_passk = "grpo_passk"


LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PolicyLoss = Literal["vanilla", "gspo", "clip_cov", "kl_cov", "cispo", "sapo", "geo_mean", "gpg", "dppo_tv", "dppo_kl",
                     "dro"]
KLType = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
                 "k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"]


class KLControl(_Model):
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: the coefficient stays klCoef; adaptive: it moves toward targetKl (verl: algorithm.kl_ctrl.type)."""
    kl_coef: float = Field(default=0.001, ge=0.0)
    """The (initial) coefficient of the KL penalty in the reward (verl: algorithm.kl_ctrl.kl_coef)."""
    target_kl: float = Field(default=0.1, gt=0.0)
    """adaptive: the per-token KL it aims at (verl: algorithm.kl_ctrl.target_kl)."""
    horizon: int = Field(default=10000, ge=1)
    """adaptive: responses over which a 20 % correction is made (verl: algorithm.kl_ctrl.horizon)."""


RolloutRS = Literal["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]


class RolloutCorrection(_Model):
    """Correction for the mismatch between the rollout engine's log-probs and the trainer's (verl's
    algorithm.rollout_correction, decoupled mode: the trainer recomputes the old policy, and weights
    or rejects tokens by pi_old / pi_rollout), or verl's bypass mode."""

    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights pi_old / pi_rollout per token, or their product per response; null: none (verl: rollout_is)."""
    rollout_is_threshold: float = Field(default=2.0, gt=0.0)
    """Weights are truncated at this (TIS) (verl: rollout_is_threshold)."""
    rollout_is_threshold_lower: float | None = Field(default=None, gt=0.0)
    """With it, weights outside [lower, threshold] are zeroed instead (IcePop; verl: rollout_is_threshold "lower_upper")."""
    rollout_rs: list[RolloutRS] = []
    """Rejection tests, all must pass: token_k1 keeps tokens whose ratio lies in [lower, threshold]; k2/k3 bound a divergence; seq_sum/seq_mean/seq_max test the response's sum/mean/max and keep or drop it whole (verl: rollout_rs)."""
    rollout_rs_threshold: float | None = Field(default=None, gt=0.0)
    """Upper bound of the rejection tests (for k1 a ratio) (verl: rollout_rs_threshold)."""
    rollout_rs_threshold_lower: float | None = Field(default=None, gt=0.0)
    """k1's lower ratio bound; null: 1 / rolloutRsThreshold (verl: rollout_rs_threshold "lower_upper")."""
    bypass_mode: bool = False
    """Take the engine's log-probs as the old policy (no recomputation, the ratio anchors on the policy that sampled); nothing is then left to weight or reject (verl: bypass_mode)."""


class PolicyLossConfig(_Model):
    """The parameters of the policy losses beyond PPO's clip ratios (verl: actor.policy_loss.*, and
    actor.tau_pos / tau_neg for SAPO); each loss reads only its own."""

    clip_cov_ratio: float = Field(default=0.0002, gt=0.0, le=1.0)
    """clip_cov: the share of a micro-batch's response tokens whose gradient is cut (at least one) (verl: clip_cov_ratio)."""
    clip_cov_lb: float = 1.0
    """clip_cov: tokens are cut only where advantage x log-prob covariance exceeds this (verl: clip_cov_lb)."""
    clip_cov_ub: float = 5.0
    """clip_cov: ... and stays below this; must exceed clipCovLb (verl: clip_cov_ub)."""
    kl_cov_ratio: float = Field(default=0.0002, gt=0.0, le=1.0)
    """kl_cov: the share of a micro-batch's response tokens, those of largest covariance, that get the KL penalty (at least one) (verl: kl_cov_ratio)."""
    ppo_kl_coef: float = Field(default=0.1, ge=0.0)
    """kl_cov: weight of the penalty |log pi - log pi_old| on those tokens (verl: ppo_kl_coef)."""
    tau_pos: float = Field(default=1.0, gt=0.0)
    """sapo: gate temperature for tokens with a positive advantage (verl: actor.tau_pos)."""
    tau_neg: float = Field(default=1.05, gt=0.0)
    """sapo: gate temperature for the others; above tauPos damps negative updates faster (verl: actor.tau_neg)."""
    dro_beta: float | None = Field(default=None, gt=0.0)
    """dro (required with it): weight of the quadratic penalty beta/2 (log pi - log pi_old)^2 (verl: dro_beta)."""


class AlgorithmSpec(_Model):
    adv_estimator: AdvEstimator = AdvEstimator.grpo
    """Advantage estimator (verl: algorithm.adv_estimator)."""
    norm_adv_by_std: bool = True
    """Divide GRPO advantages by the group's std; false gives Dr.GRPO (verl: algorithm.norm_adv_by_std_in_grpo)."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount for GAE and REINFORCE++ returns (verl: algorithm.gamma)."""
    lam: float = Field(default=1.0, ge=0.0, le=1.0)
    """GAE's lambda: 1 is Monte-Carlo returns minus the critic's value, 0 one-step TD (verl: algorithm.lam)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses are averaged (verl: actor.loss_agg_mode). seq-mean-token-sum-norm is Dr.GRPO's: the
    mini-batch's token-loss sum divided by (responses x lossScaleFactor), as verl's trainer, the Dr.GRPO
    paper and TRL's dr_grpo do. The seq-mean modes count every response of the mini-batch, empty ones
    (rejected whole by rolloutCorrection) too, as verl's trainer does."""
    loss_scale_factor: int | None = Field(default=None, ge=1)
    """Divisor for seq-mean-token-sum-norm; null means maxResponseLength (verl: actor.loss_scale_factor)."""
    policy_loss: PolicyLoss = "vanilla"
    """Policy loss (verl: actor.policy_loss.loss_mode): vanilla (dual-clip PPO), gspo (sequence ratio), clip_cov and
    kl_cov (covariance-selected tokens, the entropy-mechanism recipe), cispo (clipped weight, every token keeps its
    gradient), sapo (smooth gate), geo_mean (GMPO: geometric mean of the token ratios), gpg (plain policy gradient),
    dppo_tv and dppo_kl (DPPO: clipRatioLow/High bound a token's probability change, by total variation or binary KL),
    dro (quadratic log-ratio penalty, policyLossConfig.droBeta). gspo, sapo and geo_mean need lossAggMode
    seq-mean-token-mean."""
    policy_loss_config: PolicyLossConfig = PolicyLossConfig()
    """Parameters of clip_cov, kl_cov, sapo and dro (verl: actor.policy_loss)."""
    use_kl_loss: bool = Field(default=False, alias="useKLLoss")
    """Add a KL(policy || reference) term to the loss instead of the reward (verl: actor.use_kl_loss)."""
    kl_loss_coef: float = Field(default=0.001, ge=0.0)
    """Weight of the KL loss (verl: actor.kl_loss_coef)."""
    kl_loss_type: KLType = Field(default="low_var_kl", alias="klLossType")
    """KL estimator: k1, k2 (mse), k3 (low_var_kl), abs; a '+' suffix uses k2's gradient (verl: actor.kl_loss_type)."""
    use_kl_in_reward: bool = Field(default=False, alias="useKLInReward")
    """Subtract klCtrl's coefficient x KL(policy || reference) from every response token's reward, before the advantages (PPO's way; verl: algorithm.use_kl_in_reward)."""
    kl_penalty: KLType = Field(default="kl", alias="klPenalty")
    """The KL estimator of the reward penalty (verl: algorithm.kl_penalty)."""
    kl_ctrl: KLControl = Field(default=KLControl(), alias="klCtrl")
    """The penalty's coefficient, fixed or adaptive (verl: algorithm.kl_ctrl)."""
    rollout_correction: RolloutCorrection | None = None
    """Rollout-vs-trainer mismatch correction (TIS, MIS, bypass); null: off (verl: algorithm.rollout_correction)."""
    clip_ratio_low: float = Field(default=0.2, ge=0.0)
    """Lower PPO clip epsilon; 1 or more leaves the ratio unbounded below (CISPO's recipe uses 10) (verl: actor.clip_ratio_low)."""
    clip_ratio_high: float = Field(default=0.2, ge=0.0)
    """Upper PPO clip epsilon; 0.28 is DAPO's clip-higher (verl: actor.clip_ratio_high)."""
    clip_ratio_c: float = Field(default=3.0, gt=1.0)
    """Dual-clip bound for negative advantages (verl: actor.clip_ratio_c)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (verl: actor.entropy_coeff)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and generate more prompts, up to 10
    rounds (verl: algorithm.filter_groups.enable). Needs rollout.n >= 2: a group of one sample has no
    spread to keep."""


class OverlongBuffer(_Model):
    enable: bool = False
    """DAPO overlong reward shaping (verl: reward_model.overlong_buffer.enable)."""
    len: int = Field(default=0, ge=0)
    """Last tokens before maxResponseLength in which the penalty grows linearly; with enable it must be
    in 1..data.maxResponseLength."""
    penalty_factor: float = Field(default=1.0, ge=0.0)
    """Penalty at maxResponseLength."""


class RewardModelSpec(_Model):
    """A reward model served beside the job (`grpo reward`): its own pods (or local processes under
    `grpo run`), called by the rollout servers after generation. Each (prompt, response) is rendered
    again with the reward model's own tokenizer and chat template: the policy's tokens are not its."""

    name: str = Field(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=40)
    """Unique among the job's reward models; names its Deployment (<job>-rm-<name>), metrics and the `rm/<name>` score in reward_extra."""
    kind: Literal["classifier", "judge"] = "classifier"
    """classifier: a sequence-classification head scores the conversation (Skywork-Reward and most open RMs; verl's discriminative RM). judge: an LLM answers promptTemplate greedily and `parser` reads its score (verl's generative RM)."""
    path: str = Field(min_length=1)
    """Local folder (or mounted path) of the reward model (verl: reward_model.model.path)."""
    tokenizer_path: str | None = None
    """Its tokenizer when it differs from `path`."""
    dtype: DType = DType.bfloat16
    """Compute dtype on GPU; on CPU the model runs in float32."""
    trust_remote_code: bool = False
    """Allow model code from the model's folder."""
    max_length: int = Field(default=4096, ge=8)
    """Most tokens of a rendered (prompt, response) the model sees; longer ones are cut from the left (the response's end is kept) (verl: reward_model.max_length)."""
    weight: float = Field(default=1.0, ge=0.0)
    """Factor of this model's score in the combined reward (reward.combine)."""
    replicas: int = Field(default=1, ge=1)
    """Reward servers of this model; a batch whose server fails goes to another one."""
    gpus: int = Field(default=1, ge=0)
    """GPUs per reward server (0: CPU)."""
    timeout_seconds: float = Field(default=120.0, gt=0)
    """Limit of one scoring call; a server that overruns it is treated as failed and the batch goes to another replica."""
    max_tokens_per_batch: int = Field(default=16384, ge=1)
    """Classifier: padded tokens per forward pass (batched by tokens, longest first)."""
    engine: Literal["vllm", "hf"] = "vllm"
    """Judge: the generation engine (vllm on GPU, hf on CPU)."""
    prompt_template: str | None = None
    """Judge (required): the user message, with {prompt}, {response} and {ground_truth} filled in; rendered with the judge's chat template."""
    parser: Literal["tag", "yes_no"] = "tag"
    """Judge: tag reads the number inside <scoreTag>...</scoreTag> (the last one); yes_no takes the probability of 'yes' from the first generated token (p(yes) when it is yes, 1 - p(no) when it is no)."""
    score_tag: str = Field(default="score", pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")
    """Judge, parser tag: the tag around the score."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Judge: most tokens it generates per answer (greedy)."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    """Judge on vllm: fraction of the GPU's memory vLLM may take."""
    template: dict[str, Any] | None = None
    """Partial pod template merged into this model's pods (nodeSelector, tolerations, volumes, env...)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "self.kind != 'judge' || (has(self.promptTemplate) && self.promptTemplate.contains('{response}'))",
        "message": "promptTemplate is required for kind judge and must contain {response}"}]})

    @model_validator(mode="after")
    def _judge_needs_template(self) -> "RewardModelSpec":
        if self.kind == "judge" and "{response}" not in (self.prompt_template or ""):
            raise PydanticCustomError(
                "reward_model", "promptTemplate: required for kind judge, and must contain {response} (the question "
                "the judge answers, over {placeholders})",
                {"response": "{response}", "placeholders": "{prompt}, {response} and {ground_truth}"})
        return self


class RewardSpec(_Model):
    function: str = Field(default="auto", pattern=r"^(auto|.+:[A-Za-z_][A-Za-z0-9_]*)$")
    """'auto' dispatches by data_source (openai/gsm8k, math datasets); or 'module:function', or 'path/to/file.py:function' (verl's custom_reward_function contract)."""
    timeout_seconds: float = Field(default=10.0, gt=0)
    """Per-call limit; a reward function that takes longer scores 0 and is counted."""
    workers: int = Field(default=4, ge=1)
    """Reward worker processes per rollout server."""
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments of every call of reward.function, after verl's data_source, solution_str, ground_truth and extra_info (verl: custom_reward_function.reward_kwargs)."""
    concurrency: int = Field(default=16, ge=1)
    """An `async def` reward function: calls awaited at once per reward worker process."""
    max_error_fraction: float | None = Field(default=None, ge=0.0, lt=1.0)
    """The share of a step's samples whose reward function may fail (raise, time out, return no finite number, crash: each scores 0, is counted in the step's reward/errors/* metrics and said once on the console) before the run stops with exit code 2 and the function's error. Unset: the run stops when the function failed for every sample of a step (it is broken: training on the zeros would learn nothing), and goes on past occasional failures; 0: any failure stops it, as verl stops on an exception in compute_score."""
    overlong_buffer: OverlongBuffer = OverlongBuffer()
    """DAPO overlong shaping."""
    reward_models: list[RewardModelSpec] = Field(default=[], max_length=16, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    """Reward models served beside the job (classifiers and LLM judges); the rollout servers call them after generation."""
    combine: Literal["replace", "sum", "weighted"] = "replace"
    """How the reward models' scores and the rule's (reward.function) make the reward. replace (verl: with a reward model on, its score is the reward): the sum of weight x score over the models; sum: the rule's score plus that; weighted: (ruleWeight x rule + the sum of weight x score) / (ruleWeight + the sum of weights). Without reward models the rule's score is the reward. DAPO's overlong penalty is added after."""
    rule_weight: float = Field(default=1.0, ge=0.0)
    """The rule's weight under combine weighted."""


class CriticSpec(_Model):
    """The value model of PPO (advEstimator gae): the policy's architecture with a scalar value head on
    every token (verl's token-classification critic), FSDP2-sharded on the trainer ranks with its own
    optimizer, trained beside the policy on the same mini-batches; never sent to the rollout servers.
    Ignored by the other estimators."""

    model_path: str | None = Field(default=None, min_length=1)
    """Local folder of the critic's initial weights (a causal LM, whose head is replaced, or a
    token-classification model with one label); null: the policy's model (verl: critic.model.path)."""
    lr: float = Field(default=1e-5, ge=0.0)
    """Learning rate (verl: critic.optim.lr)."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps (verl: critic.optim.lr_warmup_steps)."""
    lr_warmup_steps_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Linear warmup over int(ratio x the run's total steps), for lrWarmupSteps 0 (verl: critic.optim.lr_warmup_steps_ratio)."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warmup (verl: critic.optim.warmup_style)."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    """AdamW weight decay (verl: critic.optim.weight_decay)."""
    grad_clip: float = Field(default=1.0, gt=0.0)
    """Max gradient norm (verl: critic.grad_clip)."""
    cliprange_value: float = Field(default=0.5, gt=0.0)
    """New values are clipped to old value +- this in the value loss (verl: critic.cliprange_value)."""
    ppo_epochs: int | None = Field(default=None, ge=1)
    """Passes over each rollout batch; null: trainer.ppoEpochs (verl: critic.ppo_epochs)."""
    micro_batch_size_per_gpu: int | None = Field(default=None, ge=1, alias="microBatchSizePerGPU")
    """Responses per forward/backward; null: trainer.microBatchSizePerGPU (verl: critic.ppo_micro_batch_size_per_gpu)."""
    max_tokens_per_gpu: int | None = Field(default=None, ge=1, alias="maxTokensPerGPU")
    """Token budget per micro-batch; null: trainer.maxTokensPerGPU (verl: critic.ppo_max_token_len_per_gpu)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass (verl: critic.model.enable_gradient_checkpointing)."""


class PythonSandbox(_Model):
    """The built-in `python` tool: each call runs the model's code in a fresh process (rlimits, an
    empty temporary folder, no network where the host allows a network namespace), in a sandbox
    server of its own or in the rollout server (docs/RELIABILITY.md says what each protects
    against and what it doesn't)."""

    timeout_seconds: float = Field(default=10.0, gt=0)
    """Wall-clock limit of one run; the process is killed after it."""
    cpu_seconds: int = Field(default=10, ge=1)
    """CPU-time rlimit (RLIMIT_CPU)."""
    memory_mb: int = Field(default=512, ge=16, alias="memoryMB")
    """Address-space rlimit (RLIMIT_AS) in MiB."""
    max_processes: int = Field(default=0, ge=0)
    """Processes/threads the code may start beyond itself (RLIMIT_NPROC, per user: 0 forbids fork where the server runs as its own user)."""
    replicas: int | None = Field(default=None, ge=0)
    """Sandbox servers (`grpo sandbox`) that run the code away from the rollout servers, which hold the job's token, TLS key and storage credentials: on Kubernetes the Deployment `<job>-sandbox`, whose NetworkPolicy denies all egress and admits only the job's rollout pods; with `grpo run`, local processes. A call whose server fails goes to another one. 0: the code runs in a child process of the rollout server. null: 1 on Kubernetes, 0 with `grpo run`."""
    concurrency: int = Field(default=4, ge=1)
    """Programs one sandbox server runs at once (its pod's memory limit is concurrency x memoryMB + 256 MiB)."""
    template: dict[str, Any] | None = None
    """Partial pod template merged into the sandbox pods (nodeSelector, tolerations, resources...)."""


class MultiTurnSpec(_Model):
    """Multi-turn, tool-using rollouts (verl: actor_rollout_ref.rollout.multi_turn): the model's
    turns end at a tool call (Hermes `<tool_call>{json}</tool_call>`), the tools run on the
    rollout server, their answers are appended as the chat template's tool turn, and generation
    goes on. Tool tokens are in the trajectory but masked out of every loss."""

    enable: bool = False
    """Run the agent loop (verl: multi_turn.enable)."""
    max_assistant_turns: int | None = Field(default=None, ge=1)
    """Most model turns per sample; null: until data.maxResponseLength (verl: multi_turn.max_assistant_turns)."""
    max_user_turns: int | None = Field(default=None, ge=0)
    """Most tool turns per sample; null: no limit but the length (verl: multi_turn.max_user_turns)."""
    max_parallel_calls: int = Field(default=1, ge=1)
    """Tool calls run per model turn. 1 stops generation at the first `</tool_call>`; more let the model end its turn and runs up to this many of its calls at once (verl: multi_turn.max_parallel_calls)."""
    max_tool_response_length: int = Field(default=256, ge=1)
    """Characters of a tool's answer kept (verl: multi_turn.max_tool_response_length)."""
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    """Which part of a long answer is cut (verl: multi_turn.tool_response_truncate_side)."""
    format: Literal["hermes"] = "hermes"
    """Tool-call format the model writes (verl: multi_turn.format)."""
    tools: list[Annotated[str, Field(pattern=r"^(python|.+:[A-Za-z_][A-Za-z0-9_]*)$")]] = Field(default_factory=list)
    """Tools: `python` (the built-in sandboxed code runner), or a Python function `module:function` / `path/to/file.py:function` whose JSON schema comes from its signature and docstring; keyword-only parameters are filled from the dataset row's extra_info.tools_kwargs[name].create_kwargs, not by the model."""
    tool_config_path: str | None = Field(default=None, min_length=1)
    """A verl tool config file (YAML: tools[].class_name, config, tool_schema) (verl: multi_turn.tool_config_path)."""
    tool_timeout_seconds: float = Field(default=30.0, gt=0)
    """Per-call limit; a tool that takes longer answers with an error message, and the sample goes on."""
    python: PythonSandbox = PythonSandbox()
    """The `python` tool's sandbox limits."""

    @field_validator("tools")
    @classmethod
    def _tools_unique(cls, tools: list[str]) -> list[str]:
        if len(set(tools)) != len(tools):
            raise ValueError(f"a tool is listed twice: {tools}")
        return tools

    def sandbox_replicas(self, *, kubernetes: bool) -> int:
        """The `python` tool's sandbox servers: none unless the agent loop runs it."""
        if not (self.enable and "python" in self.tools):
            return 0
        if self.python.replicas is not None:
            return self.python.replicas
        return 1 if kubernetes else 0


class RolloutSpec(_Model):
    engine: Literal["vllm", "hf"] = "vllm"
    """Generation engine: vllm (GPU, production) or hf (transformers; CPU, dev, tests) (verl: rollout.name)."""
    n: int = Field(default=5, ge=1)
    """Samples per prompt, the GRPO group size (verl: rollout.n). Quote the key in YAML, `"n": 8`: kubectl reads YAML 1.1, where a bare `n` is the boolean false."""
    placement: Literal["separate", "colocated"] = "separate"
    """Where the rollout servers run. separate: their own pods and GPUs (the rollout Deployment), scaled apart from the trainer. colocated: verl's hybrid engine; each trainer pod runs its node's servers itself, one per tensorParallelSize of its own GPUs, asleep while the trainer trains (replicas is then nnodes x nprocPerNode / tensorParallelSize, and the job can't be scaled)."""
    replicas: int = Field(default=1, ge=0)
    """Rollout servers; may change while the job runs (not with placement colocated, where it must be nnodes x nprocPerNode / tensorParallelSize)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per rollout server (verl: rollout.tensor_model_parallel_size)."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may use (verl: rollout.gpu_memory_utilization)."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature for training rollouts; 0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling (verl: rollout.top_p)."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling; -1 disables it (verl: rollout.top_k)."""
    val_temperature: float = Field(default=0.0, ge=0.0)
    """Temperature for validation (greedy by default, n=1)."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """vLLM scheduler token budget (verl: rollout.max_num_batched_tokens)."""
    enforce_eager: bool = False
    """Disable CUDA graphs in vLLM (verl: rollout.enforce_eager)."""
    quantization: Literal["fp8"] | None = None
    """fp8: vLLM generates with FP8 weights, quantized in 128x128 blocks (dynamic FP8 activations; MoE routers stay in model.dtype) at its start and again at every weight sync, verl's FP8 rollout scheme (vLLM's fp8_per_block); training stays in model.dtype. Faster decoding, but the rollouts come from a policy a little off the trainer's: verl's FP8 guide pairs it with token-level TIS (algorithm.rolloutCorrection.rolloutIs token). vllm engine only (verl: rollout.quantization)."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """fp8: vLLM keeps its KV cache in FP8 (e4m3 with scale 1.0: a bf16 checkpoint carries no calibrated scales), so each decode step reads half the bytes of keys and values and the cache holds twice the tokens; at 256 sequences of 768 tokens decoding reads more KV cache than weights. Attention then reads keys and values rounded to FP8, so, as with quantization, the rollouts come from a policy a little off the trainer's (algorithm.rolloutCorrection corrects for it). auto: model.dtype. vllm engine only (verl: rollout.engine_kwargs.vllm.kv_cache_dtype)."""
    max_staleness: int = Field(default=0, ge=0, le=1)
    """Policy versions a rollout may lag behind training. 0: each step generates with the latest weights, then trains (synchronous). 1: step t+1's rollouts are generated while step t trains (verl's one-step-off-policy, AReaL), so they come from the policy one update behind; the PPO ratio then uses the rollout's behaviour logprobs as the old policy."""
    calculate_log_probs: bool = False
    """Record every sampled token's behaviour log-prob (the records' response_logprobs, the UI's token shading) even where training doesn't read them. They are always computed with maxStaleness 1 or algorithm.rolloutCorrection; otherwise (on-policy) the trainer uses its own log-probs and the engine skips them (vLLM: ~0.6 s of a 4.4 s generation on an H200), and the records hold null (verl: rollout.calculate_log_probs)."""
    request_timeout_seconds: float = Field(default=900.0, gt=0)
    """A Generate call that takes longer is abandoned and its shard re-dispatched."""
    seed: int = 0
    """Sampling seed; each worker and step derives its own from it."""
    template: dict[str, Any] | None = None
    """Partial pod template merged into the rollout pods (nodeSelector, tolerations, volumes, env...)."""
    multi_turn: MultiTurnSpec = MultiTurnSpec()
    """Multi-turn, tool-using rollouts (the agent loop)."""
    agent_loop: str | None = Field(default=None, pattern=r"^.+:[A-Za-z_][A-Za-z0-9_]*$")
    """A custom agent loop for environments that aren't tool calls (games, simulated users), `module:Class` or `path/file.py:Class` (verl: a registered AgentLoop). The rollout server builds `Class(spec, engine, tokenizer)` once and calls its `generate(prompts, params)` for every request, as it calls the engine's (docs/ARCHITECTURE.md, "Custom agent loops"). Not with multiTurn.enable."""


class SaveBest(_Model):
    metric: str = Field(default="val/score", min_length=1)
    """The step metric (as metrics.jsonl names it) that ranks the steps; steps without it (no validation) are not ranked."""
    mode: Literal["max", "min"] = "max"
    """Whether a larger or a smaller value is better."""


class TrainerSpec(_Model):
    project_name: str = Field(default="grpo", min_length=1)
    """Project, the first part of the local run directory; the W&B project and the MLflow experiment (verl: trainer.project_name)."""
    experiment_name: str = Field(default="run", min_length=1)
    """Experiment, the second part of the local run directory; the W&B and MLflow run name (verl: trainer.experiment_name)."""
    nnodes: int = Field(default=1, ge=1)
    """Trainer nodes (pods) (verl: trainer.nnodes)."""
    nproc_per_node: int = Field(default=1, ge=1, alias="nprocPerNode")
    """Trainer processes (GPUs) per node (verl: trainer.n_gpus_per_node)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Training device; auto picks cuda when available."""
    mini_batch_size: int = Field(default=256, ge=1)
    """Prompts per optimizer step (verl: actor.ppo_mini_batch_size)."""
    micro_batch_size_per_gpu: int = Field(default=8, ge=1, alias="microBatchSizePerGPU")
    """Responses per forward/backward on one GPU (verl: actor.ppo_micro_batch_size_per_gpu)."""
    max_tokens_per_gpu: int | None = Field(default=None, ge=1, alias="maxTokensPerGPU")
    """Token budget per micro-batch: when set, micro-batches are formed by tokens, not count (verl: ppo_max_token_len_per_gpu with use_dynamic_bsz)."""
    log_prob_max_tokens_per_gpu: int | None = Field(default=None, ge=1, alias="logProbMaxTokensPerGPU")
    """Token budget per micro-batch of the forward-only passes (old and reference log-probs), which keep no activations for a backward pass and so fit larger ones; null: the update's micro-batches (verl: ref/rollout.log_prob_max_token_len_per_gpu with use_dynamic_bsz)."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each rollout batch (verl: actor.ppo_epochs)."""
    lr: float = Field(default=1e-6, ge=0.0)
    """Learning rate (verl: actor.optim.lr); 0 freezes the policy (a control run)."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps (verl: actor.optim.lr_warmup_steps)."""
    lr_warmup_steps_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Linear warmup over int(ratio x the run's total steps), for lrWarmupSteps 0 (verl: actor.optim.lr_warmup_steps_ratio)."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warmup (verl: actor.optim.warmup_style)."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    """AdamW weight decay (verl: actor.optim.weight_decay)."""
    grad_clip: float = Field(default=1.0, gt=0.0)
    """Max gradient norm (verl: actor.grad_clip)."""
    total_epochs: int = Field(default=1, ge=1)
    """Passes over the training set (verl: trainer.total_epochs)."""
    total_steps: int | None = Field(default=None, ge=1)
    """Overrides totalEpochs when set (verl: trainer.total_training_steps)."""
    test_freq: int = Field(default=-1, ge=-1)
    """Validate every N steps (and at the end); -1 never (verl: trainer.test_freq)."""
    val_before_train: bool = True
    """Validate once before the first step (verl: trainer.val_before_train)."""
    val_only: bool = False
    """Validate the loaded (or resumed) policy once, log val/score, and exit: no step, no checkpoint, no export (verl: trainer.val_only). Needs data.valFiles."""
    save_freq: int = Field(default=-1, ge=-1)
    """Checkpoint every N steps (and at the end); -1 only at the end (verl: trainer.save_freq)."""
    critic_warmup: int = Field(default=0, ge=0)
    """With advEstimator gae: the first N steps train only the critic, the policy stays as it is (verl:
    trainer.critic_warmup, which compares with its 1-based step count: verl's N is N-1 here)."""
    keep_checkpoints: int | None = Field(default=2, ge=1)
    """Complete checkpoints kept; older ones are deleted; null keeps all (verl: max_actor_ckpt_to_keep)."""
    save_best: SaveBest | None = None
    """Keep the best step's checkpoint whatever keepCheckpoints deletes, and export that policy as hf/best (the tutorial's "validate regularly, keep the best model"): a step that beats the best so far is checkpointed then, whatever saveFreq says. Null: off."""
    ref_cpu_offload: bool = False
    """Keep the frozen reference model's shards in CPU memory (verl: ref.fsdp_config.param_offload)."""
    param_offload: bool = False
    """With rollout.placement colocated: the policy's parameters leave the GPUs (to CPU memory) while the rollout engines generate and come back for the update, so that the engines' KV cache can take their room (a higher rollout.gpuMemoryUtilization); timed as timing_s/offload and timing_s/onload (verl: actor.fsdp_config.param_offload)."""
    optimizer_offload: bool = False
    """With rollout.placement colocated: the policy's optimizer state leaves the GPUs while the rollout engines generate, as paramOffload (verl: actor.fsdp_config.optimizer_offload)."""
    freeze_vision_tower: bool = False
    """A vision-language policy's vision tower stays as loaded: no gradients, no optimizer state (verl: actor.freeze_vision_tower). Ignored for a model without one."""
    use_torch_compile: bool = True
    """Compile each decoder layer with torch.compile when training on GPU (verl: actor.use_torch_compile); the first step pays the compilation. Ignored on CPU."""
    loggers: list[Literal["console", "jsonl", "tensorboard", "prometheus", "wandb", "mlflow"]] = ["console", "jsonl"]
    """Where metrics go (verl: trainer.logger). wandb and mlflow read their credentials and endpoints from the standard environment variables (WANDB_API_KEY, WANDB_MODE, WANDB_BASE_URL, MLFLOW_TRACKING_URI, ...); a resumed job continues the same tracker run."""
    tracker_secret_ref: str | None = Field(default=None, pattern=SECRET_NAME_PATTERN, max_length=253)
    """Secret whose keys become the trainer pods' environment variables (WANDB_API_KEY, WANDB_BASE_URL, MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, ...), for the wandb and mlflow loggers; never put credentials in the spec."""
    seed: int = 42
    """Seed for model init-free randomness (dropout, sampling order is data.seed)."""
    template: dict[str, Any] | None = None
    """Partial pod template merged into the trainer pods (nodeSelector, tolerations, volumes, env...)."""


class StorageSpec(_Model):
    uri: str | None = Field(default=None, pattern=r"^(file|s3)://.+")
    """Where prompts, rollouts, checkpoints and progress go (file:// or s3://); the job's files live under <uri>/<namespace>/<job>/<uid>/ on Kubernetes (status.runUri), <uri>/<namespace>/<job>/ with `grpo run`. Local default: file://./outputs/<project>/<experiment>."""
    endpoint: str | None = Field(default=None, pattern=r"^https?://.+")
    """S3-compatible endpoint URL (leave empty for AWS)."""
    region: str | None = None
    """S3 region."""
    secret_ref: str | None = None
    """Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; never put credentials in the spec."""
    keep_rollouts_steps: int | None = Field(default=None, ge=1)
    """Keep the rollouts (rollouts/step-N/ and prompts/step-N/) of the last N trained steps only: after each step the trainer deletes older step folders, and records them in rollouts/retention.json, which `grpo rollouts export` and `grpo ui` show. Always kept: step C+1 of every kept checkpoint C, which a resume from C (its batch generated ahead, with rollout.maxStaleness 1) and `grpo replay --step C+1` read. null: keep every step."""
    compile_cache: bool = True
    """Keep the trainer's compile caches (torch.compile's and Triton's kernels) in the job's run (<run>/compile-cache/), signed with the job's checkpoint key as its checkpoints are: a restarted trainer pod, or `grpo run` run again, skips compiling in its first steps. GPU with trainer.useTorchCompile only; a cache that can't be read, written or verified only costs the compile."""


class WeightSyncSpec(_Model):
    backend: Literal["nccl", "grpc"] = "nccl"
    """nccl: a collective from trainer rank 0 to the rollout servers (gloo on CPU); grpc: streamed chunks, works anywhere."""
    bucket_size_mb: int = Field(default=512, ge=1, le=4096)
    """Bytes per bucket: bounds the memory a weight update needs on both sides."""
    timeout_seconds: float = Field(default=600.0, gt=0)
    """A weight update that takes longer fails; the worker is re-synced before it generates again."""


class SchedulingPolicy(_Model):
    """Gang scheduling of the trainer pods, named as Kubeflow Training Operator's
    runPolicy.schedulingPolicy. torchrun's rendezvous needs every node, so the gang is always all
    of them (minMember = trainer.nnodes): there is no minAvailable."""

    schedule_timeout_seconds: int | None = Field(default=None, ge=1)
    """How long the scheduler holds the trainer pods it could place while it waits for room for all of them, before it releases them and tries again (the PodGroup's scheduleTimeoutSeconds); null: the scheduler's default."""
    priority_class: str | None = Field(default=None, min_length=1)
    """PriorityClass of the trainer pods; a spec.trainer.template priorityClassName wins."""


class RunPolicy(_Model):
    backoff_limit: int = Field(default=3, ge=0)
    """Trainer restarts before the job is Failed."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the job this long after it finished."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the job when it has been running this long."""
    pending_deadline_seconds: int | None = Field(default=900, ge=1)
    """Fail the job when its pods stay Pending (unschedulable, image pull errors) this long."""
    suspend: bool = False
    """Remove the pods after a checkpoint; false resumes from it."""
    scheduling_policy: SchedulingPolicy | None = None
    """Gang-schedule the trainer pods: a PodGroup (scheduler-plugins coscheduling, scheduling.x-k8s.io/v1alpha1) for all trainer.nnodes pods, which run under the operator's gang scheduler, so a multi-node trainer never holds some nodes' GPUs while it waits for the rest. Null: the default scheduler, pod by pod. Takes effect at the next trainer attempt."""


class GRPOJobSpec(_Model):
    model: ModelSpec
    """The policy model."""
    data: DataSpec
    """Datasets and lengths."""
    algorithm: AlgorithmSpec = AlgorithmSpec()
    """Advantage estimator and loss."""
    reward: RewardSpec = RewardSpec()
    """Reward function."""
    rollout: RolloutSpec = RolloutSpec()
    """Generation servers and sampling."""
    trainer: TrainerSpec = TrainerSpec()
    """The learner."""
    critic: CriticSpec = CriticSpec()
    """PPO's value model (advEstimator gae only)."""
    storage: StorageSpec = StorageSpec()
    """Object storage for exchange and checkpoints."""
    weight_sync: WeightSyncSpec = WeightSyncSpec()
    """How new weights reach the rollout servers."""
    resume: str = Field(default="auto", pattern=r"^(auto|never|(file|s3)://.+)$")
    """auto: latest complete checkpoint; never; or one of this job's checkpoints (<uri>/<ns>/<job>/checkpoints/step-N)."""
    run_policy: RunPolicy = RunPolicy()
    """Restarts, deadlines, suspension, gang scheduling."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "GRPOJobSpec":
        # Every violated rule is reported at once; `grpo_api.jobfile` splits them back into
        # one entry per field.
        errors = [e for rule in CROSS_FIELD_RULES if (e := rule.check(self))]
        if errors:
            raise PydanticCustomError("cross_field", "{errors}", {"errors": errors})
        return self

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.nproc_per_node

    @property
    def total_length(self) -> int:
        return self.data.max_prompt_length + self.data.max_response_length

    @property
    def colocated(self) -> bool:
        return self.rollout.placement == "colocated"

    @property
    def servers_per_node(self) -> int:
        """Colocated: the rollout servers each trainer pod runs, one per tensorParallelSize of its GPUs."""
        return self.trainer.nproc_per_node // self.rollout.tensor_parallel_size


class Phase(str, Enum):
    Pending = "Pending"
    Running = "Running"
    Restarting = "Restarting"
    Suspended = "Suspended"
    Succeeded = "Succeeded"
    Failed = "Failed"


class Condition(_Model):
    type: str
    """Condition type, e.g. Created, Running, Suspended, Succeeded, Failed, Invalid."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = ""
    """CamelCase machine-readable reason."""
    message: str = ""
    """Human-readable detail."""
    last_transition_time: str | None = None
    """When status last changed (RFC 3339)."""


class Progress(_Model):
    """progress.json, which trainer rank 0 rewrites every step (`to_json`) and the operator copies
    into the status (`from_json`): one model for the writer and the readers."""

    step: int = 0
    """Completed training steps."""
    total_steps: int | None = None
    """Steps the run will make."""
    epoch: int = 0
    """Current epoch."""
    policy_version: int = 0
    """Version of the weights the rollout servers hold."""
    reward_mean: float | None = None
    """Mean reward of the last step."""
    reward_error_fraction: float | None = None
    """The share of the last step's samples whose reward function failed (each scored 0; by kind in
    metrics.jsonl's reward/errors/*)."""
    tool_error_fraction: float | None = None
    """With rollout.multiTurn: the share of the last step's tool calls that failed (by kind in
    metrics.jsonl's tool_calls/errors/*)."""
    validation_score: float | None = None
    """Last validation accuracy (mean reward, greedy)."""
    last_checkpoint: str | None = None
    """URI of the latest complete checkpoint."""
    best_step: int | None = None
    """With trainer.saveBest: the best step so far (its checkpoint is kept, its policy is hf/best)."""
    best_score: float | None = None
    """With trainer.saveBest: that step's trainer.saveBest.metric."""
    resumed_from_step: int | None = None
    """The step the trainer's latest start continued from (after a restart, suspend or
    preemption Step goes back to it); None for a run that started afresh."""
    resumed_at: str | None = None
    """When that start was (RFC 3339)."""

    def to_json(self) -> bytes:
        """progress.json as the trainer writes it: the status' camelCase keys, unset ones left out."""
        return self.model_dump_json(by_alias=True, exclude_none=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Progress | None":
        """A progress.json document, or None if unreadable (never an exception: a reconcile must not
        fail on it). A trainer of another version may have written it: keys this model doesn't have
        are dropped (pydantic takes the whole floats older trainers wrote for ints)."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(doc, dict):
            return None
        fields = {f.alias or name for name, f in cls.model_fields.items()}
        try:
            return cls.model_validate({k: v for k, v in doc.items() if k in fields and v is not None})
        except ValueError:       # pydantic's ValidationError is one
            return None


class GRPOJobStatus(_Model):
    phase: Phase = Phase.Pending
    """Pending, Running, Restarting, Suspended, Succeeded or Failed."""
    conditions: list[Condition] = []
    """Latest observations of the job's state."""
    progress: Progress | None = None
    """Training progress from the trainer's progress.json."""
    restarts: int = 0
    """Trainer restarts so far."""
    start_time: str | None = None
    """When the trainer first started."""
    completion_time: str | None = None
    """When the job finished."""
    observed_generation: int | None = None
    """The spec generation the status describes."""
    reason: str | None = None
    """Why the job is in its phase, when something is wrong or it waits: the reason of its
    Failed, Invalid, SecretMissing, PodsPending, Queued, Suspended, TrainerFailed or
    ProgressUnreadable condition, the first of them that holds (`kubectl get gj -o wide`)."""
    rollout_replicas: int = 0
    """Ready rollout servers (`kubectl scale gj NAME --replicas=N` sets spec.rollout.replicas)."""
    run_uri: str | None = None
    """Where this job's files are (checkpoints, rollouts, metrics, the exported model):
    `<storage.uri>/<namespace>/<name>/<uid>`."""


# A DNS label short enough for the children's names (`<name>-trainer-0`, the pods' hostnames) and
# for the `grpo.dev/job=<name>` label value (<= 63 characters).
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 50


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(default="grpojob", pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH)
    namespace: str = "default"
    uid: str | None = None
    """Set by Kubernetes. A job on Kubernetes keeps its files under its uid, so a job deleted and
    applied again under the same name starts a new run (grpo_api.storage.job_root)."""


class GRPOJob(_Model):
    api_version: Literal["grpo.dev/v1alpha1"] = "grpo.dev/v1alpha1"
    kind: Literal["GRPOJob"] = "GRPOJob"
    metadata: ObjectMeta = ObjectMeta()
    spec: GRPOJobSpec
    status: GRPOJobStatus | None = None


# --- cross-field rules: one Python check and one CEL expression each -------------------------

@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over several fields. `cel` runs in the API server on `spec` (with defaults applied);
    `python` returns an error message or None. `field` is the path named in both errors."""

    field: str
    cel: str
    message: str
    python: Callable[[GRPOJobSpec], str | None]

    def check(self, spec: GRPOJobSpec) -> str | None:
        detail = self.python(spec)
        return f"spec.{self.field}: {detail}" if detail else None


def _group_needs_n(s: GRPOJobSpec) -> str | None:
    if s.algorithm.adv_estimator.value in GROUP_ESTIMATORS and s.rollout.n < 2:
        return f"must be >= 2 for advEstimator {s.algorithm.adv_estimator.value} (got {s.rollout.n})"
    return None


def _warmup_one_way(section: str) -> Callable[[GRPOJobSpec], str | None]:
    # verl silently lets lr_warmup_steps > 0 override the ratio; here setting both is an error, so
    # nobody believes a ratio is in effect when it isn't.
    def check(s: GRPOJobSpec) -> str | None:
        part = getattr(s, section)
        if part.lr_warmup_steps > 0 and part.lr_warmup_steps_ratio > 0:
            return (f"set lrWarmupSteps or lrWarmupStepsRatio, not both (got {part.lr_warmup_steps} and "
                    f"{part.lr_warmup_steps_ratio})")
        return None
    return check


def _val_only_needs_val_files(s: GRPOJobSpec) -> str | None:
    if s.trainer.val_only and not s.data.val_files:
        return "needs data.valFiles: a validation-only run validates on them"
    return None


def _lora_needs_rank(s: GRPOJobSpec) -> str | None:
    lora = s.model.lora
    if lora and lora.rank is None and lora.adapter_path is None:
        return "required (or set adapterPath: the adapter's own rank is used)"
    return None


def _rs_needs_threshold(s: GRPOJobSpec) -> str | None:
    rc = s.algorithm.rollout_correction
    if rc and rc.rollout_rs and rc.rollout_rs_threshold is None:
        return f"must be set with rolloutRs {rc.rollout_rs}"
    return None


def _bypass_alone(s: GRPOJobSpec) -> str | None:
    rc = s.algorithm.rollout_correction
    if rc and rc.bypass_mode and (rc.rollout_is or rc.rollout_rs):
        return ("bypassMode takes the engine's log-probs as the old policy: there is no pi_old / pi_rollout left "
                "to weight or reject; unset rolloutIs and rolloutRs, or bypassMode")
    return None


def _mini_divides_batch(s: GRPOJobSpec) -> str | None:
    if s.data.train_batch_size % s.trainer.mini_batch_size:
        return (f"must divide data.trainBatchSize (got miniBatchSize {s.trainer.mini_batch_size}, "
                f"trainBatchSize {s.data.train_batch_size})")
    return None


def _mini_splits_over_ranks(s: GRPOJobSpec) -> str | None:
    responses = s.trainer.mini_batch_size * s.rollout.n
    if responses % s.world_size:
        return (f"miniBatchSize x rollout.n ({responses} responses) must split evenly over "
                f"nnodes x nprocPerNode ({s.world_size}) trainer processes")
    return None


def _micro_fits_mini(s: GRPOJobSpec) -> str | None:
    per_rank = s.trainer.mini_batch_size * s.rollout.n // s.world_size
    if s.trainer.micro_batch_size_per_gpu > max(per_rank, 1):
        return (f"must be <= the mini-batch's responses per GPU, miniBatchSize x rollout.n / "
                f"(nnodes x nprocPerNode) = {per_rank} (got {s.trainer.micro_batch_size_per_gpu})")
    return None


def _lengths_bounded(s: GRPOJobSpec) -> str | None:
    if s.total_length > MAX_TOTAL_LENGTH:
        return f"maxPromptLength + maxResponseLength must be <= {MAX_TOTAL_LENGTH} (got {s.total_length})"
    return None


def _fits_sequence(budget: int | None, s: GRPOJobSpec) -> str | None:
    if budget is not None and budget < s.total_length:
        return (f"must be >= maxPromptLength + maxResponseLength ({s.total_length}) so one "
                f"sequence fits a micro-batch (got {budget})")
    return None


def _budget_fits_sequence(s: GRPOJobSpec) -> str | None:
    return _fits_sequence(s.trainer.max_tokens_per_gpu, s)


def _log_prob_budget_fits_sequence(s: GRPOJobSpec) -> str | None:
    return _fits_sequence(s.trainer.log_prob_max_tokens_per_gpu, s)


def _sequence_loss_needs_seq_mean(s: GRPOJobSpec) -> str | None:
    loss = s.algorithm.policy_loss
    if loss in SEQUENCE_LOSSES and s.algorithm.loss_agg_mode != "seq-mean-token-mean":
        return (f"must be seq-mean-token-mean with policyLoss {loss}: its objective is a mean over "
                f"sequences (got {s.algorithm.loss_agg_mode})")
    return None


def _clip_cov_bounds_ordered(s: GRPOJobSpec) -> str | None:
    c = s.algorithm.policy_loss_config
    if c.clip_cov_ub <= c.clip_cov_lb:
        return f"must be > clipCovLb: no covariance lies between them (got {c.clip_cov_ub} <= {c.clip_cov_lb})"
    return None


def _dro_needs_beta(s: GRPOJobSpec) -> str | None:
    if s.algorithm.policy_loss == "dro" and s.algorithm.policy_loss_config.dro_beta is None:
        return "required with policyLoss dro: the weight of its quadratic log-ratio penalty"
    return None


def _geo_mean_sequence_weights(s: GRPOJobSpec) -> str | None:
    rc = s.algorithm.rollout_correction
    if s.algorithm.policy_loss == "geo_mean" and rc and rc.rollout_is == "token":
        return ("token weights with policyLoss geo_mean: GMPO weights a response by the geometric mean of its "
                "token weights, which is not built; use rolloutIs sequence")
    return None


def _overlong_buffer_fits(s: GRPOJobSpec) -> str | None:
    buffer = s.reward.overlong_buffer
    if buffer.enable and not 0 < buffer.len <= s.data.max_response_length:
        return (f"must be in 1..data.maxResponseLength ({s.data.max_response_length}) when overlongBuffer.enable "
                f"is true: the penalty grows over the last len tokens of a response (got {buffer.len})")
    return None


def _filter_groups_needs_groups(s: GRPOJobSpec) -> str | None:
    if s.algorithm.filter_groups and s.rollout.n < 2:
        return (f"needs rollout.n >= 2: a group of one sample never has unequal rewards, so every step "
                f"would generate 10 rounds in vain (got n {s.rollout.n})")
    return None


def _one_agent_loop(s: GRPOJobSpec) -> str | None:
    if s.rollout.agent_loop is not None and s.rollout.multi_turn.enable:
        return "a custom agent loop and rollout.multiTurn.enable (the tool agent loop) exclude each other"
    return None


def _reward_model_names_unique(s: GRPOJobSpec) -> str | None:
    names = [m.name for m in s.reward.reward_models]
    twice = sorted({n for n in names if names.count(n) > 1})
    return f"names must be unique (twice: {', '.join(twice)})" if twice else None


def _weighted_has_weight(s: GRPOJobSpec) -> str | None:
    r = s.reward
    if r.combine == "weighted" and r.reward_models and r.rule_weight == 0 and not any(m.weight for m in r.reward_models):
        return "ruleWeight and every reward model's weight are 0: combine weighted divides by their sum"
    return None


def is_local_folder(path: str | None) -> bool:
    return path is not None and path.startswith(("/", "./", "../"))


def _cache_has_something_to_fetch(s: GRPOJobSpec) -> str | None:
    m = s.model
    if m.cache and is_local_folder(m.path) and (m.tokenizer_path is None or is_local_folder(m.tokenizer_path)):
        return (f"nothing to fetch: model.path {m.path!r} is a folder the pods already see (give a hub id or an "
                f"s3:// folder, or drop model.cache)")
    return None


def _critic_needs_gae(s: GRPOJobSpec) -> str | None:
    # Compared with the defaults, not with what the YAML named: a resolved job (every default
    # written out) must read back the same, and the CRD's defaulting fills the section in too.
    if s.algorithm.adv_estimator != AdvEstimator.gae and s.critic != CriticSpec():
        return (f"is PPO's value model, used only with algorithm.advEstimator gae (got "
                f"{s.algorithm.adv_estimator.value}): remove the section or set advEstimator: gae")
    return None


def _critic_is_default_cel() -> str:
    """CEL: every field of spec.critic at its default (the API server has filled the defaults in)."""
    terms = []
    for name, field in CriticSpec.model_fields.items():
        path = f"self.critic.{field.alias or name}"
        default = field.get_default(call_default_factory=True)
        if default is None:
            terms.append(f"!has({path})")
        elif isinstance(default, (dict, list)) and not default:
            terms.append(f"(!has({path}) || size({path}) == 0)")
        else:
            terms.append(f"{path} == {json.dumps(default)}")
    return " && ".join(terms)


def _sandbox_needs_python_tool(s: GRPOJobSpec) -> str | None:
    mt = s.rollout.multi_turn
    if mt.python.replicas is not None and not (mt.enable and "python" in mt.tools):
        return ("sandbox servers run only the python tool: set rollout.multiTurn.enable and list python in "
                "rollout.multiTurn.tools, or remove replicas")
    return None


def _multi_turn_needs_tools(s: GRPOJobSpec) -> str | None:
    mt = s.rollout.multi_turn
    if mt.enable and not mt.tools and mt.tool_config_path is None:
        return "enable needs at least one tool (tools, or toolConfigPath)"
    return None


def _quantization_needs_vllm(s: GRPOJobSpec) -> str | None:
    if s.rollout.quantization is not None and s.rollout.engine != "vllm":
        return (f"{s.rollout.quantization} rollouts need rollout.engine vllm (the hf engine generates in "
                f"model.dtype) (got engine {s.rollout.engine})")
    return None


def _kv_cache_dtype_needs_vllm(s: GRPOJobSpec) -> str | None:
    if s.rollout.kv_cache_dtype != "auto" and s.rollout.engine != "vllm":
        return (f"an {s.rollout.kv_cache_dtype} KV cache needs rollout.engine vllm (the hf engine keeps it in "
                f"model.dtype) (got engine {s.rollout.engine})")
    return None


def _offload_needs_colocated(s: GRPOJobSpec) -> str | None:
    t = s.trainer
    if (t.param_offload or t.optimizer_offload) and not (s.colocated and s.rollout.max_staleness == 0):
        return ("paramOffload and optimizerOffload move the policy off the GPUs while the rollout engines generate "
                "on them: they need rollout.placement colocated and rollout.maxStaleness 0 (else nothing shares "
                "the GPUs, or generation overlaps the update)")
    return None


def _colocated_tp_divides(s: GRPOJobSpec) -> str | None:
    tp, nproc = s.rollout.tensor_parallel_size, s.trainer.nproc_per_node
    if s.colocated and nproc % tp:
        return (f"must divide trainer.nprocPerNode with placement colocated: each trainer pod runs one rollout "
                f"server per tensorParallelSize of its GPUs (got tensorParallelSize {tp}, nprocPerNode {nproc})")
    return None


def _colocated_replicas_derived(s: GRPOJobSpec) -> str | None:
    if not s.colocated or s.trainer.nproc_per_node % s.rollout.tensor_parallel_size:
        return None
    derived = s.trainer.nnodes * s.servers_per_node
    if s.rollout.replicas != derived:
        return (f"must be nnodes x nprocPerNode / tensorParallelSize = {derived} with placement colocated (the "
                f"trainer pods run the servers on their own GPUs; set it to {derived}) (got {s.rollout.replicas})")
    return None


_LOCAL_PATH = "{0}.startsWith('/') || {0}.startsWith('./') || {0}.startsWith('../')"
_GROUP_LIST = "[" + ", ".join(f"'{e}'" for e in GROUP_ESTIMATORS) + "]"
_SEQUENCE_LOSS_LIST = "[" + ", ".join(f"'{e}'" for e in SEQUENCE_LOSSES) + "]"

CROSS_FIELD_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        "rollout.quantization",
        "!has(self.rollout.quantization) || self.rollout.engine == 'vllm'",
        "rollout.quantization needs rollout.engine vllm",
        _quantization_needs_vllm),
    CrossFieldRule(
        "rollout.kvCacheDtype",
        "!has(self.rollout.kvCacheDtype) || self.rollout.kvCacheDtype == 'auto' || self.rollout.engine == 'vllm'",
        "rollout.kvCacheDtype fp8 needs rollout.engine vllm",
        _kv_cache_dtype_needs_vllm),
    CrossFieldRule(
        "trainer.paramOffload",
        "!(self.trainer.paramOffload || self.trainer.optimizerOffload) || "
        "(self.rollout.placement == 'colocated' && self.rollout.maxStaleness == 0)",
        "trainer.paramOffload and trainer.optimizerOffload need rollout.placement colocated and rollout.maxStaleness 0",
        _offload_needs_colocated),
    CrossFieldRule(
        "rollout.tensorParallelSize",
        "self.rollout.placement != 'colocated' || self.rollout.tensorParallelSize < 1 || "
        "self.trainer.nprocPerNode % self.rollout.tensorParallelSize == 0",
        "rollout.tensorParallelSize must divide trainer.nprocPerNode with placement colocated",
        _colocated_tp_divides),
    CrossFieldRule(
        "rollout.replicas",
        "self.rollout.placement != 'colocated' || self.rollout.tensorParallelSize < 1 || "
        "self.trainer.nprocPerNode % self.rollout.tensorParallelSize != 0 || "
        "self.rollout.replicas == self.trainer.nnodes * (self.trainer.nprocPerNode / self.rollout.tensorParallelSize)",
        "rollout.replicas must be nnodes x nprocPerNode / tensorParallelSize with placement colocated "
        "(the trainer pods run the rollout servers; a colocated job can't be scaled)",
        _colocated_replicas_derived),
    CrossFieldRule(
        "rollout.multiTurn.tools",
        "!self.rollout.multiTurn.enable || size(self.rollout.multiTurn.tools) > 0 || "
        "has(self.rollout.multiTurn.toolConfigPath)",
        "rollout.multiTurn.enable needs at least one tool (tools, or toolConfigPath)",
        _multi_turn_needs_tools),
    CrossFieldRule(
        "critic",
        f"self.algorithm.advEstimator == 'gae' || ({_critic_is_default_cel()})",
        "critic is PPO's value model, used only with algorithm.advEstimator gae",
        _critic_needs_gae),
    CrossFieldRule(
        "rollout.multiTurn.python.replicas",
        "!has(self.rollout.multiTurn.python.replicas) || "
        "(self.rollout.multiTurn.enable && 'python' in self.rollout.multiTurn.tools)",
        "rollout.multiTurn.python.replicas needs the python tool (multiTurn.enable and python in multiTurn.tools)",
        _sandbox_needs_python_tool),
    CrossFieldRule(
        "rollout.n",
        f"!(self.algorithm.advEstimator in {_GROUP_LIST}) || self.rollout.n >= 2",
        f"rollout.n must be >= 2 for group estimators ({', '.join(GROUP_ESTIMATORS)})",
        _group_needs_n),
    CrossFieldRule(
        "algorithm.rolloutCorrection.rolloutRsThreshold",
        "!has(self.algorithm.rolloutCorrection) || size(self.algorithm.rolloutCorrection.rolloutRs) == 0 || "
        "has(self.algorithm.rolloutCorrection.rolloutRsThreshold)",
        "algorithm.rolloutCorrection.rolloutRsThreshold must be set with rolloutRs",
        _rs_needs_threshold),
    CrossFieldRule(
        "algorithm.rolloutCorrection.bypassMode",
        "!has(self.algorithm.rolloutCorrection) || !self.algorithm.rolloutCorrection.bypassMode || "
        "(!has(self.algorithm.rolloutCorrection.rolloutIs) && size(self.algorithm.rolloutCorrection.rolloutRs) == 0)",
        "algorithm.rolloutCorrection.bypassMode excludes rolloutIs and rolloutRs",
        _bypass_alone),
    CrossFieldRule(
        "trainer.lrWarmupStepsRatio",
        "self.trainer.lrWarmupSteps == 0 || self.trainer.lrWarmupStepsRatio == 0.0",
        "set trainer.lrWarmupSteps or trainer.lrWarmupStepsRatio, not both",
        _warmup_one_way("trainer")),
    CrossFieldRule(
        "critic.lrWarmupStepsRatio",
        "self.critic.lrWarmupSteps == 0 || self.critic.lrWarmupStepsRatio == 0.0",
        "set critic.lrWarmupSteps or critic.lrWarmupStepsRatio, not both",
        _warmup_one_way("critic")),
    CrossFieldRule(
        "trainer.valOnly",
        "!self.trainer.valOnly || size(self.data.valFiles) > 0",
        "trainer.valOnly needs data.valFiles",
        _val_only_needs_val_files),
    CrossFieldRule(
        "model.lora.rank",
        "!has(self.model.lora) || has(self.model.lora.rank) || has(self.model.lora.adapterPath)",
        "model.lora.rank is required unless model.lora.adapterPath is set",
        _lora_needs_rank),
    CrossFieldRule(
        "trainer.miniBatchSize",
        # (a batch size < 1 is its own field's error: not this one too)
        "self.data.trainBatchSize < 1 || self.trainer.miniBatchSize < 1 || "
        "self.data.trainBatchSize % self.trainer.miniBatchSize == 0",
        "trainer.miniBatchSize must divide data.trainBatchSize",
        _mini_divides_batch),
    CrossFieldRule(
        "trainer.nprocPerNode",
        "self.trainer.miniBatchSize < 1 || self.rollout.n < 1 || self.trainer.nnodes < 1 || "
        "self.trainer.nprocPerNode < 1 || "
        "(self.trainer.miniBatchSize * self.rollout.n) % (self.trainer.nnodes * self.trainer.nprocPerNode) == 0",
        "trainer.miniBatchSize x rollout.n must split evenly over nnodes x nprocPerNode",
        _mini_splits_over_ranks),
    CrossFieldRule(
        "trainer.microBatchSizePerGPU",
        "self.trainer.microBatchSizePerGPU <= 1 || self.trainer.miniBatchSize < 1 || self.rollout.n < 1 || "
        "self.trainer.microBatchSizePerGPU * "
        "self.trainer.nnodes * self.trainer.nprocPerNode <= self.trainer.miniBatchSize * self.rollout.n",
        "trainer.microBatchSizePerGPU must be <= miniBatchSize x rollout.n / (nnodes x nprocPerNode)",
        _micro_fits_mini),
    CrossFieldRule(
        "data.maxResponseLength",
        f"self.data.maxPromptLength + self.data.maxResponseLength <= {MAX_TOTAL_LENGTH}",
        f"data.maxPromptLength + data.maxResponseLength must be <= {MAX_TOTAL_LENGTH}",
        _lengths_bounded),
    CrossFieldRule(
        "trainer.maxTokensPerGPU",
        "!has(self.trainer.maxTokensPerGPU) || "
        "self.trainer.maxTokensPerGPU >= self.data.maxPromptLength + self.data.maxResponseLength",
        "trainer.maxTokensPerGPU must be >= data.maxPromptLength + data.maxResponseLength",
        _budget_fits_sequence),
    CrossFieldRule(
        "trainer.logProbMaxTokensPerGPU",
        "!has(self.trainer.logProbMaxTokensPerGPU) || "
        "self.trainer.logProbMaxTokensPerGPU >= self.data.maxPromptLength + self.data.maxResponseLength",
        "trainer.logProbMaxTokensPerGPU must be >= data.maxPromptLength + data.maxResponseLength",
        _log_prob_budget_fits_sequence),
    CrossFieldRule(
        "algorithm.lossAggMode",
        f"!(self.algorithm.policyLoss in {_SEQUENCE_LOSS_LIST}) || self.algorithm.lossAggMode == 'seq-mean-token-mean'",
        f"algorithm.lossAggMode must be seq-mean-token-mean with policyLoss {', '.join(SEQUENCE_LOSSES)}",
        _sequence_loss_needs_seq_mean),
    CrossFieldRule(
        "algorithm.policyLossConfig.clipCovUb",
        "self.algorithm.policyLossConfig.clipCovUb > self.algorithm.policyLossConfig.clipCovLb",
        "algorithm.policyLossConfig.clipCovUb must be > clipCovLb",
        _clip_cov_bounds_ordered),
    CrossFieldRule(
        "algorithm.policyLossConfig.droBeta",
        "self.algorithm.policyLoss != 'dro' || has(self.algorithm.policyLossConfig.droBeta)",
        "algorithm.policyLossConfig.droBeta is required with policyLoss dro",
        _dro_needs_beta),
    CrossFieldRule(
        "algorithm.rolloutCorrection.rolloutIs",
        "self.algorithm.policyLoss != 'geo_mean' || !has(self.algorithm.rolloutCorrection) || "
        "!has(self.algorithm.rolloutCorrection.rolloutIs) || self.algorithm.rolloutCorrection.rolloutIs != 'token'",
        "algorithm.rolloutCorrection.rolloutIs token is not built for policyLoss geo_mean; use sequence",
        _geo_mean_sequence_weights),
    CrossFieldRule(
        "reward.overlongBuffer.len",
        "!self.reward.overlongBuffer.enable || "
        "(self.reward.overlongBuffer.len >= 1 && self.reward.overlongBuffer.len <= self.data.maxResponseLength)",
        "reward.overlongBuffer.len must be in 1..data.maxResponseLength when overlongBuffer.enable is true",
        _overlong_buffer_fits),
    CrossFieldRule(
        "rollout.agentLoop",
        "!has(self.rollout.agentLoop) || !self.rollout.multiTurn.enable",
        "rollout.agentLoop and rollout.multiTurn.enable exclude each other",
        _one_agent_loop),
    CrossFieldRule(
        "reward.rewardModels",
        "self.reward.rewardModels.all(a, self.reward.rewardModels.exists_one(b, b.name == a.name))",
        "reward.rewardModels: names must be unique",
        _reward_model_names_unique),
    CrossFieldRule(
        "reward.ruleWeight",
        "self.reward.combine != 'weighted' || size(self.reward.rewardModels) == 0 || "
        "self.reward.ruleWeight > 0.0 || self.reward.rewardModels.exists(m, m.weight > 0.0)",
        "reward.ruleWeight and the reward models' weights must not all be 0 with combine weighted",
        _weighted_has_weight),
    CrossFieldRule(
        "algorithm.filterGroups",
        "!self.algorithm.filterGroups || self.rollout.n >= 2",
        "algorithm.filterGroups needs rollout.n >= 2 (a group of one sample never has unequal rewards)",
        _filter_groups_needs_groups),
    CrossFieldRule(
        "model.cache",
        f"!has(self.model.cache) || !({_LOCAL_PATH.format('self.model.path')}) || "
        f"(has(self.model.tokenizerPath) && !({_LOCAL_PATH.format('self.model.tokenizerPath')}))",
        "model.cache has nothing to fetch when model.path (and tokenizerPath) are folders the pods already see",
        _cache_has_something_to_fetch),
)

def _storage_reaches_every_pod(s: GRPOJobSpec) -> str | None:
    uri = s.storage.uri
    if uri is None:
        return ("required on Kubernetes (e.g. s3://bucket/prefix): the trainer and the rollout pods exchange "
                "prompts, rollouts and checkpoints through it")
    if uri.startswith("file://") and not uri.startswith("file:///"):
        return (f"a file:// URI must be absolute on Kubernetes (a volume mounted at the same path in every "
                f"pod) (got {uri!r})")
    return None


# Rules only a Kubernetes job must keep (a local `grpo run` defaults its storage): the CRD
# refuses them at `kubectl apply`, and the operator checks them for objects admitted before.
KUBERNETES_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        "storage.uri",
        "has(self.storage.uri) && "
        "(self.storage.uri.startsWith('s3://') || self.storage.uri.startsWith('file:///'))",
        "storage.uri is required on Kubernetes: an s3:// URI, or an absolute file:/// path on a volume every "
        "pod mounts (the pods exchange prompts, rollouts and checkpoints through it)",
        _storage_reaches_every_pod),
)

# What a running job honours a change of: the operator scales or rolls the rollout Deployment
# and enforces the run policy at every reconcile. The pods read the rest of the spec once, at
# start, so the CRD refuses changes to it (CEL transition rules on every other field).
MUTABLE_SPEC_FIELDS = ("rollout.replicas", "rollout.template", "runPolicy")
