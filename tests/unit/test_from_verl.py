"""`grpo from-verl`: verl launch commands and configs translated into GRPOJobs, field by field;
warnings for keys with no meaning here, errors for features we don't have; the key table in
docs/MIGRATING_FROM_VERL.md kept in step with the code; verl reward files used unchanged."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
import yaml

from grpo_api.commands import from_verl
from grpo_api.from_verl import RULES, Unsupported, markdown_table, rules_for, translate
from grpo_api.jobfile import _child_model, load_job, parse_job
from grpo_api.spec import GRPOJob, GRPOJobSpec, ObjectMeta
from grpo_api.verl_command import parse_hydra_value, read_command, read_yaml

REPO = Path(__file__).resolve().parents[2]

# The tutorial's command exactly as the seed page carries it: flattened onto one line, the
# backslash-newline continuations turned into "\ " and `set -x` run into `python3`.
SEED_COMMAND = (
    r"""set -x python3 -m verl.trainer.main_ppo \ algorithm.adv_estimator=grpo \ data.train_files=$HOME/data/gsm8k/train.parquet \ data.val_files=$HOME/data/gsm8k/test.parquet \ data.train_batch_size=128 \ data.max_prompt_length=512 \ data.max_response_length=1024 \ actor_rollout_ref.model.path=Qwen/Qwen3-8B \ actor_rollout_ref.rollout.n=5 \ actor_rollout_ref.rollout.name=vllm \ actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \ actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \ actor_rollout_ref.actor.use_kl_loss=True \ actor_rollout_ref.actor.kl_loss_coef=0.001 \ trainer.project_name='gsm8k_grpo_demo' \ trainer.experiment_name='qwen3_8b_grpo' \ trainer.n_gpus_per_node=4 \ trainer.nnodes=1 \ trainer.total_epochs=3 \ trainer.test_freq=1 \ trainer.save_freq=1"""  # noqa: E501
)

# The same command as the tutorial's author ran it: a script with real continuations.
SEED_SCRIPT = """\
set -x
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.train_batch_size=128 \\
    data.max_prompt_length=512 \\
    data.max_response_length=1024 \\
    actor_rollout_ref.model.path=Qwen/Qwen3-8B \\
    actor_rollout_ref.rollout.n=5 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.kl_loss_coef=0.001 \\
    trainer.project_name='gsm8k_grpo_demo' \\
    trainer.experiment_name='qwen3_8b_grpo' \\
    trainer.n_gpus_per_node=4 \\
    trainer.nnodes=1 \\
    trainer.total_epochs=3 \\
    trainer.test_freq=1 \\
    trainer.save_freq=1
"""

# What the tutorial's command becomes, every field of the written spec.
SEED_SPEC = {
    "model": {"path": "Qwen/Qwen3-8B"},
    "data": {"trainFiles": ["file://$HOME/data/gsm8k/train.parquet"],
             "valFiles": ["file://$HOME/data/gsm8k/test.parquet"],
             "trainBatchSize": 128, "maxPromptLength": 512, "maxResponseLength": 1024},
    "algorithm": {"advEstimator": "grpo", "useKLLoss": True, "klLossCoef": 0.001},
    "rollout": {"engine": "vllm", "n": 5,
                # verl's hybrid engine: the trainer's 4 GPUs generate too, 2 servers of tensor parallel 2
                "placement": "colocated", "replicas": 2,
                "tensorParallelSize": 2,                # verl's default when the command omits it
                "gpuMemoryUtilization": 0.6},
    "trainer": {"projectName": "gsm8k_grpo_demo", "experimentName": "qwen3_8b_grpo", "nnodes": 1,
                "nprocPerNode": 4,
                "miniBatchSize": 128,                   # verl's 256 > 128 prompts: one update per batch
                "microBatchSizePerGPU": 16, "totalEpochs": 3, "testFreq": 1, "saveFreq": 1,
                "keepCheckpoints": None,                # verl keeps every checkpoint
                "loggers": ["console", "wandb"]},        # verl's default
}


def run_cli(argv, stdin: str = "", monkeypatch=None, capsys=None):
    if monkeypatch is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = from_verl(argv)
    out, err = capsys.readouterr()
    return code, out, err


def translated(text: str, **kw):
    t = translate(read_command(text, expand_env=kw.pop("expand_env", False)), **kw)
    assert not t.errors, t.errors
    return t


# --- the tutorial's GRPO command -----------------------------------------------------------------

@pytest.mark.parametrize("text", [SEED_COMMAND, SEED_SCRIPT], ids=["seed-flattened", "script"])
def test_seed_tutorial_command_field_by_field(text):
    t = translated(text)
    assert t.doc["apiVersion"] == "grpo.dev/v1alpha1" and t.doc["kind"] == "GRPOJob"
    assert t.doc["metadata"] == {"name": "qwen3-8b-grpo"}
    assert t.doc["spec"] == SEED_SPEC
    spec = t.job.spec                     # and what the pods will read, defaults filled in
    assert spec.algorithm.adv_estimator.value == "grpo" and spec.algorithm.norm_adv_by_std is True
    assert spec.algorithm.loss_agg_mode == "token-mean" and spec.algorithm.kl_loss_type == "low_var_kl"
    assert spec.rollout.n * spec.data.train_batch_size == 640          # 128 prompts x 5 = 640 responses
    assert spec.world_size == 4 and spec.trainer.total_steps is None
    # the same 4 GPUs verl uses: no rollout GPUs besides the trainer's (issue 46)
    assert spec.colocated and spec.trainer.nnodes * spec.trainer.nproc_per_node == 4
    assert spec.rollout.replicas * spec.rollout.tensor_parallel_size == 4


def test_seed_tutorial_warnings_name_what_was_not_carried_over():
    warnings = translated(SEED_COMMAND).warnings
    assert any(w.startswith("$HOME is left as written") for w in warnings)
    assert any(w.startswith("actor_rollout_ref.actor.ppo_mini_batch_size (not set: verl's default 256)")
               and "verl would refuse this" in w for w in warnings)
    assert not any("logger" in w for w in warnings)         # verl's default console+wandb is kept as is
    assert len(warnings) == 2


def test_seed_command_output_validates_and_round_trips(tmp_path, monkeypatch, capsys):
    script = tmp_path / "run_grpo.sh"
    script.write_text(SEED_SCRIPT)
    out_file = tmp_path / "job.yaml"
    code, _, err = run_cli([str(script), "-o", str(out_file)], capsys=capsys)
    assert code == 0, err
    assert "warning: $HOME is left as written" in err
    text = out_file.read_text()
    assert text.startswith("# Translated from verl by `grpo from-verl`")
    assert "trainFiles: ['file://$HOME/data/gsm8k/train.parquet']" in text     # lists written inline
    job = load_job(out_file)                                               # what `grpo validate` does
    assert yaml.safe_load(text)["spec"] == SEED_SPEC
    assert job == translated(SEED_SCRIPT).job


def test_expand_env_substitutes_home(monkeypatch):
    monkeypatch.setenv("HOME", "/home/alice")
    t = translated(SEED_COMMAND, expand_env=True)
    assert t.doc["spec"]["data"]["trainFiles"] == ["file:///home/alice/data/gsm8k/train.parquet"]
    assert not any("$HOME" in w for w in t.warnings)


def test_stdin_and_arguments_after_double_dash(monkeypatch, capsys):
    code, out, err = run_cli([], stdin=SEED_SCRIPT, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    assert yaml.safe_load(out)["spec"] == SEED_SPEC
    args = ["algorithm.adv_estimator=grpo", "data.train_files=/data/gsm8k/train.parquet",
            "actor_rollout_ref.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.rollout.n=8",
            "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "trainer.n_gpus_per_node=2", "trainer.experiment_name=from_args"]
    code, out, err = run_cli(["--", *args], capsys=capsys)
    assert code == 0, err
    doc = yaml.safe_load(out)
    assert doc["metadata"]["name"] == "from-args"
    assert doc["spec"]["data"]["trainFiles"] == ["file:///data/gsm8k/train.parquet"]
    assert doc["spec"]["rollout"]["n"] == 8 and doc["spec"]["trainer"]["miniBatchSize"] == 16


# --- Dr.GRPO and DAPO ----------------------------------------------------------------------------

DRGRPO_CHANGES = """
# 1. no KL loss
actor_rollout_ref.actor.use_kl_loss=False
# 2. token sums normalised by a constant
actor_rollout_ref.actor.loss_agg_mode="seq-mean-token-sum-norm"
# 3. no std normalisation
algorithm.norm_adv_by_std_in_grpo=False
"""


def test_drgrpo_settings_appended_to_the_seed_script(tmp_path, capsys):
    # The tutorial: "three changes, based on the GRPO script". As `bash run.sh k=v ...` passes
    # them through `$@`, from-verl takes them after --.
    script = tmp_path / "run.sh"
    script.write_text(SEED_SCRIPT)
    extra = [line for line in DRGRPO_CHANGES.splitlines() if line and not line.startswith("#")]
    extra = [line.replace('"', "") for line in extra]                 # the shell removes the quotes
    code, out, err = run_cli([str(script), "--", *extra], capsys=capsys)
    assert code == 0, err
    algorithm = yaml.safe_load(out)["spec"]["algorithm"]
    assert algorithm == {"advEstimator": "grpo", "normAdvByStd": False, "lossAggMode": "seq-mean-token-sum-norm",
                         "useKLLoss": False, "klLossCoef": 0.001}
    # verl's trainer normalises seq-mean-token-sum-norm as ours does (responses x scale): no warning.
    assert "loss_agg_mode" not in err


def test_drgrpo_edited_into_the_command():
    text = SEED_SCRIPT.replace("actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.use_kl_loss=False")
    text = text.replace("trainer.save_freq=1", "trainer.save_freq=1 \\\n    " + " \\\n    ".join(
        line for line in DRGRPO_CHANGES.splitlines()[3:] if line and not line.startswith("#")))
    t = translated(text)
    a = t.job.spec.algorithm
    assert (a.use_kl_loss, a.loss_agg_mode, a.norm_adv_by_std) == (False, "seq-mean-token-sum-norm", False)
    assert t.doc["spec"]["algorithm"] == {"advEstimator": "grpo", "normAdvByStd": False,
                                          "lossAggMode": "seq-mean-token-sum-norm", "useKLLoss": False,
                                          "klLossCoef": 0.001}


# A DAPO recipe script in the style of verl's recipe/dapo: shell variables, arithmetic, defaults
# from the environment, submitted through `ray job submit -- python3 -m recipe.dapo.main_dapo`.
DAPO_SCRIPT = r"""#!/usr/bin/env bash
set -xeuo pipefail

project_name='DAPO'
exp_name='DAPO-Qwen2.5-7B-Math'

adv_estimator=grpo
use_kl_in_reward=False
use_kl_loss=False
kl_loss_coef=0.0

clip_ratio_low=0.2
clip_ratio_high=0.28

max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 8))
enable_overlong_buffer=True
overlong_buffer_len=$((1024 * 4))
overlong_penalty_factor=1.0

loss_agg_mode="token-mean"

enable_filter_groups=True
filter_groups_metric=acc
max_num_gen_batches=10
train_prompt_bsz=512
gen_prompt_bsz=$((train_prompt_bsz * 3))
n_resp_per_prompt=16
train_prompt_mini_bsz=32

NNODES=${NNODES:-4}
RAY_DATA_HOME=${RAY_DATA_HOME:-"/mnt/verl"}
MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/Qwen2.5-Math-7B"}
TRAIN_FILE=${TRAIN_FILE:-"s3://datasets/dapo-math-17k.parquet"}
TEST_FILE=${TEST_FILE:-"s3://datasets/aime-2024.parquet"}

use_dynamic_bsz=True
actor_ppo_max_token_len=$((max_prompt_length + max_response_length))
offload=True

ray job submit --no-wait --runtime-env="${RUNTIME_ENV}" \
    --working-dir "${WORKING_DIR}" \
    -- python3 -m recipe.dapo.main_dapo \
    data.train_files="${TRAIN_FILE}" \
    data.val_files="${TEST_FILE}" \
    data.prompt_key=prompt \
    data.truncation='left' \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.gen_batch_size=${gen_prompt_bsz} \
    data.train_batch_size=${train_prompt_bsz} \
    actor_rollout_ref.rollout.n=${n_resp_per_prompt} \
    algorithm.adv_estimator=${adv_estimator} \
    algorithm.use_kl_in_reward=${use_kl_in_reward} \
    actor_rollout_ref.actor.use_kl_loss=${use_kl_loss} \
    actor_rollout_ref.actor.kl_loss_coef=${kl_loss_coef} \
    actor_rollout_ref.actor.clip_ratio_low=${clip_ratio_low} \
    actor_rollout_ref.actor.clip_ratio_high=${clip_ratio_high} \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    algorithm.filter_groups.enable=${enable_filter_groups} \
    algorithm.filter_groups.max_num_gen_batches=${max_num_gen_batches} \
    algorithm.filter_groups.metric=${filter_groups_metric} \
    actor_rollout_ref.actor.use_dynamic_bsz=${use_dynamic_bsz} \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_ppo_max_token_len} \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \
    actor_rollout_ref.actor.fsdp_config.param_offload=${offload} \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.loss_agg_mode=${loss_agg_mode} \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.max_num_batched_tokens=$((max_prompt_length + max_response_length)) \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.top_k="-1" \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.n=1 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.ref.fsdp_config.param_offload=${offload} \
    reward_model.reward_manager=dapo \
    reward_model.overlong_buffer.enable=${enable_overlong_buffer} \
    reward_model.overlong_buffer.len=${overlong_buffer_len} \
    reward_model.overlong_buffer.penalty_factor=${overlong_penalty_factor} \
    trainer.logger='["console","wandb"]' \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${exp_name}" \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes="${NNODES}" \
    trainer.val_before_train=True \
    trainer.test_freq=5 \
    trainer.save_freq=25 \
    trainer.total_epochs=1 \
    trainer.default_local_dir="${RAY_DATA_HOME}/ckpts/${project_name}/${exp_name}" \
    trainer.resume_mode=auto $@ 2>&1 | tee dapo.log
"""


def test_dapo_clip_higher_overlong_buffer_and_dynamic_sampling_field_by_field():
    t = translated(DAPO_SCRIPT)
    assert t.doc["metadata"] == {"name": "dapo-qwen2-5-7b-math"}
    assert t.doc["spec"] == {
        "model": {"path": "/mnt/verl/models/Qwen2.5-Math-7B", "gradientCheckpointing": True},
        "data": {"trainFiles": ["s3://datasets/dapo-math-17k.parquet"],
                 "valFiles": ["s3://datasets/aime-2024.parquet"], "promptKey": "prompt",
                 "trainBatchSize": 512, "maxPromptLength": 2048, "maxResponseLength": 8192, "truncation": "left"},
        "algorithm": {"advEstimator": "grpo", "lossAggMode": "token-mean", "useKLLoss": False, "klLossCoef": 0.0,
                      "clipRatioLow": 0.2, "clipRatioHigh": 0.28, "clipRatioC": 10.0, "entropyCoeff": 0,
                      "filterGroups": True, "useKLInReward": False},
        "reward": {"overlongBuffer": {"enable": True, "len": 4096, "penaltyFactor": 1.0}},
        "rollout": {"engine": "vllm", "n": 16, "placement": "colocated", "replicas": 8,   # 4 nodes x 8 GPUs / TP 4
                    "tensorParallelSize": 4, "gpuMemoryUtilization": 0.8,
                    "temperature": 1.0, "topP": 1.0, "topK": -1, "valTemperature": 1.0,
                    "maxNumBatchedTokens": 10240},
        "trainer": {"projectName": "DAPO", "experimentName": "DAPO-Qwen2.5-7B-Math", "nnodes": 4,
                    "nprocPerNode": 8, "miniBatchSize": 32, "maxTokensPerGPU": 10240, "lr": 1e-6,
                    "lrWarmupSteps": 10, "weightDecay": 0.1, "gradClip": 1.0, "totalEpochs": 1, "testFreq": 5,
                    "valBeforeTrain": True, "saveFreq": 25, "paramOffload": True, "refCpuOffload": True,
                    "keepCheckpoints": None, "loggers": ["console", "wandb"]},
        "resume": "auto",
    }
    # the script's own variables are substituted; the environment was not needed
    assert not any("left as written" in w for w in t.warnings)
    ignored = " ".join(w for w in t.warnings if ": ignored: " in w)
    for key in ("data.gen_batch_size=1536", "algorithm.filter_groups.metric='acc'",
                "algorithm.filter_groups.max_num_gen_batches=10", "trainer.default_local_dir="):
        assert key in ignored


def test_dapo_newer_reward_kwargs_form():
    t = translated("""python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=s3://d/t.parquet \
        actor_rollout_ref.model.path=m actor_rollout_ref.rollout.n=4 data.train_batch_size=32 \
        data.max_response_length=2048 actor_rollout_ref.actor.ppo_mini_batch_size=8 \
        reward_model.reward_manager=dapo \
        +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True \
        +reward_model.reward_kwargs.overlong_buffer_cfg.len=512 \
        +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5 \
        +reward_model.reward_kwargs.overlong_buffer_cfg.log=False \
        +reward_model.reward_kwargs.max_resp_len=4096""")
    assert t.doc["spec"]["reward"] == {"overlongBuffer": {"enable": True, "len": 512, "penaltyFactor": 0.5}}
    assert any(w.startswith("reward_model.reward_kwargs.max_resp_len=4096: the overlong buffer ends at "
                            "data.max_response_length (2048)") for w in t.warnings)


# --- warnings and errors -----------------------------------------------------------------------

BASE = ("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=s3://d/train.parquet "
        "data.train_batch_size=64 actor_rollout_ref.model.path=Qwen/Qwen3-0.6B actor_rollout_ref.rollout.n=4 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=16 trainer.n_gpus_per_node=2 trainer.logger=console ")


def test_fused_kernels_and_remove_padding_map_to_the_model_fields():
    job = translated(BASE + "actor_rollout_ref.model.use_fused_kernels=False "
                            "actor_rollout_ref.model.use_remove_padding=True").job
    assert job.spec.model.use_fused_kernels is False and job.spec.model.use_remove_padding is True
    default = translated(BASE).job.spec.model
    assert default.use_fused_kernels is True and default.use_remove_padding is False


def test_keys_with_no_meaning_here_are_warnings(monkeypatch, capsys):
    extra = ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 "
             "actor_rollout_ref.model.use_shm=True actor_rollout_ref.actor.fsdp_config.reshard_after_forward=False "
             "actor_rollout_ref.actor.use_torch_compile=False "
             "trainer.val_before_train=False trainer.critic_warmup=0 algorithm.use_kl_in_reward=False "
             "trainer.logger='[\"console\",\"wandb\",\"swanlab\"]' actor_rollout_ref.actor.ppo_mini_batch_sz=16")
    code, out, err = run_cli(["-"], stdin=BASE + extra, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    warnings = [line.removeprefix("warning: ") for line in err.splitlines() if line.startswith("warning: ")]
    assert "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32: ignored: log-prob micro-batching " \
           "by count of verl's workers; log-probs here use trainer.microBatchSizePerGPU (by tokens: " \
           "logProbMaxTokensPerGPU)" in warnings
    assert any(w.startswith("actor_rollout_ref.model.use_shm=True, actor_rollout_ref.actor.use_torch_"
                            "compile=False: ignored:") for w in warnings)
    assert any(w.startswith("actor_rollout_ref.actor.fsdp_config.reshard_after_forward=False: ignored: FSDP2")
               for w in warnings)
    assert "trainer.logger=['console', 'wandb', 'swanlab']: swanlab is not supported here; metrics go to " \
           "tensorboard instead (and to Prometheus with the prometheus logger)" in warnings
    assert "actor_rollout_ref.actor.ppo_mini_batch_sz=16: not a verl key this translator knows; ignored; did " \
           "you mean actor_rollout_ref.actor.ppo_mini_batch_size?" in warnings
    assert len(warnings) == 5
    # maps, or accepted silently because the value is what happens here anyway
    spec = yaml.safe_load(out)["spec"]
    assert spec["trainer"]["valBeforeTrain"] is False
    assert spec["trainer"]["loggers"] == ["console", "wandb", "tensorboard"]
    assert not any(k in err for k in ("critic_warmup", "use_kl_in_reward", "val_before_train"))
    code, _, err = run_cli(["-", "--strict"], stdin=BASE + extra, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "--strict" in err


def test_lora_exclude_modules_map_a_regex_as_is_and_a_list_as_a_regex():
    t = translated(BASE + "actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.exclude_modules='.*visual.*'")
    assert t.job.spec.model.lora.exclude_modules == ".*visual.*"       # verl's VLM LoRA example
    t = translated(BASE + "actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.exclude_modules=[lm_head,"
                   "layers.0.mlp.up_proj]")
    pattern = t.job.spec.model.lora.exclude_modules
    assert [bool(re.fullmatch(pattern, n)) for n in ("lm_head", "model.layers.0.mlp.up_proj",
                                                       "model.layers.10.mlp.up_proj", "model.mylm_head")] == \
        [True, True, False, False]


def test_val_only_maps_unless_verl_would_train_anyway():
    val = "data.val_files=s3://d/test.parquet "
    assert translated(BASE + val + "trainer.val_only=True").job.spec.trainer.val_only is True
    # verl returns after the validation before training: without it, val_only is ignored and it trains
    t = translated(BASE + val + "trainer.val_only=True trainer.val_before_train=False")
    assert t.job.spec.trainer.val_only is False
    assert any("trainer.val_only=True is ignored by verl" in w for w in t.warnings), t.warnings


def test_warmup_ratios_map_unless_steps_override_them_as_in_verl():
    t = translated(BASE + "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1 algorithm.adv_estimator=gae "
                   "critic.optim.lr_warmup_steps_ratio=0.05")
    assert (t.job.spec.trainer.lr_warmup_steps_ratio, t.job.spec.trainer.lr_warmup_steps) == (0.1, 0)
    assert (t.job.spec.critic.lr_warmup_steps_ratio, t.job.spec.critic.lr_warmup_steps) == (0.05, 0)
    # verl's lr_warmup_steps > 0 wins over the ratio: the job gets the steps, and a warning says so
    t = translated(BASE + "actor_rollout_ref.actor.optim.lr_warmup_steps=10 "
                   "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1")
    assert (t.job.spec.trainer.lr_warmup_steps_ratio, t.job.spec.trainer.lr_warmup_steps) == (0.0, 10)
    assert any("overrides the warmup ratio 0.1" in w for w in t.warnings), t.warnings


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimator=gae critic.enable=False", "critic.enable=False: adv_estimator=gae needs the critic"),
    ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name='sglang': SGLang rollout is not "
                                               "supported; use vllm"),
    ("reward_model.enable=True", "reward_model.enable=True: a reward model needs reward_model.model.path"),
    ("algorithm.use_kl_in_reward=True algorithm.kl_penalty=full", "algorithm.kl_penalty='full': the "
                                                                   "full-vocabulary KL is not supported"),
    ("algorithm.adv_estimator=gae critic.model.lora_rank=8", "critic.model.lora_rank=8: LoRA for the critic is "
                                                              "not supported"),
    # a feature turned on that the translator doesn't know is an error, never a warning
    ("+actor_rollout_ref.rollout.speculative.enable=True", "actor_rollout_ref.rollout.speculative.enable=True: turns "
                                                           "on a verl feature this translator doesn't know"),
    ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy='megatron': the trainer is "
                                                  "FSDP2 only"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gvpo", "gvpo (recipe.gvpo) centres each response's log-ratio "
                                                           "on its prompt group's mean"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=dro", "spec.algorithm.policyLossConfig.droBeta: required "
                                                          "with policyLoss dro"),
    ("algorithm.adv_estimator=remax", "remax needs a greedy baseline generation per prompt on the rollout servers, "
                                      "not built yet"),
    ("algorithm.adv_estimator=gdpo", "gdpo normalises each reward component apart"),
    ("algorithm.adv_estimator=optimal_token_baseline", "(sum_pi_squared), which the trainer's log-prob pass"),
    ("+data.apply_chat_template_kwargs.enable_thinking=False", "chat-template arguments (e.g. enable_thinking) "
                                                               "are not supported"),
    ("data.train_files=hdfs://nn/gsm8k/train.parquet", "hdfs:// is not a storage scheme here"),
    ("+actor_rollout_ref.model.override_config.max_position_embeddings=32768", "model config overrides are not "
                                                                               "applied"),
    ("trainer.resume_from_checkpoint=./outputs/gsm8k_grpo_demo/qwen3_8b_grpo/checkpoint_2",   # the tutorial's
     "trainer.resume_from_checkpoint='./outputs/gsm8k_grpo_demo/qwen3_8b_grpo/checkpoint_2': not a verl key"),
    ("trainer.device=npu", "trainer.device='npu': only cuda translates (npu is not supported"),
])
def test_features_we_do_not_have_are_errors(override, message, tmp_path, monkeypatch, capsys):
    out_file = tmp_path / "job.yaml"
    code, out, err = run_cli(["-", "-o", str(out_file)], stdin=BASE + override, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2
    assert any(line.startswith("error: ") and message in line for line in err.splitlines()), err
    assert "not translated" in err and not out_file.exists() and out == ""


def test_the_tutorials_command_without_its_grpo_line_is_ppo_with_a_critic():
    """"Add this one line to the PPO command you already have": without it, verl's default, gae."""
    t = translate(read_command(BASE.replace("algorithm.adv_estimator=grpo ", "")))
    assert t.errors == []
    spec = t.job.spec
    assert spec.algorithm.adv_estimator.value == "gae" and (spec.algorithm.gamma, spec.algorithm.lam) == (1.0, 1.0)
    assert spec.critic.model_path is None and spec.critic.lr == 1e-5 and spec.critic.cliprange_value == 0.5


VERL_PPO_EXAMPLE = """python3 -m verl.trainer.main_ppo algorithm.adv_estimator=gae \
    data.train_files=$HOME/data/gsm8k/train.parquet data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=512 \
    actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.rollout.n=1 \
    critic.optim.lr=1e-5 critic.optim.lr_warmup_steps_ratio=0.0 critic.model.use_remove_padding=True \
    critic.model.path=deepseek-ai/deepseek-llm-7b-chat critic.model.enable_gradient_checkpointing=True \
    critic.ppo_micro_batch_size_per_gpu=32 critic.model.fsdp_config.param_offload=False critic.cliprange_value=0.3 \
    algorithm.lam=0.95 algorithm.gamma=0.99 trainer.critic_warmup=3 trainer.logger='["console"]' \
    trainer.project_name=verl_example_gsm8k trainer.experiment_name=deepseek_llm_7b_function_rm \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=1 trainer.total_epochs=15"""


def test_a_kl_penalty_in_the_reward_translates_with_its_controller():
    t = translate(read_command(VERL_PPO_EXAMPLE + " algorithm.use_kl_in_reward=True algorithm.kl_penalty=low_var_kl "
                               "algorithm.kl_ctrl.type=adaptive algorithm.kl_ctrl.kl_coef=0.01 "
                               "algorithm.kl_ctrl.target_kl=0.05 algorithm.kl_ctrl.horizon=5000"))
    assert t.errors == [], t.errors
    algo = t.job.spec.algorithm
    assert algo.use_kl_in_reward and algo.kl_penalty == "low_var_kl"
    assert (algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon) == \
        ("adaptive", 0.01, 0.05, 5000)


def test_rollout_correction_translates_tis_and_mis():
    t = translate(read_command(BASE + "algorithm.rollout_correction.rollout_is=token "
                               "algorithm.rollout_correction.rollout_is_threshold=2.0 "
                               "algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k1 "
                               "algorithm.rollout_correction.rollout_rs_threshold=0.5_1.5 "
                               "algorithm.rollout_correction.rollout_token_veto_threshold=null"))
    assert t.errors == [], t.errors
    rc = t.job.spec.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_threshold_lower) == ("token", 2.0, None)
    assert (rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower) == \
        (["token_k1", "seq_mean_k1"], 1.5, 0.5)
    # verl's defaults alone (thresholds set, nothing on) turn nothing on
    off = translate(read_command(BASE + "algorithm.rollout_correction.rollout_is=null "
                                 "algorithm.rollout_correction.rollout_is_threshold=2.0 "
                                 "algorithm.rollout_correction.bypass_mode=False"))
    assert off.errors == [] and off.job.spec.algorithm.rollout_correction is None
    bad = translate(read_command(BASE + "algorithm.rollout_correction.rollout_rs=binary_kl "
                                 "algorithm.rollout_correction.rollout_rs_threshold=0.1"))
    assert any("binary_kl (KPop) rejection is not supported" in e for e in bad.errors), bad.errors


def test_verls_ppo_example_translates_with_its_critic():
    t = translate(read_command(VERL_PPO_EXAMPLE))
    assert t.errors == [], t.errors
    spec = t.job.spec
    assert spec.algorithm.adv_estimator.value == "gae" and spec.rollout.n == 1        # PPO runs n=1
    assert (spec.algorithm.lam, spec.algorithm.gamma) == (0.95, 0.99)
    c = spec.critic
    assert c.model_path is None                  # the policy's model, as verl's example sets it
    assert (c.lr, c.lr_warmup_steps, c.micro_batch_size_per_gpu, c.cliprange_value, c.gradient_checkpointing) == \
        (1e-5, 0, 32, 0.3, True)
    assert spec.trainer.critic_warmup == 2       # verl's 3: the actor first updates at its step 3
    assert not any("critic.ppo_micro" in w or "critic.optim.lr" in w for w in t.warnings), t.warnings


# verl's examples/tuning/lora/run_qwen3_8b_fsdp.sh, in its layout: settings in bash arrays with
# overridable defaults (the keys and values are the example's; the data paths ours).
VERL_LORA_EXAMPLE = """\
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
lora_rank=${LORA_RANK:-64}
lora_alpha=${LORA_ALPHA:-32}
DATA=(
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
    data.train_files=/data/gsm8k/train.parquet data.val_files=/data/gsm8k/test.parquet
    data.train_batch_size=64 data.max_prompt_length=512 data.max_response_length=1024
    data.filter_overlong_prompts=True data.truncation='error'
)
MODEL=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.lora_rank=${lora_rank}
    actor_rollout_ref.model.lora_alpha=${lora_alpha}
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
)
ACTOR=(
    actor_rollout_ref.actor.optim.lr=3e-6 actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12288
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
)
ROLLOUT=(
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=True
    actor_rollout_ref.ref.fsdp_config.param_offload=True
)
TRAINER=(
    trainer.logger='["console","wandb"]' trainer.project_name=verl_grpo_lora_gsm8k
    trainer.experiment_name=qwen3_8b_lora_vllm_fsdp trainer.n_gpus_per_node=2 trainer.nnodes=1
    trainer.val_before_train=False trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
)
python3 -m verl.trainer.main_ppo "${DATA[@]}" "${MODEL[@]}" "${ACTOR[@]}" "${ROLLOUT[@]}" "${TRAINER[@]}" "$@"
"""


def test_verls_lora_example_translates():
    t = translated(VERL_LORA_EXAMPLE)
    assert t.errors == []
    assert t.doc["spec"]["model"] == {"path": "Qwen/Qwen3-8B", "gradientCheckpointing": True,
                                      "useRemovePadding": True, "lora": {"rank": 64, "alpha": 32}}
    lora = t.job.spec.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.dropout, lora.adapter_path) == \
        (64, 32.0, ["all-linear"], 0.0, None)          # verl's target_modules default: all-linear
    assert not any("lora" in w for w in t.warnings), t.warnings


def test_examples_lora_yaml_is_verls_lora_example():
    example, verl = load_job(REPO / "examples" / "lora.yaml").spec, translated(VERL_LORA_EXAMPLE).job.spec
    assert example.model.lora == verl.model.lora
    assert (example.trainer.lr, example.rollout.n, example.algorithm.kl_loss_type) == \
        (verl.trainer.lr, verl.rollout.n, verl.algorithm.kl_loss_type)


@pytest.mark.parametrize("override, expected", [
    ("actor_rollout_ref.model.lora_rank=16 actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
     {"rank": 16, "targetModules": ["q_proj", "v_proj"]}),
    ("actor_rollout_ref.model.lora_rank=16 actor_rollout_ref.model.target_modules=all-linear",
     {"rank": 16, "targetModules": ["all-linear"]}),
    ("actor_rollout_ref.model.lora_rank=16 actor_rollout_ref.model.target_modules=q_proj,k_proj",
     {"rank": 16, "targetModules": ["q_proj", "k_proj"]}),
    ("actor_rollout_ref.model.lora_adapter_path=/adapters/gsm8k", {"adapterPath": "/adapters/gsm8k"}),
    # verl 0.9's layout
    ("actor_rollout_ref.model.lora.rank=8 actor_rollout_ref.model.lora.alpha=16 "
     "actor_rollout_ref.model.lora.dropout=0.05", {"rank": 8, "alpha": 16, "dropout": 0.05}),
])
def test_lora_keys(override, expected):
    t = translate(read_command(BASE + override))
    assert t.errors == [], t.errors
    assert t.doc["spec"]["model"]["lora"] == expected


def test_lora_settings_without_a_rank_are_full_parameter_training():
    """verl's defaults dumped in full (lora_rank=0, lora_alpha=16, all-linear) train every weight."""
    t = translate(read_command(BASE + "actor_rollout_ref.model.lora_rank=0 actor_rollout_ref.model.lora_alpha=16 "
                               "actor_rollout_ref.model.target_modules=all-linear"))
    assert t.errors == [] and t.job.spec.model.lora is None
    assert any("lora_alpha=16: ignored: only used with LoRA" in w for w in t.warnings), t.warnings


def test_validation_errors_name_the_verl_key():
    t = translate(read_command(BASE + "actor_rollout_ref.rollout.n=1 data.truncation=middle"))
    assert "data.truncation='middle': 'middle' is not a truncation mode here; supported: error, left, right" in t.errors
    t = translate(read_command(BASE + "actor_rollout_ref.rollout.n=1"))
    assert t.errors == ["spec.rollout.n: must be >= 2 for advEstimator grpo (got 1) [from verl "
                        "actor_rollout_ref.rollout.n=1]"]
    t = translate(read_command(BASE + "actor_rollout_ref.actor.ppo_mini_batch_size=48"))
    assert t.errors[0].startswith("spec.trainer.miniBatchSize: must divide data.trainBatchSize")
    assert t.errors[0].endswith("[from verl actor_rollout_ref.actor.ppo_mini_batch_size=48]")


def test_batch_size_units_and_dynamic_batching():
    t = translated(BASE + "actor_rollout_ref.actor.ppo_micro_batch_size=16 trainer.nnodes=2")
    assert t.doc["spec"]["trainer"]["microBatchSizePerGPU"] == 4                 # 16 over 2 x 2 GPUs
    t = translated(BASE + "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096")
    assert "maxTokensPerGPU" not in t.doc["spec"]["trainer"]
    assert any("ignored, as verl ignores it without actor_rollout_ref.actor.use_dynamic_bsz=True" in w
               for w in t.warnings)
    t = translated(BASE + "actor_rollout_ref.actor.use_dynamic_bsz=True "
                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096")
    assert t.doc["spec"]["trainer"]["maxTokensPerGPU"] == 4096
    t = translated(BASE + "actor_rollout_ref.actor.use_dynamic_bsz=True")
    assert t.doc["spec"]["trainer"]["maxTokensPerGPU"] == 16384                  # verl's default budget
    # the forward-only passes' own budget: ref's, else rollout's (old log-probs); by tokens only
    dyn = BASE + "actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096 "
    t = translated(dyn + "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384")
    assert t.doc["spec"]["trainer"]["logProbMaxTokensPerGPU"] == 16384
    t = translated(dyn + "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384 "
                         "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576")
    assert t.doc["spec"]["trainer"]["logProbMaxTokensPerGPU"] == 24576
    t = translated(BASE + "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576")
    assert "logProbMaxTokensPerGPU" not in t.doc["spec"]["trainer"]
    t = translated(BASE + "actor_rollout_ref.actor.clip_ratio=0.3 actor_rollout_ref.actor.clip_ratio_high=0.35")
    assert t.doc["spec"]["algorithm"] == {"advEstimator": "grpo", "clipRatioLow": 0.3, "clipRatioHigh": 0.35}
    t = translated(BASE + "trainer.total_training_steps=500 trainer.test_freq=-1 trainer.save_freq=0 "
                          "trainer.max_actor_ckpt_to_keep=3 trainer.resume_mode=disable")
    tr = t.doc["spec"]["trainer"]
    assert (tr["totalSteps"], tr["testFreq"], tr["saveFreq"], tr["keepCheckpoints"]) == (500, -1, -1, 3)
    assert t.doc["spec"]["resume"] == "never"


# --- logger and list values --------------------------------------------------------------------

@pytest.mark.parametrize("written, loggers", [
    ("trainer.logger='[\"console\",\"wandb\"]'", ["console", "wandb"]),
    ("trainer.logger='[console,mlflow,file]'", ["console", "mlflow", "jsonl"]),
    ("trainer.logger='[console,wandb,mlflow,tensorboard]'", ["console", "wandb", "mlflow", "tensorboard"]),
    ("trainer.logger='[console,clearml,trackio]'", ["console", "tensorboard"]),
    ("trainer.logger=[\"console\"]", ["console"]),            # bash strips the quotes: [console]
    ("trainer.logger=console", ["console"]),
    ("trainer.logger=\"['console','file','tensorboard']\"", ["console", "jsonl", "tensorboard"]),
    ("trainer.logger=[]", []),
])
def test_logger_forms(written, loggers):
    t = translated(BASE.replace("trainer.logger=console ", "") + written)
    assert t.doc["spec"]["trainer"]["loggers"] == loggers


def test_list_valued_files():
    t = translated(BASE + "data.train_files=\"['/data/gsm8k/train.parquet', 's3://b/math/train.parquet']\" "
                          "data.val_files='[/data/gsm8k/test.parquet]'")
    assert t.doc["spec"]["data"]["trainFiles"] == ["file:///data/gsm8k/train.parquet", "s3://b/math/train.parquet"]
    assert t.doc["spec"]["data"]["valFiles"] == ["file:///data/gsm8k/test.parquet"]
    # the verl idiom: the list built in a shell variable, then passed quoted
    script = ("gsm8k_train=$HOME/data/gsm8k/train.parquet\nmath_train=$HOME/data/math/train.parquet\n"
              "train_files=\"['$gsm8k_train', '$math_train']\"\n" + BASE.replace("s3://d/train.parquet",
                                                                               '"$train_files"'))
    t = translated(script)
    assert t.doc["spec"]["data"]["trainFiles"] == ["file://$HOME/data/gsm8k/train.parquet",
                                                   "file://$HOME/data/math/train.parquet"]


def test_hydra_values():
    assert parse_hydra_value("1e-6") == 1e-6 and parse_hydra_value("0.6") == 0.6
    assert parse_hydra_value("True") is True and parse_hydra_value("false") is False
    assert parse_hydra_value("null") is None and parse_hydra_value("-1") == -1
    assert parse_hydra_value("'error'") == "error" and parse_hydra_value("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert parse_hydra_value('["console","wandb"]') == ["console", "wandb"]
    assert parse_hydra_value("[a, 'b,c', [1, 2]]") == ["a", "b,c", [1, 2]]
    assert parse_hydra_value("{a: 1, b: x}") == {"a": 1, "b": "x"}
    assert parse_hydra_value("seq-mean-token-sum-norm") == "seq-mean-token-sum-norm"


def test_hydra_additions_deletions_and_options():
    cfg = read_command(BASE + "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True "
                              "++trainer.total_epochs=2 ~trainer.val_before_train --config-name=ppo_trainer")
    assert cfg.flat["trainer.total_epochs"] == 2 and "trainer.total_epochs" in cfg.added
    assert cfg.deleted == ["trainer.val_before_train"] and cfg.hydra_options == ["--config-name=ppo_trainer"]
    t = translate(cfg)
    assert t.doc["spec"]["trainer"]["totalEpochs"] == 2
    assert "~trainer.val_before_train: hydra deletion ignored" in t.warnings
    t = translate(read_command(BASE + "--config-path=config --config-name=ppo_megatron_trainer"))
    assert t.errors == ["--config-name=ppo_megatron_trainer: the trainer is FSDP2 only (no Megatron)"]


def test_shell_details():
    # quotes, escaped spaces, comments, `;`, prefix env assignments, `export`, ${X,,}, ${X:-d}
    script = r"""
export MODEL=Qwen/Qwen3-0.6B; NAME="My Run"   # a comment
VLLM_USE_V1=1 python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo \
    data.train_files=/data/with\ space/train.parquet data.train_batch_size=64 \
    actor_rollout_ref.model.path=$MODEL actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 trainer.n_gpus_per_node=2 trainer.logger=console \
    trainer.experiment_name="${NAME,,}" trainer.project_name=${PROJECT:-demo} # trailing comment
"""
    t = translated(script)
    assert t.doc["spec"]["data"]["trainFiles"] == ["file:///data/with space/train.parquet"]
    assert t.doc["spec"]["model"]["path"] == "Qwen/Qwen3-0.6B"
    assert t.doc["spec"]["trainer"]["experimentName"] == "my run" and t.doc["metadata"]["name"] == "my-run"
    assert t.doc["spec"]["trainer"]["projectName"] == "demo"
    assert t.warnings == []


def test_bash_arrays_positional_defaults_and_crlf():
    # the newer verl scripts' layout: settings grouped in arrays, the engine from the first argument
    script = """\
rollout_name=${1:-vllm}
DATA_CONFIG=(
    data.train_files=/data/train.parquet   # the GSM8K train split
    data.train_batch_size=64
)
ACTOR_CONFIG=(
    actor_rollout_ref.model.path=Qwen/Qwen3-0.6B
    actor_rollout_ref.actor.ppo_mini_batch_size=16
)
python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo \\
    "${DATA_CONFIG[@]}" \\
    "${ACTOR_CONFIG[@]}" \\
    actor_rollout_ref.rollout.name=$rollout_name actor_rollout_ref.rollout.n=4 \\
    trainer.n_gpus_per_node=2 trainer.logger=console
""".replace("\n", "\r\n")
    t = translated(script)
    assert t.doc["spec"]["data"] == {"trainFiles": ["file:///data/train.parquet"], "trainBatchSize": 64}
    assert t.doc["spec"]["model"] == {"path": "Qwen/Qwen3-0.6B"}
    assert t.doc["spec"]["rollout"]["engine"] == "vllm" and t.doc["spec"]["trainer"]["miniBatchSize"] == 16


def test_environment_numbers_left_as_written_are_named():
    t = translate(read_command(BASE.replace("trainer.n_gpus_per_node=2", "trainer.n_gpus_per_node=$GPUS")
                               .replace("actor_rollout_ref.actor.ppo_mini_batch_size=16 ", "")))
    assert "$GPUS is left as written; pass --expand-env to take it from the environment" in t.warnings
    assert any("trainer.n_gpus_per_node='$GPUS' is not a whole number" in e for e in t.errors)


def test_resume_from_path_only_matters_with_resume_path():
    t = translated(BASE + "trainer.resume_mode=auto trainer.resume_from_path=checkpoints/")
    assert t.doc["spec"]["resume"] == "auto"
    assert "trainer.resume_from_path='checkpoints/': ignored, as verl ignores it without " \
           "trainer.resume_mode=resume_path" in t.warnings
    t = translate(read_command(BASE + "trainer.resume_mode=resume_path trainer.resume_from_path=ckpt/global_step_40"))
    assert t.errors and t.errors[0].startswith("trainer.resume_from_path='ckpt/global_step_40': verl checkpoints "
                                               "are not read here")


@pytest.mark.parametrize("experiment, name", [
    ("qwen3_8b_grpo", "qwen3-8b-grpo"),
    ("DAPO-Qwen2.5-32B", "dapo-qwen2-5-32b"),
    ("__x__", "x"),
    ("a" * 80, "a" * 50),
    ("run-" + "b" * 45 + "_tail", "run-" + "b" * 45),           # cut at 50, no trailing '-'
    ("中文", "grpojob"),
])
def test_metadata_name_is_dns_1123(experiment, name):
    t = translated(BASE + f"trainer.experiment_name='{experiment}'")
    assert t.doc["metadata"]["name"] == name
    assert ObjectMeta(name=name).name == name                  # the API's own pattern and length
    assert translated(BASE + f"trainer.experiment_name='{experiment}'", name="override").job.metadata.name == "override"


# --- verl YAML configs -------------------------------------------------------------------------

VERL_YAML = """\
# a recipe config on top of verl's ppo_trainer.yaml
defaults:
  - ppo_trainer
  - _self_
data:
  train_files: [/data/gsm8k/train.parquet]
  val_files: /data/gsm8k/test.parquet
  train_batch_size: 256
  max_prompt_length: 1024
  max_response_length: 3072
  filter_overlong_prompts: true
actor_rollout_ref:
  model:
    path: Qwen/Qwen3-4B
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    ppo_mini_batch_size: 64
    ppo_micro_batch_size_per_gpu: null
    use_dynamic_bsz: true
    ppo_max_token_len_per_gpu: ${oc.select:data.max_token_budget,8192}
    loss_agg_mode: seq-mean-token-sum-norm
    loss_scale_factor: ${data.max_response_length}
    use_kl_loss: false
    optim:
      lr: 2.0e-06
      warmup_style: cosine
  rollout:
    name: vllm
    n: 8
    tensor_model_parallel_size: 1
    response_length: ${data.max_response_length}
algorithm:
  adv_estimator: grpo
  norm_adv_by_std_in_grpo: false
custom_reward_function:
  path: /rewards/my_reward.py
  name: score_fn
trainer:
  logger: [console, tensorboard]
  project_name: yaml_demo
  experiment_name: qwen3_4b_drgrpo
  n_gpus_per_node: 8
  total_training_steps: 300
  max_actor_ckpt_to_keep: ???
"""


def test_verl_yaml_config(tmp_path, capsys):
    path = tmp_path / "drgrpo.yaml"
    path.write_text(VERL_YAML)
    code, out, err = run_cli([str(path)], capsys=capsys)
    assert code == 0, err
    doc = yaml.safe_load(out)
    assert doc["metadata"] == {"name": "qwen3-4b-drgrpo"}
    assert doc["spec"] == {
        "model": {"path": "Qwen/Qwen3-4B"},
        "data": {"trainFiles": ["file:///data/gsm8k/train.parquet"], "valFiles": ["file:///data/gsm8k/test.parquet"],
                 "trainBatchSize": 256, "maxPromptLength": 1024, "maxResponseLength": 3072,
                 "filterOverlongPrompts": True},
        "algorithm": {"advEstimator": "grpo", "normAdvByStd": False, "lossAggMode": "seq-mean-token-sum-norm",
                      "lossScaleFactor": 3072, "useKLLoss": False},
        "reward": {"function": "/rewards/my_reward.py:score_fn"},
        "rollout": {"engine": "vllm", "n": 8, "placement": "colocated", "replicas": 8, "tensorParallelSize": 1},
        "trainer": {"projectName": "yaml_demo", "experimentName": "qwen3_4b_drgrpo", "nprocPerNode": 8,
                    "miniBatchSize": 64, "maxTokensPerGPU": 8192, "lr": 2e-6, "lrScheduler": "cosine",
                    "totalEpochs": 30, "totalSteps": 300, "keepCheckpoints": None,
                    "loggers": ["console", "tensorboard"]},
    }
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    # seq-mean-token-sum-norm is normalised as verl's trainer does: nothing to warn about
    assert warnings == ["warning: actor_rollout_ref.rollout.response_length=3072: ignored: " + next(
        r.note for r in rules_for("actor_rollout_ref.rollout.response_length"))]


def test_full_verl_config_dump_is_summarised():
    """`main_ppo` prints its whole resolved config; translating one gives one warning per reason."""
    sections = {"actor_rollout_ref": {"actor": {"fsdp_config": {f"knob_{i}": i + 1 for i in range(20)}},
                                      "model": {"path": "m"}, "rollout": {"n": 4, "name": "???"}},
                "algorithm": {"adv_estimator": "grpo"},
                "data": {"train_files": "s3://b/t.parquet", "train_batch_size": 256},
                "trainer": {"logger": ["console"]},
                "critic": {"enable": None, "optim": {"lr": 1e-5}}}
    t = translate(read_yaml(sections))
    assert not t.errors
    fsdp = [w for w in t.warnings if "fsdp_config" in w]
    assert len(fsdp) == 1 and fsdp[0].count("fsdp_config.knob_") == 8 and " and 12 more: ignored" in fsdp[0]
    assert "rollout" in t.doc["spec"] and "engine" not in t.doc["spec"]["rollout"]   # ??? = not set


# --- verl reward functions, used unchanged -----------------------------------------------------

VERL_REWARD_FILE = '''\
"""A verl custom reward: the answer after "####" must match, the format earns 0.1."""
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    match = re.search(r"#### *(-?[0-9.,]+)", solution_str)
    if match is None:
        return 0.0
    answer = match.group(1).replace(",", "").rstrip(".")
    return {"score": 1.0 if answer == ground_truth else 0.1, "split": (extra_info or {}).get("split")}


def strict_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip().endswith("#### " + ground_truth) else 0.0
'''


def test_verl_custom_reward_file_is_loaded_and_used_unchanged(tmp_path):
    rewards = pytest.importorskip("grpo_rollout.rewards")
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(VERL_REWARD_FILE)
    t = translated(BASE + f"custom_reward_function.path={reward_file} custom_reward_function.name=strict_score")
    assert t.job.spec.reward.function == f"{reward_file}:strict_score"
    strict = rewards.load_reward_function(t.job.spec.reward.function)
    assert strict("openai/gsm8k", "... so she has 1200 left. #### 1200", "1200") == 1.0
    assert strict("openai/gsm8k", "#### 1,200", "1200") == 0.0
    # name left out: verl's default compute_score
    t = translated(BASE + f"custom_reward_function.path={reward_file}")
    assert t.job.spec.reward.function == f"{reward_file}:compute_score"
    score = rewards.load_reward_function(t.job.spec.reward.function)
    extra = {"split": "test", "index": 3}
    assert score("openai/gsm8k", "She pays 3 * 400 = 1,200 dollars.\n#### 1,200", "1200", extra) == \
        {"score": 1.0, "split": "test"}
    assert score("openai/gsm8k", "#### 1100", "1200") == {"score": 0.1, "split": None}
    assert score("openai/gsm8k", "no final answer", "1200") == 0.0


def test_verl_custom_reward_file_through_the_reward_pool(tmp_path):
    rewards = pytest.importorskip("grpo_rollout.rewards")
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(VERL_REWARD_FILE)
    job = translated(BASE + f"custom_reward_function.path={reward_file}").job
    pool = rewards.RewardPool(job.spec.reward.function, workers=1, timeout_seconds=job.spec.reward.timeout_seconds)
    try:
        results = pool.score([
            rewards.RewardRequest("openai/gsm8k", "1,000 + 200 = 1,200\n#### 1,200", "1200", {"split": "train"}),
            rewards.RewardRequest("openai/gsm8k", "#### 7", "1200", None),
        ])
    finally:
        pool.close()
    assert [(r.score, r.extra, r.error) for r in results] == [(1.0, {"split": "train"}, None),
                                                              (0.1, {"split": None}, None)]


def test_verl_reward_kwargs_reach_every_call_of_the_function(tmp_path):
    """custom_reward_function.reward_kwargs (verl merges them into every compute_score call) become
    reward.kwargs; without a custom function verl ignores them, and so does the translation."""
    rewards = pytest.importorskip("grpo_rollout.rewards")
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, *, "
                           "format_score=0.0, marker=None, **kwargs):\n"
                           "    return 1.0 if solution_str.endswith(marker['text'] + ' ' + ground_truth) else format_score\n")
    t = translated(BASE + f"custom_reward_function.path={reward_file} "
                   "+custom_reward_function.reward_kwargs.format_score=0.25 "
                   "+custom_reward_function.reward_kwargs.marker.text='####'")
    assert t.job.spec.reward.kwargs == {"format_score": 0.25, "marker": {"text": "####"}}
    pool = rewards.RewardPool(t.job.spec.reward.function, workers=1, timeout_seconds=10,
                              kwargs=t.job.spec.reward.kwargs)
    try:
        assert [r.score for r in pool.score([rewards.RewardRequest("d", "#### 12", "12"),
                                             rewards.RewardRequest("d", "#### 11", "12")])] == [1.0, 0.25]
    finally:
        pool.close()
    t = translated(BASE + "+custom_reward_function.reward_kwargs.format_score=0.25")
    assert "kwargs" not in t.doc["spec"].get("reward", {})
    assert any("reward_kwargs.format_score=0.25: ignored, as verl ignores it without custom_reward_function.path" in w
               for w in t.warnings)


# --- the table and its document ----------------------------------------------------------------

def test_every_mapped_field_exists_in_the_grpojob():
    for rule in RULES:
        if rule.kind in ("map",):
            assert rule.field, rule
            model = GRPOJob if rule.field.startswith("metadata.") else GRPOJobSpec
            *parents, leaf = rule.field.split(".")
            for p in parents:
                model = _child_model(model, p)
                assert model is not None, rule
            assert leaf in {f.alias or n for n, f in model.model_fields.items()}, rule
        else:
            assert rule.note and (rule.kind != "check" or rule.convert), rule
    pairs = [(r.verl, r.field) for r in RULES]
    assert len(pairs) == len(set(pairs))


def test_every_key_in_verls_grpo_dapo_examples_has_a_rule():
    used = re.findall(r"(?:^|\s)\+?([a-z_]+(?:\.[A-Za-z_0-9]+)+)=", SEED_SCRIPT + DAPO_SCRIPT + BASE)
    assert used and all(rules_for(k) for k in used), [k for k in used if not rules_for(k)]

# Every key set in verl's examples/grpo_trainer/*.sh, tests/special_e2e/run_dapo.sh and the DAPO
# recipe scripts (verl b178a3c): each must have a rule, so none is reported as unknown.
VERL_EXAMPLE_KEYS = """
    actor_rollout_ref.actor.checkpoint.save_contents actor_rollout_ref.actor.clip_ratio_c
    actor_rollout_ref.actor.clip_ratio_high actor_rollout_ref.actor.clip_ratio_low
    actor_rollout_ref.actor.entropy_coeff actor_rollout_ref.actor.freeze_vision_tower
    actor_rollout_ref.actor.fsdp_config.forward_prefetch actor_rollout_ref.actor.fsdp_config.fsdp_size
    actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype
    actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype
    actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype
    actor_rollout_ref.actor.fsdp_config.model_dtype actor_rollout_ref.actor.fsdp_config.optimizer_offload
    actor_rollout_ref.actor.fsdp_config.param_offload actor_rollout_ref.actor.fsdp_config.use_orig_params
    actor_rollout_ref.actor.grad_clip actor_rollout_ref.actor.kl_loss_coef actor_rollout_ref.actor.kl_loss_type
    actor_rollout_ref.actor.loss_agg_mode actor_rollout_ref.actor.megatron.context_parallel_size
    actor_rollout_ref.actor.megatron.dist_checkpointing_path
    actor_rollout_ref.actor.megatron.expert_model_parallel_size
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size actor_rollout_ref.actor.megatron.grad_offload
    actor_rollout_ref.actor.megatron.optimizer_offload
    actor_rollout_ref.actor.megatron.override_transformer_config.account_for_embedding_in_pipeline_split
    actor_rollout_ref.actor.megatron.override_transformer_config.account_for_loss_in_pipeline_split
    actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend
    actor_rollout_ref.actor.megatron.override_transformer_config.bias_activation_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.bias_dropout_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.deallocate_pipeline_outputs
    actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.masked_softmax_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_enable_deepep
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_permute_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_shared_expert_overlap
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff
    actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage
    actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage
    actor_rollout_ref.actor.megatron.override_transformer_config.persist_layer_norm
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers
    actor_rollout_ref.actor.megatron.param_offload actor_rollout_ref.actor.megatron.pipeline_model_parallel_size
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size
    actor_rollout_ref.actor.megatron.use_dist_checkpointing actor_rollout_ref.actor.megatron.use_mbridge
    actor_rollout_ref.actor.megatron.vanilla_mbridge
    actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size
    actor_rollout_ref.actor.optim.clip_grad actor_rollout_ref.actor.optim.lr
    actor_rollout_ref.actor.optim.lr_decay_style actor_rollout_ref.actor.optim.lr_warmup_steps
    actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload
    actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction
    actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d
    actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer
    actor_rollout_ref.actor.optim.weight_decay actor_rollout_ref.actor.policy_loss.loss_mode
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    actor_rollout_ref.actor.ppo_mini_batch_size actor_rollout_ref.actor.profiler.all_ranks
    actor_rollout_ref.actor.profiler.enable actor_rollout_ref.actor.profiler.ranks
    actor_rollout_ref.actor.profiler.tool_config.npu.analysis
    actor_rollout_ref.actor.profiler.tool_config.npu.contents
    actor_rollout_ref.actor.profiler.tool_config.npu.discrete
    actor_rollout_ref.actor.profiler.tool_config.npu.level actor_rollout_ref.actor.strategy
    actor_rollout_ref.actor.ulysses_sequence_parallel_size actor_rollout_ref.actor.use_dynamic_bsz
    actor_rollout_ref.actor.use_kl_loss actor_rollout_ref.actor.use_torch_compile
    actor_rollout_ref.hybrid_engine actor_rollout_ref.model.enable_gradient_checkpointing
    actor_rollout_ref.model.exclude_modules actor_rollout_ref.model.lora.alpha
    actor_rollout_ref.model.lora.lora_A_init_method actor_rollout_ref.model.lora.rank
    actor_rollout_ref.model.lora_adapter_path actor_rollout_ref.model.lora_alpha
    actor_rollout_ref.model.lora_rank actor_rollout_ref.model.override_config.max_position_embeddings
    actor_rollout_ref.model.override_config.model_config.max_position_embeddings actor_rollout_ref.model.path
    actor_rollout_ref.model.target_modules actor_rollout_ref.model.trust_remote_code
    actor_rollout_ref.model.use_fused_kernels actor_rollout_ref.model.use_remove_padding
    actor_rollout_ref.model.use_shm actor_rollout_ref.nccl_timeout
    actor_rollout_ref.ref.fsdp_config.forward_prefetch actor_rollout_ref.ref.fsdp_config.param_offload
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz actor_rollout_ref.ref.megatron.context_parallel_size
    actor_rollout_ref.ref.megatron.dist_checkpointing_path
    actor_rollout_ref.ref.megatron.expert_model_parallel_size
    actor_rollout_ref.ref.megatron.expert_tensor_parallel_size actor_rollout_ref.ref.megatron.param_offload
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size
    actor_rollout_ref.ref.megatron.use_dist_checkpointing
    actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size actor_rollout_ref.ref.profiler.all_ranks
    actor_rollout_ref.ref.profiler.enable actor_rollout_ref.ref.profiler.ranks
    actor_rollout_ref.ref.profiler.tool_config.npu.analysis
    actor_rollout_ref.ref.profiler.tool_config.npu.contents
    actor_rollout_ref.ref.profiler.tool_config.npu.discrete actor_rollout_ref.ref.profiler.tool_config.npu.level
    actor_rollout_ref.ref.strategy actor_rollout_ref.ref.ulysses_sequence_parallel_size
    actor_rollout_ref.ref.use_torch_compile actor_rollout_ref.rollout.calculate_log_probs
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes
    actor_rollout_ref.rollout.data_parallel_size actor_rollout_ref.rollout.enable_chunked_prefill
    actor_rollout_ref.rollout.enforce_eager actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend
    actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_max_tokens_ratio
    actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters
    actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache
    actor_rollout_ref.rollout.expert_parallel_size actor_rollout_ref.rollout.free_cache_engine
    actor_rollout_ref.rollout.gpu_memory_utilization actor_rollout_ref.rollout.layered_summon
    actor_rollout_ref.rollout.load_format actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz actor_rollout_ref.rollout.max_num_batched_tokens
    actor_rollout_ref.rollout.max_num_seqs actor_rollout_ref.rollout.mode
    actor_rollout_ref.rollout.multi_stage_wake_up actor_rollout_ref.rollout.multi_turn.format
    actor_rollout_ref.rollout.n actor_rollout_ref.rollout.name actor_rollout_ref.rollout.temperature
    actor_rollout_ref.rollout.tensor_model_parallel_size actor_rollout_ref.rollout.top_k
    actor_rollout_ref.rollout.top_p actor_rollout_ref.rollout.val_kwargs.do_sample
    actor_rollout_ref.rollout.val_kwargs.n actor_rollout_ref.rollout.val_kwargs.temperature
    actor_rollout_ref.rollout.val_kwargs.top_k actor_rollout_ref.rollout.val_kwargs.top_p
    algorithm.adv_estimator algorithm.filter_groups.enable algorithm.filter_groups.max_num_gen_batches
    algorithm.filter_groups.metric algorithm.kl_ctrl.kl_coef algorithm.rollout_correction.rollout_is_threshold
    algorithm.use_kl_in_reward custom_reward_function.name custom_reward_function.path
    data.apply_chat_template_kwargs.reasoning_effort data.custom_cls.name data.custom_cls.path
    data.filter_overlong_prompts data.gen_batch_size data.image_key data.max_prompt_length
    data.max_response_length data.prompt_key data.return_raw_chat data.shuffle data.train_batch_size
    data.train_files data.truncation data.trust_remote_code data.val_files
    global_profiler.global_tool_config.torch_memory.stack_depth
    global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries global_profiler.save_path
    global_profiler.steps global_profiler.tool reward_model.enable reward_model.model.path
    reward_model.num_workers reward_model.overlong_buffer.enable reward_model.overlong_buffer.len
    reward_model.overlong_buffer.penalty_factor reward_model.reward_kwargs.max_resp_len
    reward_model.reward_kwargs.overlong_buffer_cfg.enable reward_model.reward_kwargs.overlong_buffer_cfg.len
    reward_model.reward_kwargs.overlong_buffer_cfg.log
    reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor reward_model.reward_manager
    reward_model.rollout.gpu_memory_utilization reward_model.rollout.name reward_model.rollout.prompt_length
    reward_model.rollout.response_length reward_model.rollout.tensor_model_parallel_size
    reward_model.use_reward_loop trainer.critic_warmup trainer.default_local_dir trainer.experiment_name
    trainer.log_val_generations trainer.logger trainer.n_gpus_per_node trainer.nnodes trainer.project_name
    trainer.resume_from_path trainer.resume_mode trainer.save_freq trainer.test_freq trainer.total_epochs
    trainer.total_training_steps trainer.use_legacy_worker_impl trainer.val_before_train
""".split()


def test_every_key_of_verls_grpo_and_dapo_examples_has_a_rule():
    missing = [k for k in VERL_EXAMPLE_KEYS if not rules_for(k)]
    assert len(VERL_EXAMPLE_KEYS) > 200 and not missing, missing


def test_migration_doc_table_matches_the_code():
    doc = (REPO / "docs" / "MIGRATING_FROM_VERL.md").read_text()
    begin, end = "<!-- BEGIN verl-key-table (generated: grpo from-verl --markdown-table) -->\n", \
        "<!-- END verl-key-table -->"
    assert begin in doc and end in doc
    in_doc = doc.split(begin, 1)[1].split(end, 1)[0]
    assert in_doc == markdown_table(), "docs/MIGRATING_FROM_VERL.md is stale: paste `grpo from-verl --markdown-table`"


def test_migration_doc_worked_example_is_what_the_tool_writes():
    doc = (REPO / "docs" / "MIGRATING_FROM_VERL.md").read_text()
    block = doc.split("<!-- BEGIN worked-example -->\n```yaml\n", 1)[1].split("```\n<!-- END worked-example -->", 1)[0]
    from grpo_api.from_verl import render
    assert block == render(translated(SEED_SCRIPT), "run_grpo.sh")
    assert parse_job(yaml.safe_load(block)) == translated(SEED_SCRIPT).job


def test_verls_other_policy_losses_and_their_keys():
    # SAPO, as verl's example writes it (tau_* under policy_loss; verl's own keys are actor.tau_*):
    # verl aggregates SAPO as seq-mean-token-mean whatever loss_agg_mode says, and so does the job
    t = translated(BASE + "actor_rollout_ref.actor.policy_loss.loss_mode=sapo "
                          "actor_rollout_ref.actor.policy_loss.tau_pos=1.0 actor_rollout_ref.actor.policy_loss.tau_neg=1.2")
    algo = t.doc["spec"]["algorithm"]
    assert (algo["policyLoss"], algo["lossAggMode"], algo["policyLossConfig"]) == (
        "sapo", "seq-mean-token-mean", {"tauPos": 1.0, "tauNeg": 1.2})
    t = translated(BASE + "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean actor_rollout_ref.actor.use_kl_loss=True "
                          "actor_rollout_ref.actor.loss_agg_mode=token-mean")
    assert t.doc["spec"]["algorithm"]["lossAggMode"] == "seq-mean-token-mean"
    assert any("whatever this says" in w for w in t.warnings)
    assert any("KL loss and entropy bonus are aggregated as seq-mean-token-mean too (verl: as token-mean)" in w
               for w in t.warnings)
    # the entropy-mechanism recipe's keys; the loss modes that aggregate per token keep the mode asked for
    t = translated(BASE + "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov actor_rollout_ref.actor.loss_agg_mode="
                          "token-mean actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.002 "
                          "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1 actor_rollout_ref.actor.clip_ratio_c=10.0")
    algo = t.doc["spec"]["algorithm"]
    assert (algo["policyLoss"], algo["lossAggMode"], algo["policyLossConfig"]) == (
        "kl_cov", "token-mean", {"klCovRatio": 0.002, "ppoKlCoef": 1})
    t = translated(BASE + "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov "
                          "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.0002 "
                          "actor_rollout_ref.actor.policy_loss.clip_cov_lb=1.0 actor_rollout_ref.actor.policy_loss.clip_cov_ub=5.0")
    assert t.doc["spec"]["algorithm"]["policyLossConfig"] == {"clipCovRatio": 0.0002, "clipCovLb": 1.0, "clipCovUb": 5.0}
    assert "lossAggMode" not in t.doc["spec"]["algorithm"]
    # CISPO's recipe leaves the ratio unbounded below with clip_ratio_low=10; GPG with its estimator
    t = translated(BASE + "actor_rollout_ref.actor.policy_loss.loss_mode=cispo actor_rollout_ref.actor.clip_ratio_low=10")
    assert t.doc["spec"]["algorithm"]["clipRatioLow"] == 10
    t = translated(BASE.replace("algorithm.adv_estimator=grpo", "algorithm.adv_estimator=gpg")
                   + "actor_rollout_ref.actor.policy_loss.loss_mode=gpg")
    assert (t.doc["spec"]["algorithm"]["advEstimator"], t.doc["spec"]["algorithm"]["policyLoss"]) == ("gpg", "gpg")
    t = translated(BASE + "actor_rollout_ref.actor.policy_loss.loss_mode=dro actor_rollout_ref.actor.policy_loss.dro_beta=0.1")
    assert t.doc["spec"]["algorithm"]["policyLossConfig"] == {"droBeta": 0.1}


def test_unsupported_is_a_value_error():
    assert issubclass(Unsupported, ValueError)
    with pytest.raises(Unsupported):
        next(r for r in RULES if r.verl == "algorithm.adv_estimator").convert("remax", None)
    assert markdown_table().count("\n") == len(RULES) + 2


def test_actor_offload_maps_only_where_verl_has_a_phase_to_free_the_gpus_for():
    # verl's hybrid engine moves the actor off the GPUs while it generates: so does colocated
    # placement here; separate placement's trainer GPUs are its own (nothing to free them for).
    offload = (" actor_rollout_ref.actor.fsdp_config.param_offload=True"
               " actor_rollout_ref.actor.fsdp_config.optimizer_offload=True")
    trainer = translated(SEED_COMMAND + offload).doc["spec"]["trainer"]
    assert trainer["paramOffload"] is True and trainer["optimizerOffload"] is True
    separate = translated(SEED_COMMAND + offload + " actor_rollout_ref.hybrid_engine=False").doc["spec"]
    assert "paramOffload" not in separate["trainer"] and "optimizerOffload" not in separate["trainer"]
    assert separate["rollout"]["placement"] == "separate"
