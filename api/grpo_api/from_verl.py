"""`grpo from-verl`: a verl launch command or config, translated into the GRPOJob that trains the same.

`RULES` is the one table of what every verl key becomes; docs/MIGRATING_FROM_VERL.md shows it
(`grpo from-verl --markdown-table` prints it, and a test fails when the two drift). A rule is:

- `Map`: the key sets a GRPOJob field, through an optional converter that can refuse a value
  (`algorithm.adv_estimator=remax`) or warn. `absent` is verl's default, written when the input
  leaves the key out and verl's default differs from ours: the job is the one verl would run.
- `Ignore`: the key has no meaning here (verl performance and infrastructure knobs); a warning.
- `Check`: the key sets nothing itself but is read; its converter may warn or refuse.
- `Refuse`: a feature this operator doesn't have; an error unless the value is one of the `ok`
  values that mean "off" (`reward_model.enable=False` is accepted silently).

A key no rule names is a warning (verl would refuse a misspelled key; we say what we skipped).
Everything is validated with the GRPOJob model at the end; its errors name the verl key too.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from grpo_api.jobfile import JobError, K8sDumper, _child_model, parse_job
from grpo_api.spec import (API_GROUP, API_VERSION, KIND, SEQUENCE_LOSSES, AdvEstimator, GRPOJob, GRPOJobSpec, KLType,
                           PolicyLoss, TrainerSpec)
from grpo_api.verl_command import VerlConfig

MISSING: Any = object()
SKIP: Any = object()
NO_DEFAULT: Any = object()       # `absent` for a key verl requires: the converter picks a value


class Unsupported(ValueError):
    """The value needs a feature this operator doesn't have."""


@dataclass(frozen=True)
class Rule:
    verl: str                      # dotted verl key, or a prefix ending in ".*"
    kind: str                      # map | check | ignore | refuse
    field: str | None = None       # GRPOJob path under spec (camelCase), or "metadata.name"
    note: str = ""
    convert: Callable[[Any, "_Ctx"], Any] | None = None
    absent: Any = MISSING
    ok: tuple = ()


def Map(verl: str, field: str, note: str = "", convert=None, absent: Any = MISSING) -> Rule:
    return Rule(verl, "map", field, note, convert, absent)


def Check(verl: str, note: str, convert) -> Rule:
    """A key that sets nothing itself but is read: its converter warns or refuses."""
    return Rule(verl, "check", None, note, convert)


def Ignore(verl: str, note: str) -> Rule:
    return Rule(verl, "ignore", note=note)


def Refuse(verl: str, note: str, ok: tuple = ()) -> Rule:
    return Rule(verl, "refuse", note=note, ok=ok)


# verl's defaults for the keys converters consult that have no `absent` in RULES (where the
# other ones live); from verl's ppo_trainer.yaml.
_VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024, "data.max_response_length": 512, "trainer.nnodes": 1,
    "actor_rollout_ref.actor.use_dynamic_bsz": False, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": -1, "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "custom_reward_function.name": "compute_score", "trainer.resume_mode": "auto",
    "critic.use_dynamic_bsz": False, "critic.optim.lr_warmup_steps": -1,
    "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla", "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.entropy_coeff": 0,
}


class _Ctx:
    """What a converter sees: the whole verl config, the key at hand, and a way to warn."""

    def __init__(self, flat: dict[str, Any], expand_env: bool):
        self.flat = flat
        self.expand_env = expand_env
        self.key = self.shown = ""
        self.absent = False
        self.warnings: list[str] = []

    def get(self, key: str) -> Any:
        """The value verl runs with: the input's, else verl's default."""
        value = self.flat.get(key)
        if value is not None:
            return value
        absent = [r.absent for r in _EXACT.get(key, ()) if r.absent not in (MISSING, NO_DEFAULT)]
        return absent[0] if absent else _VERL_DEFAULTS[key]

    def number(self, key: str) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise Unsupported(f"{key}={value!r} is not a whole number (an environment variable left as "
                              f"written? pass --expand-env)")
        return value

    def has(self, key: str) -> bool:
        return self.flat.get(key) is not None

    def warn(self, message: str) -> None:
        self.warnings.append(f"{self.shown}: {message}")


# --- converters ---------------------------------------------------------------------------------

def _choice(allowed: dict[str, Any], refused: dict[str, str] | None = None, what: str = "value"):
    def convert(value, ctx):
        text = str(value)
        if text in allowed:
            return allowed[text]
        if refused and text in refused:
            raise Unsupported(refused[text])
        raise Unsupported(f"{text!r} is not a {what} here; supported: {', '.join(sorted(set(allowed)))}")
    return convert


def _uri(path: str, ctx) -> str:
    scheme = path.split("://", 1)[0] if "://" in path else ""
    if scheme in ("file", "s3", "builtin"):
        return path
    if scheme:
        raise Unsupported(f"{path}: {scheme}:// is not a storage scheme here; copy the file to s3:// or a "
                          f"local path (file://)")
    if path.startswith("~"):
        if ctx.expand_env:
            path = os.path.expanduser(path)
        else:
            ctx.warn("~ is left as written; pass --expand-env or write the full path")
    return "file://" + path


def _files(value, ctx):
    if value in ("", []):
        return SKIP
    return [_uri(str(p), ctx) for p in (value if isinstance(value, list) else [value])]


_LORA_ON = ("actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora.rank")


def _lora_on(ctx) -> bool:
    """verl trains LoRA when a rank > 0 or an adapter to start from is given."""
    return (any(isinstance(ctx.flat.get(k), int) and ctx.flat[k] > 0 for k in _LORA_ON)
            or ctx.has("actor_rollout_ref.model.lora_adapter_path"))


def _lora_rank(value, ctx):
    if int(value) == 0:
        return SKIP                                       # verl: 0 is full-parameter training
    return int(value)


def _lora_only(convert=None):
    """A LoRA setting: read only when LoRA is on (verl ignores it otherwise; we warn)."""
    def read(value, ctx):
        if not _lora_on(ctx):
            ctx.warn("ignored: only used with LoRA (lora_rank > 0 or lora_adapter_path)")
            return SKIP
        return convert(value, ctx) if convert else value
    return read


def _target_modules(value, ctx):
    """verl takes a list or one string ("all-linear", or comma-separated names)."""
    names = value if isinstance(value, list) else str(value).split(",")
    return [str(n).strip() for n in names if str(n).strip()]


def _exclude_modules(value, ctx):
    """verl passes exclude_modules to PEFT: a string is a regular expression matched against the
    whole module name; a list names modules or their dotted suffixes, which is this expression."""
    if isinstance(value, list):
        names = "|".join(re.escape(str(n).strip()) for n in value if str(n).strip())
        return rf"(?:.*\.)?(?:{names})" if names else SKIP
    return SKIP if _nullish(value) else str(value)


def _val_only(value, ctx):
    # verl's fit() returns after the validation before training, so without that validation it trains.
    if value and ctx.flat.get("trainer.val_before_train") is False:
        ctx.warn("trainer.val_only=True is ignored by verl with trainer.val_before_train=False (it trains): "
                 "so here too")
        return SKIP
    return bool(value) if value is not None else SKIP


def _adapter_path(value, ctx):
    path = str(value)
    if "://" in path and not path.startswith("file://"):
        raise Unsupported(f"{path}: the adapter is read from a local or mounted folder; copy it into the image "
                          f"or a volume (object storage is not fetched for adapters)")
    return path.removeprefix("file://")


def _dns_name(value, ctx):
    name = re.sub(r"[^a-z0-9-]+", "-", str(value).lower())
    name = re.sub(r"-+", "-", name).strip("-")[:50].rstrip("-")
    return name or "grpojob"


def _freq(value, ctx):
    return -1 if value is None or int(value) <= 0 else int(value)    # verl: <= 0 means never


def _unless(other: str):
    def convert(value, ctx):
        return SKIP if ctx.has(other) else value
    return convert


def _mini_batch(value, ctx):
    prompts = ctx.number("data.train_batch_size")
    if ctx.absent and value > prompts:
        # verl refuses this; the tutorial's command relies on it. One update per batch is the
        # closest meaning: GRPO on fully on-policy data.
        ctx.warn(f"exceeds data.train_batch_size={prompts} (verl would refuse this); used {prompts}: one "
                 f"optimizer step per batch")
        return prompts
    return value


def _micro_batch(value, ctx):
    if value is not NO_DEFAULT:
        return value
    if ctx.has("actor_rollout_ref.actor.ppo_micro_batch_size"):
        return SKIP
    mini = min(ctx.number("actor_rollout_ref.actor.ppo_mini_batch_size"), ctx.number("data.train_batch_size"))
    per_gpu = max(1, mini * ctx.number("actor_rollout_ref.rollout.n") // _gpus(ctx))
    if per_gpu >= TrainerSpec.model_fields["micro_batch_size_per_gpu"].default:
        return SKIP                                    # our default fits
    if not ctx.get("actor_rollout_ref.actor.use_dynamic_bsz"):
        ctx.warn(f"verl needs it without use_dynamic_bsz; used {per_gpu}, a mini-batch's responses per GPU")
    return per_gpu


def _placement(value, ctx):
    return "colocated" if value in (True, "True", "true") else "separate"


def _offload_between_phases(value, ctx):
    # verl moves the actor off the GPUs while its hybrid engine generates; separate placement has
    # no such phase (the trainer's GPUs are its own): nothing to free them for.
    on = value in (True, "True", "true")
    return True if on and _placement(ctx.get("actor_rollout_ref.hybrid_engine"), ctx) == "colocated" else SKIP


def _colocated_replicas(value, ctx):
    if _placement(value, ctx) != "colocated":
        return SKIP
    nproc = ctx.number("trainer.n_gpus_per_node")
    tp = ctx.number("actor_rollout_ref.rollout.tensor_model_parallel_size")
    if nproc % tp:
        raise Unsupported(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must divide "
                          f"trainer.n_gpus_per_node={nproc}: each node runs one rollout server per "
                          "tensor-parallel group")
    return ctx.number("trainer.nnodes") * nproc // tp


def _gpus(ctx) -> int:
    return max(1, ctx.number("trainer.nnodes") * ctx.number("trainer.n_gpus_per_node"))


def _micro_from_global(value, ctx):
    if ctx.has("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"):
        return SKIP
    return max(1, int(value) // _gpus(ctx))


def _token_budget(value, ctx):
    if not ctx.get("actor_rollout_ref.actor.use_dynamic_bsz"):
        ctx.warn("ignored, as verl ignores it without actor_rollout_ref.actor.use_dynamic_bsz=True")
        return SKIP
    return value


def _log_prob_budget(value, ctx):
    """ref's and rollout's log_prob_max_token_len_per_gpu size the forward-only passes' micro-batches
    (reference and old log-probs); here one budget serves both: the reference's when both are set."""
    if ctx.has("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu") and not ctx.key.startswith("actor_rollout_ref.ref."):
        return SKIP
    return _token_budget(value, ctx)


def _dynamic_bsz(value, ctx):
    if value and not ctx.has("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"):
        return ctx.get("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")     # verl's default budget
    return SKIP


def _val_temperature(value, ctx):
    if not ctx.get("actor_rollout_ref.rollout.val_kwargs.do_sample"):
        return 0.0                                     # verl validates greedily unless do_sample
    return value


def _do_sample(value, ctx):
    return SKIP if value else 0.0


def _only_if(expected, message: str):
    def convert(value, ctx):
        if value != expected:
            ctx.warn(message)
        return SKIP
    return convert


def _warmup_steps(value, ctx):
    return SKIP if value is None or value < 0 else value          # verl: -1 = use the ratio


def _warmup_ratio(steps_key: str):
    # verl uses the ratio only when the steps are None, 0 or negative (lr_warmup_steps is "prioritized").
    def convert(value, ctx):
        steps = ctx.get(steps_key)
        if not value:
            return SKIP
        if steps is not None and steps > 0:
            ctx.warn(f"{steps_key}={steps} overrides the warmup ratio {value} in verl: the ratio is dropped")
            return SKIP
        return value
    return convert


def _nullish(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", ""))


def _rollout_is(value, ctx):
    if _nullish(value):
        return SKIP
    if value not in ("token", "sequence"):
        raise Unsupported(f"{value!r} is not an importance-weight level here; supported: token, sequence")
    return value


def _rollout_rs(value, ctx):
    if _nullish(value):
        return SKIP
    options = [o.strip() for o in str(value).split(",") if o.strip()]
    if "binary_kl" in options:
        raise Unsupported("binary_kl (KPop) rejection is not supported; use token_k1 or seq_mean_k1")
    return options


def _threshold(enabled_by: str, part: int):
    """A threshold's upper (part 1) or, of 'lower_upper', lower (part 0) bound; nothing while the
    key that turns its mechanism on is off."""
    def convert(value, ctx):
        if _nullish(ctx.flat.get(enabled_by)) or _nullish(value):
            return SKIP
        specs = {v.strip() for v in str(value).split(",") if v.strip()}
        if len(specs) > 1:
            raise Unsupported("one threshold for every rollout_rs option here")
        bounds = specs.pop().split("_")
        if part == 0 and len(bounds) == 1:
            return SKIP
        return float(bounds[part] if len(bounds) == 2 else bounds[0])
    return convert


def _critic_enable(value, ctx):
    gae = ctx.get("algorithm.adv_estimator") == "gae"
    if value is False and gae:
        raise Unsupported("adv_estimator=gae needs the critic: its values make the advantages")
    if value and not gae:
        ctx.warn("no critic is trained: only adv_estimator=gae uses one")
    return SKIP


def _critic_path(value, ctx):
    # The policy's model is the critic's default here: say it only when it differs.
    return SKIP if value == ctx.flat.get("actor_rollout_ref.model.path") else value


def _critic_token_budget(value, ctx):
    if not ctx.get("critic.use_dynamic_bsz"):
        ctx.warn("ignored, as verl ignores it without critic.use_dynamic_bsz=True")
        return SKIP
    return value


def _same_as_actor(actor_key: str, verl_default, what: str):
    def convert(value, ctx):
        actor = ctx.flat.get(actor_key)
        if value != (verl_default if actor is None else actor):
            ctx.warn(f"the critic trains on the policy's {what} here ({actor_key})")
        return SKIP
    return convert


def _critic_warmup(value, ctx):
    # verl updates the actor once critic_warmup <= its 1-based step: the first N-1 steps train the critic only.
    return max(int(value or 0) - 1, 0)


# verl's trackers that have no counterpart here: their metrics go to TensorBoard instead.
_OTHER_TRACKERS = ("swanlab", "vemlp_wandb", "clearml", "trackio")


def _loggers(value, ctx):
    names = value if isinstance(value, list) else [value]
    out, dropped = [], []
    for name in map(str, names):
        if name in ("console", "tensorboard", "wandb", "mlflow"):
            mapped = name
        elif name == "file":
            mapped = "jsonl"                           # verl's file logger writes JSON lines
        elif name in _OTHER_TRACKERS:
            mapped = "tensorboard"
            dropped.append(name)
        else:
            raise Unsupported(f"logger {name!r} is unknown; loggers here: console, jsonl, tensorboard, prometheus, "
                              f"wandb, mlflow")
        if mapped not in out:
            out.append(mapped)
    if dropped:
        ctx.warn(f"{', '.join(dropped)} is not supported here; metrics go to tensorboard instead (and to "
                 f"Prometheus with the prometheus logger)")
    return out


def _reward_function(value, ctx):
    if not value:
        return SKIP
    return f"{value}:{ctx.get('custom_reward_function.name')}"


def _reward_name(value, ctx):
    if not ctx.has("custom_reward_function.path") and value != "compute_score":
        ctx.warn("ignored without custom_reward_function.path")
    return SKIP


# Reward models (issue 31): verl's discriminative RM, old layout (reward_model.*) and 0.9's
# (reward.reward_model.*), becomes one classifier in reward.rewardModels, combined as verl does
# (combine: replace, the default: the model's score is the reward).
_RM_LAYOUTS = {   # enable key -> (path key, custom function key, max-length keys)
    "reward_model.enable": ("reward_model.model.path", "custom_reward_function.path", ("reward_model.max_length",)),
    "reward.reward_model.enable": ("reward.reward_model.model_path", "reward.custom_reward_function.path",
                                   ("reward.reward_model.rollout.prompt_length",
                                    "reward.reward_model.rollout.response_length")),
}


def _reward_model_enable(value, ctx):
    path_key, function_key, _ = _RM_LAYOUTS[ctx.key]
    if value is True and not ctx.has(path_key):
        raise Unsupported(f"a reward model needs {path_key}")
    if value is True and ctx.has(function_key):
        raise Unsupported(f"with {function_key} verl's custom function calls the reward model itself through "
                          f"verl's reward router (its GenRM), which is not here; declare the model as a judge in "
                          f"reward.rewardModels (promptTemplate, parser) instead")
    return SKIP


def _reward_model_entry(enable_key: str):
    def convert(value, ctx):
        if ctx.flat.get(enable_key) is not True:
            ctx.warn(f"ignored without {enable_key}=True")
            return SKIP
        entry: dict[str, Any] = {"name": "rm", "kind": "classifier", "path": str(value)}
        lengths = [ctx.flat.get(k) for k in _RM_LAYOUTS[enable_key][2]]
        if all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
            entry["maxLength"] = sum(lengths)
        return [entry]
    return convert


def _reward_function_09(value, ctx):
    if not value:
        return SKIP
    name = ctx.flat.get("reward.custom_reward_function.name") or "compute_score"
    return f"{value}:{name}"


def _reward_kwargs(prefix: str, path_key: str):
    """verl's custom_reward_function.reward_kwargs (every key under `prefix`) as reward.kwargs, the
    extra keyword arguments of every call; verl passes them only to a custom function."""
    def convert(value, ctx):
        if not ctx.has(path_key):
            ctx.warn(f"ignored, as verl ignores it without {path_key}")
            return SKIP
        out: dict[str, Any] = {}
        for key, v in ctx.flat.items():
            if key.startswith(prefix):
                node = out
                *parents, leaf = key[len(prefix):].split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = v
        return out
    return convert


def _resume_from_path(value, ctx):
    if ctx.get("trainer.resume_mode") != "resume_path":
        ctx.warn("ignored, as verl ignores it without trainer.resume_mode=resume_path")
        return SKIP
    raise Unsupported("verl checkpoints are not read here: merge the actor into a Hugging Face model (verl's "
                      "model_merger) and set actor_rollout_ref.model.path to it; this job then resumes from its "
                      "own checkpoints (resume: auto)")


def _loss_agg_mode(value, ctx):
    loss = ctx.get("actor_rollout_ref.actor.policy_loss.loss_mode")
    if loss not in SEQUENCE_LOSSES:
        return SKIP if ctx.absent else value
    if value != "seq-mean-token-mean" and not ctx.absent:
        ctx.warn(f"verl aggregates policy loss {loss} as seq-mean-token-mean whatever this says; so does the job")
    if ctx.get("actor_rollout_ref.actor.use_kl_loss") or ctx.get("actor_rollout_ref.actor.entropy_coeff"):
        ctx.warn(f"the KL loss and entropy bonus are aggregated as seq-mean-token-mean too (verl: as {value}): "
                 f"one lossAggMode serves every term here")
    return "seq-mean-token-mean"


def _max_resp_len(value, ctx):
    length = ctx.get("data.max_response_length")
    if value != length:
        ctx.warn(f"the overlong buffer ends at data.max_response_length ({length}) here")
    return SKIP


_DTYPE = _choice({"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                  "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}, what="dtype")
_ESTIMATORS = {e.value: e.value for e in AdvEstimator}
# verl's registered estimators and losses that need a piece not built here: refused, naming it.
_ESTIMATORS_REFUSED = {
    "remax": "remax needs a greedy baseline generation per prompt on the rollout servers, not built yet; "
             "use rloo or grpo",
    "gdpo": "gdpo normalises each reward component apart (algorithm.gdpo_reward_keys): it needs the reward "
            "function's components carried to the advantage computation, not built yet; use grpo",
    "optimal_token_baseline": "optimal_token_baseline needs the old policy's sum of squared token probabilities "
                              "over the vocabulary (sum_pi_squared), which the trainer's log-prob pass doesn't "
                              "compute yet; use grpo or rloo",
    "tir_optimal_token_baseline": "tir_optimal_token_baseline needs the old policy's sum_pi_squared, which the "
                                  "trainer's log-prob pass doesn't compute yet; use grpo or rloo",
}
_LOSSES_REFUSED = {
    "gvpo": "gvpo (recipe.gvpo) centres each response's log-ratio on its prompt group's mean inside the loss: "
            "it needs every group's n responses in one micro-batch step across ranks, which the trainer's "
            "micro-batching doesn't keep; not built",
    "bypass_mode": "verl's loss behind algorithm.rollout_correction.bypass_mode: set that instead "
                   "(algorithm.rolloutCorrection.bypassMode, PPO-clip against the engine's log-probs; its "
                   "reinforce loss_type is not built)",
}
_KL_TYPE = _choice({t: t for t in typing.get_args(KLType)},
                   {"full": "the full-vocabulary KL is not supported; use low_var_kl"}, "KL type")
_POLICY_LOSSES = {name: name for name in typing.get_args(PolicyLoss)}
_VLLM_KNOB = "a vLLM engine setting verl passes through; the rollout servers manage their own"
_OFFLOAD = "FSDP2 offload/sharding tuning of verl's workers; the trainer shards with FSDP2 on its own terms"
_MICRO_LOGPROB = ("log-prob micro-batching by count of verl's workers; log-probs here use trainer.microBatchSizePerGPU "
                  "(by tokens: logProbMaxTokensPerGPU)")
_SPEED = "a verl kernel/speed setting with no effect on the result; not needed here"

# Entry points whose trainer is the one a GRPOJob runs: verl's PPO trainer (main_ppo_sync is its
# synchronous form) and DAPO's, whose additions (dynamic sampling, the overlong buffer) are mapped.
# A recipe's own trainer (FlowRL, PRIME, SPIN, ...) would silently become GRPO or PPO: refused.
HONOURED_ENTRIES = ("verl.trainer.main_ppo", "verl.trainer.main_ppo_sync", "recipe.dapo.main_dapo")


def _entry_error(entry: str | None) -> str | None:
    if entry in (None, "yaml"):
        return None
    module = ".".join(p for p in entry.removesuffix(".py").split("/") if p not in ("", ".", ".."))
    if any(module == e or module.endswith("." + e) for e in HONOURED_ENTRIES):
        return None
    return (f"{entry}: {module} runs a trainer of its own, which is not implemented here (translated, its algorithm "
            f"would silently become PPO or GRPO); only {', '.join(HONOURED_ENTRIES)} translate")


# Vision-language: Qwen2.5-VL and Qwen3-VL (dense or MoE) train with their images (data.image_key;
# the hf engine generates with them). Other VL models (GLM-4.1V, MiniCPM-o ...) would train on the
# prompts' text without their images; videos are not read.
_VL = "vision-language models other than Qwen2.5-VL and Qwen3-VL are not supported yet (issue 45)"
_VIDEO = "videos are not supported yet (issue 45): only images (data.image_key)"
_VL_MODEL = re.compile(r"(?i:[-_]vl([-_/.]|$)|llava|internvl|[-_]omni|minicpm-[vo])|\d(\.\d+)?V[-_]")   # GLM-4.1V-9B
_QWEN_VL = re.compile(r"(?i)qwen(2\.5|3)-vl")


def _model_path(value, ctx):
    if _VL_MODEL.search(str(value)) and not _QWEN_VL.search(str(value)):
        raise Unsupported(f"{_VL}: the model looks like one")
    return value


def _quantization(value, ctx):
    if _nullish(value):
        return SKIP
    return _choice({"fp8": "fp8"}, {"torchao": "torchao quantized rollout is not supported (fp8 is)",
                                    "ascend": "Ascend quantized rollout is not supported (fp8 on vLLM is)"},
                   "rollout quantization")(value, ctx)


_rollout_engine = _choice({"vllm": "vllm", "hf": "hf"}, {"sglang": "SGLang rollout is not supported; use vllm",
                                                     "trtllm": "TensorRT-LLM rollout is not supported; use vllm"},
                          "rollout engine")


# `key=True` under a namespace ignored wholesale, or a key no rule names, is an error (a feature
# the job would silently train without) unless its leaf is one of these: speed, memory and
# bookkeeping switches of verl's workers that leave what is trained unchanged.
_HARMLESS_ON = frozenset((
    "use_torch_compile", "entropy_checkpointing", "entropy_from_logits_with_chunking", "enable_activation_offload",
    "offload_policy", "reshard_after_forward", "use_orig_params", "param_offload", "optimizer_offload",
    "grad_offload", "multi_stage_wake_up", "layered_summon", "free_cache_engine", "enable_chunked_prefill",
    "enable_prefix_caching", "log_prob_use_dynamic_bsz", "use_dynamic_bsz",
    "return_raw_chat", "trust_remote_code", "use_remove_padding", "use_liger", "use_shm",
    "calculate_sum_pi_squared", "enable_resource_pool", "relocate_results", "disable_log_stats", "enforce_eager",
    "log", "balance_batch", "return_full_prompt", "skip_tokenizer_init", "use_fused_kernels",
))

# fmt: off
RULES: tuple[Rule, ...] = (
    # algorithm
    Map("algorithm.adv_estimator", "algorithm.advEstimator", "grpo(_vectorized), rloo(_vectorized), "
        "reinforce_plus_plus(_baseline), opo, gpg, grpo_passk; gae (PPO, with the critic); remax, gdpo and "
        "(tir_)optimal_token_baseline are errors", _choice(_ESTIMATORS, _ESTIMATORS_REFUSED, "advantage estimator"),
        absent="gae"),
    Map("algorithm.norm_adv_by_std_in_grpo", "algorithm.normAdvByStd", "false + seq-mean-token-sum-norm = Dr.GRPO"),
    Map("algorithm.gamma", "algorithm.gamma"),
    Map("algorithm.filter_groups.enable", "algorithm.filterGroups", "DAPO dynamic sampling"),
    Ignore("algorithm.filter_groups.*", "filterGroups drops the groups whose rewards are all equal; the metric "
           "and the regeneration limit are not settings here"),
    Map("algorithm.use_kl_in_reward", "algorithm.useKLInReward", "PPO's KL penalty in the reward"),
    Map("algorithm.kl_penalty", "algorithm.klPenalty", "full is an error", _KL_TYPE),
    Map("algorithm.kl_ctrl.type", "algorithm.klCtrl.type", "fixed, adaptive",
        _choice({"fixed": "fixed", "adaptive": "adaptive"}, what="KL controller")),
    Map("algorithm.kl_ctrl.kl_coef", "algorithm.klCtrl.klCoef"),
    Map("algorithm.kl_ctrl.target_kl", "algorithm.klCtrl.targetKl"),
    Map("algorithm.kl_ctrl.horizon", "algorithm.klCtrl.horizon"),
    Ignore("algorithm.kl_ctrl.*", "a KL-controller setting with no counterpart here"),
    Map("algorithm.lam", "algorithm.lam", "GAE's lambda"),
    Refuse("algorithm.use_pf_ppo", "preference-feedback PPO reweighting is not supported", ok=(False,)),
    Ignore("algorithm.pf_ppo.*", "only used with use_pf_ppo, which is off"),
    Map("algorithm.rollout_correction.rollout_is", "algorithm.rolloutCorrection.rolloutIs", "token, sequence",
        _rollout_is),
    Map("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rolloutCorrection.rolloutIsThreshold",
        "'lower_upper' (IcePop) sets the lower bound too", _threshold("algorithm.rollout_correction.rollout_is", 1)),
    Map("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rolloutCorrection.rolloutIsThresholdLower",
        "the lower of 'lower_upper'", _threshold("algorithm.rollout_correction.rollout_is", 0)),
    Map("algorithm.rollout_correction.rollout_rs", "algorithm.rolloutCorrection.rolloutRs", "comma-separated "
        "token_k*, seq_sum_k*, seq_mean_k*, seq_max_k*; binary_kl is an error", _rollout_rs),
    Map("algorithm.rollout_correction.rollout_rs_threshold", "algorithm.rolloutCorrection.rolloutRsThreshold",
        "one threshold for every option; 'lower_upper' for k1", _threshold("algorithm.rollout_correction.rollout_rs", 1)),
    Map("algorithm.rollout_correction.rollout_rs_threshold", "algorithm.rolloutCorrection.rolloutRsThresholdLower",
        "the lower of 'lower_upper'", _threshold("algorithm.rollout_correction.rollout_rs", 0)),
    Map("algorithm.rollout_correction.rollout_rs_threshold_lower", "algorithm.rolloutCorrection.rolloutRsThresholdLower",
        "older form", lambda v, ctx: SKIP if _nullish(v) else float(v)),
    Map("algorithm.rollout_correction.bypass_mode", "algorithm.rolloutCorrection.bypassMode",
        "the engine's log-probs as the old policy", lambda v, ctx: True if v and not _nullish(v) else SKIP),
    Refuse("algorithm.rollout_correction.rollout_token_veto_threshold", "the per-token veto is not supported; use "
           "rollout_rs=token_k1", ok=(None, "null", "none", "None")),
    Refuse("algorithm.rollout_correction.rollout_is_batch_normalize", "batch-normalized IS weights are not "
           "supported", ok=(False, None, "false", "False")),
    Refuse("algorithm.rollout_correction.use_policy_gradient", "the policy-gradient loss of bypass mode is not "
           "supported (the PPO loss is)", ok=(False, None, "false", "False")),
    Ignore("algorithm.rollout_correction.*", "a rollout-correction setting with no counterpart here"),
    # data
    Map("data.train_files", "data.trainFiles", "a path or a list; local paths become file:// URIs", _files),
    Map("data.val_files", "data.valFiles", "as train_files", _files),
    Map("data.prompt_key", "data.promptKey"),
    Map("data.train_batch_size", "data.trainBatchSize", "prompts per step (same unit)"),
    Map("data.val_batch_size", "data.valBatchSize"),
    Map("data.max_prompt_length", "data.maxPromptLength"),
    Map("data.max_response_length", "data.maxResponseLength"),
    Map("data.filter_overlong_prompts", "data.filterOverlongPrompts"),
    Map("data.truncation", "data.truncation", "error, left, right (middle is an error)",
        _choice({"error": "error", "left": "left", "right": "right"}, what="truncation mode")),
    Map("data.shuffle", "data.shuffle"),
    Map("data.seed", "data.seed"),
    Map("data.image_key", "data.imageKey", "a vision-language model's images (Qwen2.5-VL, Qwen3-VL)"),
    Refuse("data.video_key", _VIDEO),
    Map("data.image_patch_size", "data.imagePatchSize", "checked against the model's image processor when the "
        "trainer starts (its own size is used)"),
    Ignore("data.return_multi_modal_inputs", "the trainer computes the images' inputs itself, per micro-batch"),
    Refuse("data.filter_accuracy", "filtering prompts by their accuracy is not supported", ok=(False, None)),
    Ignore("data.accuracy_lower_bound", "only used with data.filter_accuracy"),
    Ignore("data.accuracy_upper_bound", "only used with data.filter_accuracy"),
    Refuse("data.reward_fn_key", "rewards dispatch on data_source here", ok=("data_source",)),
    Refuse("data.custom_cls.path", "custom dataset classes are not supported; write verl-layout parquet",
           ok=(None,)),
    Ignore("data.custom_cls.*", "only used with data.custom_cls.path"),
    Refuse("data.sampler.class_path", "custom samplers are not supported (the sampler is seeded and "
           "epoch-aware)", ok=(None,)),
    Ignore("data.sampler.*", "only used with data.sampler.class_path"),
    Refuse("data.datagen.path", "dynamic data generation is not supported", ok=(None,)),
    Ignore("data.datagen.*", "only used with data.datagen.path"),
    Refuse("data.apply_chat_template_kwargs.*", "chat-template arguments (e.g. enable_thinking) are not "
           "supported: prompts use the model's chat template as is", ok=({},)),
    Ignore("data.gen_batch_size", "DAPO's generation batch: each step samples data.train_batch_size prompts"),
    Ignore("data.tokenizer", "the tokenizer is the model's (or model.tokenizerPath)"),
    Ignore("data.filter_overlong_prompts_workers", "prompts are filtered in the trainer"),
    Refuse("data.train_max_samples", "use a smaller parquet file", ok=(-1, None)),
    Refuse("data.val_max_samples", "use a smaller parquet file", ok=(-1, None)),
    Ignore("data.*", "a verl dataloader setting with no counterpart here"),
    # actor_rollout_ref.model
    Map("actor_rollout_ref.model.path", "model.path",
        "a vision-language model other than Qwen2.5-VL and Qwen3-VL is an error", _model_path),
    Map("actor_rollout_ref.model.tokenizer_path", "model.tokenizerPath"),
    Map("actor_rollout_ref.model.trust_remote_code", "model.trustRemoteCode"),
    Map("actor_rollout_ref.model.enable_gradient_checkpointing", "model.gradientCheckpointing"),
    Map("actor_rollout_ref.model.use_fused_kernels", "model.useFusedKernels", "log-probs from the LM head's input"),
    Map("actor_rollout_ref.model.use_remove_padding", "model.useRemovePadding", "packed micro-batches"),
    Map("actor_rollout_ref.actor.use_prefix_grouper", "model.sharePrompts", "each prompt once per micro-batch, "
        "its responses attending to it (packed rows here, which verl's PrefixGrouper can't combine with)"),
    Map("actor_rollout_ref.model.lora_rank", "model.lora.rank", "0 = full-parameter training", _lora_rank),
    Map("actor_rollout_ref.model.lora.rank", "model.lora.rank", "verl 0.9's layout; 0 = off", _lora_rank),
    Map("actor_rollout_ref.model.lora_alpha", "model.lora.alpha", "only with LoRA", _lora_only()),
    Map("actor_rollout_ref.model.lora.alpha", "model.lora.alpha", "only with LoRA", _lora_only()),
    Map("actor_rollout_ref.model.target_modules", "model.lora.targetModules", "a list, all-linear or a,b,c",
        _lora_only(_target_modules)),
    Map("actor_rollout_ref.model.lora.target_modules", "model.lora.targetModules", "a list, all-linear or a,b,c",
        _lora_only(_target_modules)),
    Map("actor_rollout_ref.model.lora.dropout", "model.lora.dropout", "only with LoRA", _lora_only()),
    Map("actor_rollout_ref.model.lora.merge", "model.lora.merge", "only with LoRA", _lora_only()),
    Map("actor_rollout_ref.model.lora_adapter_path", "model.lora.adapterPath", "a local or mounted folder",
        _adapter_path),
    Map("actor_rollout_ref.model.exclude_modules", "model.lora.excludeModules", "a regex, or a list of names "
        "(as a regex)", _lora_only(_exclude_modules)),
    Map("actor_rollout_ref.model.lora.exclude_modules", "model.lora.excludeModules", "a regex, or a list of names "
        "(as a regex)", _lora_only(_exclude_modules)),
    Refuse("actor_rollout_ref.model.custom_chat_template", "custom chat templates are not supported: put the "
           "template in the tokenizer (model.tokenizerPath)", ok=(None,)),
    Refuse("actor_rollout_ref.model.external_lib", "external model libraries are not loaded", ok=(None,)),
    Refuse("actor_rollout_ref.model.override_config.*", "model config overrides are not applied: edit the "
           "model's config.json", ok=({},)),
    Refuse("actor_rollout_ref.model.hf_config_path", "the model's config comes from model.path", ok=(None,)),
    Refuse("actor_rollout_ref.model.mtp.enable", "multi-token prediction is not supported", ok=(False, None)),
    Ignore("actor_rollout_ref.model.mtp.*", "only used with mtp.enable"),
    Ignore("actor_rollout_ref.model.lora.*", "other LoRA settings (initialization, Megatron's) have no "
           "counterpart: adapters start as PEFT's (A random, B zero)"),
    Ignore("actor_rollout_ref.model.*", _SPEED),
    # actor_rollout_ref.actor
    Refuse("actor_rollout_ref.actor.strategy", "the trainer is FSDP2 only (no Megatron)", ok=("fsdp", "fsdp2")),
    Map("actor_rollout_ref.actor.ppo_mini_batch_size", "trainer.miniBatchSize", "prompts per optimizer step "
        "(same unit)", _mini_batch, absent=256),
    Map("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "trainer.microBatchSizePerGPU",
        "responses per GPU forward (same unit); not set: min(8, a mini-batch's responses per GPU)", _micro_batch,
        absent=NO_DEFAULT),
    Map("actor_rollout_ref.actor.ppo_micro_batch_size", "trainer.microBatchSizePerGPU", "deprecated global form: "
        "divided by nnodes x n_gpus_per_node", _micro_from_global),
    Map("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "trainer.maxTokensPerGPU", "only when "
        "use_dynamic_bsz=True, as in verl", _token_budget),
    Map("actor_rollout_ref.actor.use_dynamic_bsz", "trainer.maxTokensPerGPU", "True alone: verl's 16384 budget",
        _dynamic_bsz),
    Map("actor_rollout_ref.actor.ppo_epochs", "trainer.ppoEpochs"),
    Map("actor_rollout_ref.actor.clip_ratio", "algorithm.clipRatioLow", "unless clip_ratio_low is set",
        _unless("actor_rollout_ref.actor.clip_ratio_low")),
    Map("actor_rollout_ref.actor.clip_ratio", "algorithm.clipRatioHigh", "unless clip_ratio_high is set",
        _unless("actor_rollout_ref.actor.clip_ratio_high")),
    Map("actor_rollout_ref.actor.clip_ratio_low", "algorithm.clipRatioLow"),
    Map("actor_rollout_ref.actor.clip_ratio_high", "algorithm.clipRatioHigh", "0.28 = DAPO clip-higher"),
    Map("actor_rollout_ref.actor.clip_ratio_c", "algorithm.clipRatioC"),
    Map("actor_rollout_ref.actor.loss_agg_mode", "algorithm.lossAggMode", "seq-mean-token-mean with loss_mode "
        "gspo, sapo, geo_mean (verl forces it)", _loss_agg_mode, absent="token-mean"),
    Map("actor_rollout_ref.actor.loss_scale_factor", "algorithm.lossScaleFactor"),
    Map("actor_rollout_ref.actor.policy_loss.loss_mode", "algorithm.policyLoss", "vanilla, gspo, clip_cov, kl_cov, "
        "cispo, sapo, geo_mean, gpg, dppo_tv, dppo_kl, dro; gvpo is an error",
        _choice(_POLICY_LOSSES, _LOSSES_REFUSED, what="policy loss")),
    *(Map(f"actor_rollout_ref.actor.policy_loss.{key}", f"algorithm.policyLossConfig.{field}")
      for key, field in (("clip_cov_ratio", "clipCovRatio"), ("clip_cov_lb", "clipCovLb"), ("clip_cov_ub", "clipCovUb"),
                         ("kl_cov_ratio", "klCovRatio"), ("ppo_kl_coef", "ppoKlCoef"), ("dro_beta", "droBeta"))),
    Map("actor_rollout_ref.actor.tau_pos", "algorithm.policyLossConfig.tauPos", "SAPO"),
    Map("actor_rollout_ref.actor.tau_neg", "algorithm.policyLossConfig.tauNeg", "SAPO"),
    # verl's SAPO example scripts write them here, where verl's PolicyLossConfig has no such key
    Map("actor_rollout_ref.actor.policy_loss.tau_pos", "algorithm.policyLossConfig.tauPos", "as actor.tau_pos"),
    Map("actor_rollout_ref.actor.policy_loss.tau_neg", "algorithm.policyLossConfig.tauNeg", "as actor.tau_neg"),
    Ignore("actor_rollout_ref.actor.policy_loss.*", "parameters of policy losses not offered here"),
    Map("actor_rollout_ref.actor.entropy_coeff", "algorithm.entropyCoeff"),
    Map("actor_rollout_ref.actor.use_kl_loss", "algorithm.useKLLoss"),
    Map("actor_rollout_ref.actor.kl_loss_coef", "algorithm.klLossCoef"),
    Map("actor_rollout_ref.actor.kl_loss_type", "algorithm.klLossType", "full is an error", _KL_TYPE),
    Map("actor_rollout_ref.actor.grad_clip", "trainer.gradClip"),
    Map("actor_rollout_ref.actor.optim.clip_grad", "trainer.gradClip"),
    Map("actor_rollout_ref.actor.optim.lr", "trainer.lr"),
    Map("actor_rollout_ref.actor.optim.lr_warmup_steps", "trainer.lrWarmupSteps", "-1 (use the ratio) = 0",
        _warmup_steps),
    Map("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "trainer.lrWarmupStepsRatio", "dropped (a "
        "warning) when lr_warmup_steps > 0, as verl does",
        _warmup_ratio("actor_rollout_ref.actor.optim.lr_warmup_steps")),
    Map("actor_rollout_ref.actor.optim.weight_decay", "trainer.weightDecay"),
    Map("actor_rollout_ref.actor.optim.lr_scheduler_type", "trainer.lrScheduler", "constant, cosine",
        _choice({"constant": "constant", "cosine": "cosine"}, what="LR schedule")),
    Map("actor_rollout_ref.actor.optim.warmup_style", "trainer.lrScheduler", "older name of lr_scheduler_type",
        _choice({"constant": "constant", "cosine": "cosine", "None": SKIP}, what="LR schedule")),
    Refuse("actor_rollout_ref.actor.optim.optimizer", "the optimizer is AdamW", ok=("AdamW", "adamw")),
    Refuse("actor_rollout_ref.actor.optim.betas", "AdamW betas are fixed at (0.9, 0.999)", ok=([0.9, 0.999],)),
    Refuse("actor_rollout_ref.actor.optim.min_lr_ratio", "cosine decays to 0 here", ok=(0, 0.0, None)),
    Refuse("actor_rollout_ref.actor.optim.num_cycles", "cosine is a half cycle here", ok=(0.5, None)),
    Ignore("actor_rollout_ref.actor.optim.*", "a verl optimizer-implementation setting"),
    Ignore("actor_rollout_ref.actor.fsdp_config.*", _OFFLOAD),
    Ignore("actor_rollout_ref.actor.checkpoint.*", "checkpoint contents are not a setting here (model, optimizer "
           "and sampler state)"),
    Ignore("actor_rollout_ref.actor.profiler.*", "profiling is not configured from the job"),
    Map("actor_rollout_ref.actor.freeze_vision_tower", "trainer.freezeVisionTower"),
    Map("actor_rollout_ref.actor.fsdp_config.param_offload", "trainer.paramOffload", "colocated: off the GPUs "
        "while the engines generate", _offload_between_phases),
    Map("actor_rollout_ref.actor.fsdp_config.optimizer_offload", "trainer.optimizerOffload", "colocated: off the "
        "GPUs while the engines generate", _offload_between_phases),
    Ignore("actor_rollout_ref.actor.rollout_n", "verl copies actor_rollout_ref.rollout.n here"),
    Refuse("actor_rollout_ref.actor.loss_mode", "an older spelling of policy_loss.loss_mode: set that",
           ok=(None, "vanilla")),
    Refuse("actor_rollout_ref.actor.megatron.*", "the trainer is FSDP2 only (no Megatron)"),
    Ignore("actor_rollout_ref.actor.*", _SPEED),
    # actor_rollout_ref.ref
    Map("actor_rollout_ref.ref.fsdp_config.param_offload", "trainer.refCpuOffload"),
    Ignore("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", _MICRO_LOGPROB),
    Map("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "trainer.logProbMaxTokensPerGPU",
        "the token budget of the forward-only passes, only when use_dynamic_bsz=True, as in verl", _log_prob_budget),
    Ignore("actor_rollout_ref.ref.*", "reference-model worker tuning; the reference model shares the "
           "trainer's sharding"),
    # actor_rollout_ref.rollout
    Map("actor_rollout_ref.rollout.name", "rollout.engine", "vllm, hf (both take images); sglang is an "
        "error", _rollout_engine),
    Map("actor_rollout_ref.rollout.n", "rollout.n", "the group size", absent=1),
    Map("actor_rollout_ref.rollout.tensor_model_parallel_size", "rollout.tensorParallelSize", "GPUs per rollout "
        "server", absent=2),
    Map("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpuMemoryUtilization"),
    Map("actor_rollout_ref.rollout.temperature", "rollout.temperature"),
    Map("actor_rollout_ref.rollout.do_sample", "rollout.temperature", "False = greedy (temperature 0)", _do_sample),
    Map("actor_rollout_ref.rollout.top_p", "rollout.topP"),
    Map("actor_rollout_ref.rollout.top_k", "rollout.topK"),
    Map("actor_rollout_ref.rollout.max_num_batched_tokens", "rollout.maxNumBatchedTokens"),
    Map("actor_rollout_ref.rollout.enforce_eager", "rollout.enforceEager"),
    Map("actor_rollout_ref.rollout.calculate_log_probs", "rollout.calculateLogProbs", "the records keep the "
        "behaviour log-probs where training doesn't read them (on-policy, no rollout correction)"),
    Map("actor_rollout_ref.rollout.dtype", "model.dtype", "one dtype for training compute and rollout", _DTYPE),
    Map("actor_rollout_ref.rollout.val_kwargs.temperature", "rollout.valTemperature", "0 unless "
        "val_kwargs.do_sample=True, as in verl", _val_temperature),
    Check("actor_rollout_ref.rollout.val_kwargs.do_sample", "read with val_kwargs.temperature",
          lambda value, ctx: SKIP),
    Check("actor_rollout_ref.rollout.val_kwargs.n", "a warning unless 1: validation draws one sample per prompt",
          _only_if(1, "validation draws one sample per prompt here")),
    Check("actor_rollout_ref.rollout.val_kwargs.top_p", "a warning unless 1: validation uses top_p 1",
          _only_if(1.0, "validation samples with top_p 1 here")),
    Check("actor_rollout_ref.rollout.val_kwargs.top_k", "a warning unless -1: validation uses no top-k",
          _only_if(-1, "validation samples without top-k here")),
    # multi-turn, tool-using rollouts: the agent loop on the rollout servers
    Map("actor_rollout_ref.rollout.multi_turn.enable", "rollout.multiTurn.enable"),
    Map("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", "rollout.multiTurn.maxAssistantTurns"),
    Map("actor_rollout_ref.rollout.multi_turn.max_user_turns", "rollout.multiTurn.maxUserTurns"),
    Map("actor_rollout_ref.rollout.multi_turn.max_parallel_calls", "rollout.multiTurn.maxParallelCalls"),
    Map("actor_rollout_ref.rollout.multi_turn.max_tool_response_length", "rollout.multiTurn.maxToolResponseLength"),
    Map("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
        "rollout.multiTurn.toolResponseTruncateSide"),
    Map("actor_rollout_ref.rollout.multi_turn.format", "rollout.multiTurn.format", "hermes",
        _choice({"hermes": "hermes"}, None, "tool-call format")),
    Map("actor_rollout_ref.rollout.multi_turn.tool_config_path", "rollout.multiTurn.toolConfigPath",
        "the same file, read by the rollout servers (their tool classes must be importable there)"),
    Refuse("actor_rollout_ref.rollout.multi_turn.interaction_config_path", "verl's interactions (simulated "
           "users) are not supported; a tool, or an agent loop of your own, can play that part", ok=(None,)),
    Ignore("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", "the agent loop never "
           "re-tokenizes a trajectory (token-in/token-out): there is no drift to check"),
    Ignore("actor_rollout_ref.rollout.multi_turn.*", "a verl multi-turn setting with no counterpart here"),
    # verl's agent loop registry (agent.agent_loop_config_path: `- name: ..., _target_: module.Class`
    # of verl's async AgentLoopBase) has no drop-in here: our agent loops are rollout.agentLoop's
    # synchronous interface (docs/ARCHITECTURE.md, "Custom agent loops").
    Refuse("actor_rollout_ref.rollout.agent.agent_loop_config_path", "verl's agent loop classes (AgentLoopBase) "
           "don't run here; port the loop to spec.rollout.agentLoop (module:Class, docs/ARCHITECTURE.md "
           "\"Custom agent loops\") or use rollout.multiTurn's tool agent", ok=(None,)),
    Ignore("actor_rollout_ref.rollout.agent.num_workers", "verl's agent loop workers (Ray actors): the agent "
           "loop runs in each rollout server"),
    Refuse("actor_rollout_ref.rollout.ignore_eos", "generation stops at EOS here", ok=(False,)),
    Ignore("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", _MICRO_LOGPROB),
    Map("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "trainer.logProbMaxTokensPerGPU",
        "the token budget of the forward-only passes (old log-probs), only when use_dynamic_bsz=True; "
        "ref's wins when both are set", _log_prob_budget),
    Ignore("actor_rollout_ref.rollout.mode", "rollout servers are always separate, asynchronous vLLM servers"),
    Map("actor_rollout_ref.rollout.quantization", "rollout.quantization", "fp8: the same scheme (128x128 weight "
        "blocks, dynamic activations; training in model.dtype); torchao and ascend are errors", _quantization),
    Map("actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype", "rollout.kvCacheDtype", "verl passes it to "
        "vLLM as is: auto; fp8 and fp8_e4m3 are fp8 (scales 1.0); others are errors",
        _choice({"auto": "auto", "None": "auto", "null": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"},
                what="vLLM KV cache dtype")),
    Refuse("actor_rollout_ref.rollout.quantization_config_file", "a quantization config file is not read here: "
           "rollout.quantization fp8 is verl's block scheme, with no other settings", ok=(None, "None", "none")),
    Ignore("actor_rollout_ref.rollout.*", _VLLM_KNOB),
    # verl's hybrid engine (its only mode): the rollout on the training GPUs, asleep while they train
    Map("actor_rollout_ref.hybrid_engine", "rollout.placement", "True: colocated, the trainer pods run the "
        "rollout servers on their GPUs (verl's GPU count)", _placement, absent=True),
    Map("actor_rollout_ref.hybrid_engine", "rollout.replicas", "colocated: nnodes x n_gpus_per_node / "
        "tensor_model_parallel_size, one server per tensor-parallel group", _colocated_replicas, absent=True),
    Ignore("actor_rollout_ref.*", "a verl worker setting with no counterpart here"),
    # rewards
    Map("custom_reward_function.path", "reward.function", "path:name, verl's compute_score contract",
        _reward_function),
    Check("custom_reward_function.name", "the function in custom_reward_function.path (default compute_score)",
          _reward_name),
    Map("custom_reward_function.reward_kwargs.*", "reward.kwargs", "extra keyword arguments of every call of the "
        "function", _reward_kwargs("custom_reward_function.reward_kwargs.", "custom_reward_function.path")),
    Check("reward_model.enable", "a reward model (with reward_model.model.path): reward.rewardModels",
          _reward_model_enable),
    Map("reward_model.model.path", "reward.rewardModels", "one classifier (a discriminative RM), its score the "
        "reward (combine: replace, as verl)", _reward_model_entry("reward_model.enable")),
    Map("reward_model.max_length", "reward.rewardModels", "the classifier's maxLength (read with "
        "reward_model.model.path)", lambda value, ctx: SKIP),
    Check("reward.reward_model.enable", "verl 0.9's reward model (with reward.reward_model.model_path): "
          "reward.rewardModels", _reward_model_enable),
    Map("reward.reward_model.model_path", "reward.rewardModels", "one classifier, maxLength = rollout.prompt_length "
        "+ rollout.response_length when both are given", _reward_model_entry("reward.reward_model.enable")),
    Ignore("reward.reward_model.*", "the reward model's serving knobs (its engine, GPUs and memory are "
           "reward.rewardModels[].gpus, replicas, template)"),
    Map("reward.num_workers", "reward.workers", "reward worker processes per rollout server"),
    Map("reward.custom_reward_function.path", "reward.function", "verl 0.9's custom_reward_function",
        _reward_function_09),
    Check("reward.custom_reward_function.name", "the function in reward.custom_reward_function.path",
          lambda value, ctx: SKIP),
    Map("reward.custom_reward_function.reward_kwargs.*", "reward.kwargs", "verl 0.9's reward_kwargs",
        _reward_kwargs("reward.custom_reward_function.reward_kwargs.", "reward.custom_reward_function.path")),
    Refuse("reward.reward_manager.name", "per-sample managers only (naive, dapo, prime)",
           ok=("naive", "dapo", "prime", None)),
    Refuse("reward.reward_manager.module.path", "custom reward managers are not supported; use "
           "reward.custom_reward_function", ok=(None,)),
    Ignore("reward.reward_manager.*", "reward manager plumbing; scoring is per sample, with verl's compute_score "
           "signature"),
    Refuse("reward.*", "a verl 0.9 reward setting this translator can't honour", ok=(None, False, {}, [])),
    Refuse("reward_model.reward_manager", "per-sample managers only (naive, dapo, prime)",
           ok=("naive", "dapo", "prime", None)),
    Refuse("reward_manager.name", "per-sample managers only (naive, dapo, prime)",
           ok=("naive", "dapo", "prime", None)),
    Refuse("reward_manager.module.path", "custom reward managers are not supported; use "
           "custom_reward_function", ok=(None,)),
    Ignore("reward_manager.*", "reward manager plumbing; scoring is per sample, with verl's compute_score "
           "signature"),
    Map("reward_model.overlong_buffer.enable", "reward.overlongBuffer.enable", "DAPO overlong shaping"),
    Map("reward_model.overlong_buffer.len", "reward.overlongBuffer.len"),
    Map("reward_model.overlong_buffer.penalty_factor", "reward.overlongBuffer.penaltyFactor"),
    Map("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "reward.overlongBuffer.enable", "newer DAPO form"),
    Map("reward_model.reward_kwargs.overlong_buffer_cfg.len", "reward.overlongBuffer.len"),
    Map("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "reward.overlongBuffer.penaltyFactor"),
    Check("reward_model.reward_kwargs.max_resp_len", "a warning unless data.max_response_length (where the "
          "buffer ends here)", _max_resp_len),
    Ignore("reward_model.overlong_buffer.log", "overlong-reward logging is not a setting here"),
    Ignore("reward_model.reward_kwargs.overlong_buffer_cfg.log", "overlong-reward logging is not a setting here"),
    Refuse("reward_model.sandbox_fusion.url", "SandboxFusion reward scoring is not supported: run the code in "
           "spec.reward.function, or give the model the python tool (rollout.multiTurn, run in the job's sandbox "
           "pods)", ok=(None,)),
    Ignore("reward_model.*", "reward-model serving knobs (micro batches, offload, strategy): the reward server "
           "batches by tokens"),
    # critic (used with adv_estimator=gae only, as in verl)
    Check("critic.enable", "null: a critic exactly with gae; false with gae is an error", _critic_enable),
    Refuse("critic.strategy", "the critic is FSDP2 only (no Megatron)", ok=("fsdp", "fsdp2", None)),
    Map("critic.model.path", "critic.modelPath", "the policy's path is the default", _critic_path),
    Map("critic.model.enable_gradient_checkpointing", "critic.gradientCheckpointing"),
    Refuse("critic.model.lora_rank", "LoRA for the critic is not supported (the policy's is: model.lora)",
           ok=(0, None)),
    Ignore("critic.model.tokenizer_path", "the critic reads the policy's tokens (one tokenizer)"),
    Ignore("critic.model.*", _OFFLOAD),
    Map("critic.optim.lr", "critic.lr"),
    Map("critic.optim.lr_warmup_steps", "critic.lrWarmupSteps", "-1 (use the ratio) = 0", _warmup_steps),
    Map("critic.optim.lr_warmup_steps_ratio", "critic.lrWarmupStepsRatio", "dropped (a warning) when "
        "lr_warmup_steps > 0, as verl does", _warmup_ratio("critic.optim.lr_warmup_steps")),
    Map("critic.optim.weight_decay", "critic.weightDecay"),
    Map("critic.optim.lr_scheduler_type", "critic.lrScheduler", "constant, cosine",
        _choice({"constant": "constant", "cosine": "cosine"}, what="LR schedule")),
    Map("critic.optim.warmup_style", "critic.lrScheduler", "older name of lr_scheduler_type",
        _choice({"constant": "constant", "cosine": "cosine", "None": SKIP}, what="LR schedule")),
    Map("critic.optim.clip_grad", "critic.gradClip"),
    Ignore("critic.optim.*", "a verl optimizer-implementation setting (AdamW here)"),
    Map("critic.grad_clip", "critic.gradClip"),
    Map("critic.cliprange_value", "critic.cliprangeValue"),
    Map("critic.ppo_epochs", "critic.ppoEpochs"),
    Map("critic.ppo_micro_batch_size_per_gpu", "critic.microBatchSizePerGPU"),
    Map("critic.ppo_max_token_len_per_gpu", "critic.maxTokensPerGPU", "only when critic.use_dynamic_bsz=True",
        _critic_token_budget),
    Check("critic.ppo_mini_batch_size", "a warning unless the actor's", _same_as_actor(
        "actor_rollout_ref.actor.ppo_mini_batch_size", 256, "mini-batches")),
    Check("critic.loss_agg_mode", "a warning unless the actor's", _same_as_actor(
        "actor_rollout_ref.actor.loss_agg_mode", "token-mean", "loss aggregation")),
    Ignore("critic.*", "a verl critic-worker setting with no counterpart here"),
    # trainer
    Map("trainer.project_name", "trainer.projectName", absent="verl_examples"),
    Map("trainer.experiment_name", "trainer.experimentName", absent="gsm8k"),
    Map("trainer.experiment_name", "metadata.name", "DNS-1123: lower case, [a-z0-9-], 50 characters",
        _dns_name, absent="gsm8k"),
    Map("trainer.nnodes", "trainer.nnodes"),
    Map("trainer.n_gpus_per_node", "trainer.nprocPerNode", "GPUs per node, shared by the trainer and the colocated "
        "rollout servers (verl's hybrid engine)",
        absent=8),
    Refuse("trainer.device", "only cuda translates (npu is not supported; a CPU run leaves it out: spec.trainer.device auto picks the CPU where there is no GPU)", ok=("cuda", None)),
    Map("trainer.total_epochs", "trainer.totalEpochs", absent=30),
    Map("trainer.total_training_steps", "trainer.totalSteps"),
    Map("trainer.test_freq", "trainer.testFreq", "<= 0 = never", _freq),
    Map("trainer.save_freq", "trainer.saveFreq", "<= 0 = -1 (verl: never; here: once, at the end)", _freq),
    Map("trainer.val_before_train", "trainer.valBeforeTrain"),
    Map("trainer.max_actor_ckpt_to_keep", "trainer.keepCheckpoints", "null = keep all", absent=None),
    Map("trainer.logger", "trainer.loggers", "console, wandb, mlflow, tensorboard; file = jsonl; swanlab, "
        "clearml, trackio, vemlp_wandb = tensorboard (a warning)", _loggers, absent=["console", "wandb"]),
    Map("trainer.resume_mode", "resume", "auto, disable = never; resume_path: see resume_from_path",
        _choice({"auto": "auto", "disable": "never", "resume_path": SKIP}, what="resume mode")),
    Check("trainer.resume_from_path", "an error with resume_mode=resume_path: verl checkpoints are not read "
          "here", _resume_from_path),
    Refuse("trainer.resume_from_checkpoint", "not a verl key (see trainer.resume_from_path): this job resumes "
           "from its own latest checkpoint (resume: auto); for a verl checkpoint, merge it into a Hugging Face "
           "model and use it as actor_rollout_ref.model.path", ok=(None,)),
    Map("trainer.critic_warmup", "trainer.criticWarmup", "N here = verl's N - 1 (verl's step count starts at "
        "1)", _critic_warmup),
    Map("trainer.val_only", "trainer.valOnly", "verl ignores it with val_before_train=False (a warning)",
        _val_only),
    Refuse("trainer.ref_update_freq", "updating the reference model to the policy during training is not "
           "supported (the reference is the initial model)", ok=(None, -1, 0)),
    Ignore("trainer.default_local_dir", "checkpoints go under the job's run (status.runUri)/checkpoints"),
    Ignore("trainer.default_hdfs_dir", "checkpoints go under spec.storage.uri (file:// or s3://)"),
    Ignore("trainer.balance_batch", "micro-batches are formed from length-sorted samples here"),
    Ignore("trainer.max_critic_ckpt_to_keep", "the critic is in the job's checkpoints (trainer.keepCheckpoints)"),
    Ignore("trainer.*", "a verl trainer setting with no counterpart here"),
    # infrastructure
    Ignore("ray_kwargs.*", "no Ray here: pods on Kubernetes, processes locally"),
    Ignore("ray_init.*", "no Ray here: pods on Kubernetes, processes locally"),
    Ignore("global_profiler.*", "profiling is not configured from the job"),
    Ignore("transfer_queue.*", "no transfer queue here: rollouts travel through object storage"),
    Ignore("hydra.*", "hydra's own settings"),
)
# fmt: on

_EXACT: dict[str, list[Rule]] = {}
for _rule in RULES:
    _EXACT.setdefault(_rule.verl, []).append(_rule)


def rules_for(key: str) -> list[Rule]:
    """The rules for a verl key: its own, else the longest matching prefix rule; none for a key
    a prefix rule would take but that looks like a misspelled key of that section."""
    if key in _EXACT:
        return _EXACT[key]
    if _misspelled(key):
        return []
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n]) + ".*"
        if prefix in _EXACT:
            return _EXACT[prefix]
    return []


def _misspelled(key: str) -> str | None:
    """The exact key of the same section that `key` is a near miss of (ppo_mini_batch_sz)."""
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k, rules in _EXACT.items()
                if k.rpartition(".")[0] == parent and not k.endswith("*") and rules[0].kind != "ignore"]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.85)
    return f"{parent}.{close[0]}" if close else None


# --- translation --------------------------------------------------------------------------------

@dataclass
class Translation:
    doc: dict | None               # the GRPOJob document, None when there are errors
    job: GRPOJob | None
    warnings: list[str]
    errors: list[str]


_LISTED = 8          # ignored keys named per reason (a full verl config dump has hundreds)


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
    return ", ".join(keys[:_LISTED]) + more


def _set(doc: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = doc if parts[0] == "metadata" else doc.setdefault("spec", {})
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _show(key: str, value: Any, absent: bool) -> str:
    if value is NO_DEFAULT:
        return f"{key} (not set)"
    return f"{key} (not set: verl's default {value!r})" if absent else f"{key}={value!r}"


def translate(cfg: VerlConfig, *, name: str | None = None, namespace: str | None = None,
              expand_env: bool = False) -> Translation:
    """The GRPOJob for a verl config; every warning and error, each naming the verl key."""
    warnings, errors = list(cfg.warnings), []
    doc: dict = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "metadata": {}, "spec": {}}
    origin: dict[str, str] = {}
    ignored: dict[str, list[str]] = {}           # reason -> keys, one message per reason
    refused: dict[str, list[str]] = {}
    ctx = _Ctx(cfg.flat, expand_env)
    if entry_error := _entry_error(cfg.entry):
        errors.append(entry_error)
    for option in cfg.hydra_options:
        if "megatron" in option:
            errors.append(f"{option}: the trainer is FSDP2 only (no Megatron)")
        elif not option.startswith("--config-name=ppo_trainer"):
            warnings.append(f"{option}: hydra option ignored; only the keys given here are translated")
    for key in cfg.deleted:
        warnings.append(f"~{key}: hydra deletion ignored")

    def apply(rule: Rule, key: str, value: Any, absent: bool) -> None:
        shown = _show(key, value, absent)
        if rule.kind == "ignore":
            if value not in (None, {}, []):            # unset: nothing to lose
                ignored.setdefault(rule.note, []).append(shown)
            return
        if rule.kind == "refuse":
            if value not in rule.ok:
                refused.setdefault(rule.note, []).append(shown)
            return
        if value is None:
            # null is verl's "unset": our default, unless null means something here too.
            if rule.field and rule.convert is None and _nullable(rule.field):
                _set(doc, rule.field, None)
                origin[rule.field] = shown
            return
        ctx.key, ctx.shown, ctx.absent, ctx.warnings = key, shown, absent, []
        try:
            out = rule.convert(value, ctx) if rule.convert else value
        except Unsupported as exc:
            errors.append(f"{shown}: {exc}")
            return
        except (TypeError, ValueError) as exc:       # e.g. a number where a list belongs
            errors.append(f"{shown}: not a value this key takes ({exc})")
            return
        warnings.extend(ctx.warnings)
        if out is not SKIP and rule.field:
            _set(doc, rule.field, out)
            origin[rule.field] = shown

    for key, value in cfg.flat.items():
        rules = rules_for(key)
        leaf = key.rsplit(".", 1)[-1]
        turned_on = ((leaf in ("enable", "enabled") and value not in (False, None, "false", "False"))
                     or (value is True and leaf not in _HARMLESS_ON and not leaf.startswith("disable")))
        if turned_on and rules and all(r.kind == "ignore" and r.verl.endswith("*") for r in rules):
            # A feature turned on under a namespace ignored wholesale (vLLM's knobs, ...): the job
            # would silently train without it.
            errors.append(f"{key}={value!r}: turns on a verl feature this translator doesn't know, "
                          "so it can't be honoured")
            continue
        if not rules:
            close = _misspelled(key) or next(iter(difflib.get_close_matches(
                key, [r.verl for r in RULES if not r.verl.endswith("*")], n=1)), None)
            hint = f"; did you mean {close}?" if close else ""
            if turned_on:
                errors.append(f"{key}={value!r}: turns on a verl feature this translator doesn't know, "
                              f"so it can't be honoured{hint}")
                continue
            warnings.append(f"{key}={value!r}: not a verl key this translator knows; ignored{hint}")
        for rule in rules:
            apply(rule, key, value, absent=False)
    for rule in RULES:
        if rule.absent is not MISSING and rule.verl not in cfg.flat:
            apply(rule, rule.verl, rule.absent, absent=True)
    warnings += [f"{_listed(keys)}: ignored: {reason}" for reason, keys in ignored.items()]
    errors += [f"{_listed(keys)}: {reason}" for reason, keys in refused.items()]
    _drop_unused_critic(doc, origin, warnings)
    if name:
        doc["metadata"]["name"] = name
    if namespace:
        doc["metadata"]["namespace"] = namespace
    if errors:
        return Translation(None, None, _unique(warnings), _unique(errors))
    try:
        job = parse_job(doc, source="translated job")
    except JobError as exc:
        return Translation(None, None, _unique(warnings), [_with_origin(e, origin) for e in exc.errors])
    return Translation(_ordered(doc, GRPOJob), job, _unique(warnings), [])


def _drop_unused_critic(doc: dict, origin: dict[str, str], warnings: list[str]) -> None:
    """verl builds a critic only for adv_estimator gae and ignores critic.* otherwise (scripts
    often carry them); a spec refuses a critic section it would not use, so it goes, said."""
    spec = doc["spec"]
    if "critic" in spec and spec.get("algorithm", {}).get("advEstimator", "gae") != "gae":
        keys = [origin.pop(f"critic.{k}") for k in spec.pop("critic") if f"critic.{k}" in origin]
        warnings.append(f"{_listed(keys) or 'critic.*'}: ignored, as verl ignores the critic without "
                        f"adv_estimator=gae")


def _nullable(path: str) -> bool:
    model = GRPOJob if path.startswith("metadata.") else GRPOJobSpec
    *parents, leaf = path.split(".")
    for p in parents:
        model = _child_model(model, p)
    field = next(f for n, f in model.model_fields.items() if leaf in (n, f.alias))
    return not field.is_required() and type(None) in getattr(field.annotation, "__args__", ())


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _with_origin(error: str, origin: dict[str, str]) -> str:
    path = error.split(":", 1)[0].removeprefix("spec.")
    path = re.sub(r"\[\d+\]$", "", path)
    return f"{error} [from verl {origin[path]}]" if path in origin else error


def _ordered(doc: dict, model) -> dict:
    """The document in the model's field order (spec sections as docs/ARCHITECTURE.md §3 lists them)."""
    out = {}
    for name, f in model.model_fields.items():
        key = f.alias or name
        if key in doc:
            child = _child_model(model, key)
            out[key] = _ordered(doc[key], child) if child and isinstance(doc[key], dict) else doc[key]
    out.update({k: v for k, v in doc.items() if k not in out})
    return out


def render(translation: Translation, source: str) -> str:
    """The translated job as YAML, headed by where it came from and what was skipped."""
    lines = [f"# Translated from verl by `grpo from-verl` ({source}).",
             "# verl's hybrid engine is rollout.placement colocated: the trainer pods run the rollout servers on",
             "# their own GPUs (as many as verl uses), asleep while the trainer trains."]
    if translation.warnings:
        lines.append("# Translation warnings:")
        lines += [f"#   - {w}" for w in translation.warnings]
    body = yaml.dump(translation.doc, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)
    return "\n".join(lines) + "\n" + body


class _Dumper(K8sDumper):
    """Lists inline (`trainFiles: [a, b]`), mappings as blocks, as the examples are written; keys
    and values kubectl would read as booleans (`n`) quoted."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


# --- the table for the docs ---------------------------------------------------------------------

def markdown_table() -> str:
    """RULES as the Markdown table docs/MIGRATING_FROM_VERL.md embeds."""
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|")

    rows = ["| verl key | GRPOJob field | kind | when absent | notes |", "|---|---|---|---|---|"]
    for r in RULES:
        target = (r.field if r.field.startswith("metadata.") else f"spec.{r.field}") if r.field else "—"
        kind = {"map": "maps", "check": "checked", "ignore": "warning", "refuse": "error"}[r.kind]
        if r.kind == "refuse" and r.ok:
            kind = "error unless " + " / ".join("null" if v is None else str(v) for v in r.ok)
        absent = ("" if r.absent is MISSING else "computed" if r.absent is NO_DEFAULT
                  else "null" if r.absent is None else f"`{r.absent}`")
        rows.append(f"| `{r.verl}` | {f'`{target}`' if r.field else target} | {cell(kind)} | {absent} | "
                    f"{cell(r.note)} |")
    return "\n".join(rows) + "\n"
