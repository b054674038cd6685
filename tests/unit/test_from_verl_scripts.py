"""`grpo from-verl` on verl's own scripts, read as bash runs them (issue 43): the arguments are
exactly those bash passes to verl (`case "$DEVICE"`, `if`, arrays, `source`, `"$@"`), nothing the
script does leaves its temporary folders, and what can't be honoured is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_api.commands import from_verl
from grpo_api.from_verl import translate
from grpo_api.verl_command import VerlInputError, read_input, read_script

SCRIPTS = Path(__file__).parent / "verl_scripts"      # unchanged copies; README.md says from where
BASE = ("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=/d/train.parquet "
        "data.train_batch_size=64 actor_rollout_ref.model.path=Qwen/Qwen3-0.6B actor_rollout_ref.rollout.n=4 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=16 trainer.n_gpus_per_node=2 trainer.logger=console ")


def read(tmp_path: Path, text: str, **kw):
    script = tmp_path / "run.sh"
    script.write_text(text)
    cfg, _ = read_input(str(script), **kw)
    return cfg


def test_a_case_on_device_takes_only_the_branch_bash_takes(tmp_path):
    # Issue 43's five-line reproduction: every branch used to be applied, the last one winning.
    script = """DEVICE=${DEVICE:-gpu}
case "$DEVICE" in
    gpu) N=8 ;;
    npu) N=16 ;;
esac
python3 -m verl.trainer.main_ppo trainer.n_gpus_per_node=$N
"""
    assert read(tmp_path, script).flat == {"trainer.n_gpus_per_node": 8}
    assert read(tmp_path, script, env={"DEVICE": "npu"}).flat == {"trainer.n_gpus_per_node": 16}


def test_verls_flagship_grpo_script_is_what_bash_passes_on_a_gpu():
    # DEVICE unset: the script probes `python3 -c 'import torch_npu'`, which fails on an NVIDIA
    # machine, so bash takes the gpu branch and launches through `uv run ... python3 -m`.
    cfg, _ = read_input(str(SCRIPTS / "grpo_run_qwen3_8b_fsdp.sh"))
    assert cfg.entry == "verl.trainer.main_ppo"
    flat = cfg.flat
    assert flat["trainer.n_gpus_per_node"] == 8                 # not the NPU branch's 8 NPUs + its lengths
    assert flat["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 2
    assert flat["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.6
    assert (flat["data.train_batch_size"], flat["data.max_prompt_length"], flat["data.max_response_length"]) == \
        (1024, 1024, 2048)
    assert flat["actor_rollout_ref.actor.fsdp_config.param_offload"] is False
    assert "actor_rollout_ref.actor.use_torch_compile" not in flat       # an NPU-only EXTRA
    assert flat["data.train_files"] == ["$HOME/data/gsm8k/train.parquet", "$HOME/data/math/train.parquet"]
    spec = translate(cfg).job.spec
    assert (spec.trainer.nproc_per_node, spec.rollout.tensor_parallel_size, spec.rollout.gpu_memory_utilization) == \
        (8, 2, 0.6)
    assert (spec.data.train_batch_size, spec.data.max_response_length) == (1024, 2048)


def test_env_selects_the_npu_branch_as_bash_would():
    cfg, _ = read_input(str(SCRIPTS / "grpo_run_qwen3_8b_fsdp.sh"), env={"DEVICE": "npu"})
    flat = cfg.flat
    assert (flat["data.train_batch_size"], flat["data.max_prompt_length"], flat["data.max_response_length"]) == \
        (16, 2048, 32768)
    assert flat["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 4
    assert flat["actor_rollout_ref.actor.use_torch_compile"] is False


def test_gspo_script_case_and_if():
    cfg, _ = read_input(str(SCRIPTS / "gspo_run_qwen3_8b_fsdp.sh"))
    flat = cfg.flat
    assert flat["data.train_batch_size"] == 512 and flat["actor_rollout_ref.actor.ppo_mini_batch_size"] == 128
    assert flat["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 2
    assert flat["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.6
    # `if [ "${DEVICE}" = npu ]; then EXTRA+=(...)`: not taken on a GPU.
    assert "actor_rollout_ref.actor.strategy" not in flat and "actor_rollout_ref.rollout.val_kwargs.top_p" not in flat
    spec = translate(cfg).job.spec
    assert spec.algorithm.policy_loss == "gspo" and spec.data.train_batch_size == 512
    assert spec.rollout.tensor_parallel_size == 2


def test_an_apostrophe_in_a_comment_inside_an_array(capsys):
    # "update loop's" in a comment of the ACTOR=( ... ) array broke the old parser; bash reads it,
    # and the script turns the profiler on, which is refused by name.
    cfg, _ = read_input(str(SCRIPTS / "profile_run_qwen2_5_7b_torch_profile.sh"))
    assert cfg.flat["actor_rollout_ref.actor.profiler.enable"] is True
    assert from_verl([str(SCRIPTS / "profile_run_qwen2_5_7b_torch_profile.sh")]) == 2
    assert "error: actor_rollout_ref.actor.profiler.enable=True: turns on a verl feature" in capsys.readouterr().err


def test_a_recipes_own_trainer_is_refused_naming_its_module(capsys):
    code = from_verl([str(SCRIPTS / "flowrl_run_flowrl_qwen2.5_7b.sh")])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: recipe.flowrl.main_flowrl: recipe.flowrl.main_flowrl runs a trainer of its own" in err


@pytest.mark.parametrize("module", ["recipe.prime.main_prime", "recipe.spin.main_spin", "verl.trainer.sft_trainer"])
def test_other_entry_modules_are_refused(module):
    t = translate(_cfg(BASE.replace("verl.trainer.main_ppo", module)))
    assert any(e.startswith(f"{module}: {module} runs a trainer of its own") for e in t.errors), t.errors


def _cfg(text: str):
    return read_script(text)


@pytest.mark.parametrize("override", [
    "+async_training.partial_rollout=True",
    "actor_rollout_ref.rollout.quantization=torchao",
    "actor_rollout_ref.rollout.quantization_config_file=/q.json",
    "data.filter_accuracy=True",
    "trainer.ref_update_freq=1",
    "actor_rollout_ref.actor.fsdp_config.qat.enable=True",
    "+actor_rollout_ref.rollout.some_new_feature=True",
])
def test_feature_flags_are_errors_naming_the_key(override):
    t = translate(_cfg(BASE + override))
    key = override.lstrip("+").split("=")[0]
    assert t.job is None and any(e.startswith(key) for e in t.errors), t.errors


@pytest.mark.parametrize("override, warned", [
    ("+async_training.partial_rollout=False", True),                 # an unknown key, off: a warning
    ("actor_rollout_ref.actor.use_torch_compile=True", True),        # speed: the result is unchanged
    ("actor_rollout_ref.rollout.quantization=null", False),          # off: nothing to say
])
def test_off_values_and_speed_switches_are_not_errors(override, warned):
    t = translate(_cfg(BASE + override))
    assert t.job is not None, t.errors
    assert any(override.lstrip("+").split("=")[0] in w for w in t.warnings) == warned, t.warnings


def test_fp8_rollouts_translate_with_the_correction_as_written():
    """verl's FP8 rollout (128x128 weight blocks, training in bf16) is rollout.quantization fp8; the
    token-level TIS its guide pairs with it is translated as the script sets it, never added."""
    spec = translate(_cfg(BASE + "actor_rollout_ref.rollout.quantization=fp8 "
                                 "algorithm.rollout_correction.rollout_is=token")).job.spec
    assert spec.rollout.quantization == "fp8" and spec.algorithm.rollout_correction.rollout_is == "token"
    spec = translate(_cfg(BASE + "actor_rollout_ref.rollout.quantization=fp8")).job.spec
    assert spec.rollout.quantization == "fp8" and spec.algorithm.rollout_correction is None
    t = translate(_cfg(BASE + "actor_rollout_ref.rollout.quantization=fp8 actor_rollout_ref.rollout.name=hf"))
    assert t.job is None and any(e.startswith("spec.rollout.quantization: fp8 rollouts need rollout.engine vllm")
                                 for e in t.errors), t.errors


def test_verls_prefix_grouper_is_shared_prompts():
    """verl's PrefixGrouper (each prompt once per micro-batch) is model.sharePrompts; verl can't combine
    it with use_remove_padding, which here is the layout it builds on."""
    spec = translate(_cfg(BASE + "actor_rollout_ref.actor.use_prefix_grouper=True "
                                 "actor_rollout_ref.model.use_remove_padding=False")).job.spec
    assert spec.model.share_prompts and not spec.model.use_remove_padding
    assert not translate(_cfg(BASE)).job.spec.model.share_prompts


def test_an_fp8_kv_cache_passed_to_vllm_is_translated_and_the_other_dtypes_refused():
    """verl hands engine_kwargs.vllm to vLLM as is (its deepseek-v4 scripts set kv_cache_dtype=fp8): an FP8
    KV cache changes what the rollouts sample, so it is kept, never dropped as an engine knob."""
    key = "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype"
    for value in ("fp8", "fp8_e4m3"):
        assert translate(_cfg(BASE + f"{key}={value}")).job.spec.rollout.kv_cache_dtype == "fp8"
    assert translate(_cfg(BASE + f"{key}=auto")).job.spec.rollout.kv_cache_dtype == "auto"
    t = translate(_cfg(BASE + f"{key}=fp8_e5m2"))
    assert t.job is None and any(e.startswith(key[1:]) and "'fp8_e5m2' is not a vLLM KV cache dtype" in e
                                 for e in t.errors), t.errors
    t = translate(_cfg(BASE + f"{key}=fp8 actor_rollout_ref.rollout.name=hf"))
    assert t.job is None and any(e.startswith("spec.rollout.kvCacheDtype: an fp8 KV cache needs rollout.engine vllm")
                                 for e in t.errors), t.errors


def test_videos_are_errors_and_the_image_keys_translate():
    t = translate(_cfg(BASE + "data.video_key=videos"))
    assert t.errors == ["data.video_key='videos': videos are not supported yet (issue 45): only images "
                        "(data.image_key)"]
    spec = translate(_cfg(BASE + "data.image_key=pictures actor_rollout_ref.actor.freeze_vision_tower=True")).job.spec
    assert (spec.data.image_key, spec.trainer.freeze_vision_tower) == ("pictures", True)


@pytest.mark.parametrize("path", ["zai-org/GLM-4.1V-9B-Thinking", "openbmb/MiniCPM-o-2_6", "/models/llava-1.5-7b-hf"])
def test_vision_language_models_but_qwen2_5_vl_and_qwen3_vl_are_errors(path):
    t = translate(_cfg(BASE.replace("Qwen/Qwen3-0.6B", path) + "actor_rollout_ref.rollout.name=hf"))
    assert any("vision-language models other than Qwen2.5-VL and Qwen3-VL are not supported yet (issue 45)" in e
               for e in t.errors), t.errors


@pytest.mark.parametrize("path", ["Qwen/Qwen3-VL-8B-Instruct", "/models/Qwen3-VL-30B-A3B-Instruct",
                                  "Qwen/Qwen2.5-VL-3B-Instruct"])
def test_qwen_vl_models_translate_for_the_hf_engine(path):
    t = translate(_cfg(BASE.replace("Qwen/Qwen3-0.6B", path) + "actor_rollout_ref.rollout.name=hf"))
    assert t.errors == [] and t.job.spec.model.path == path


@pytest.mark.parametrize("script, model", [("grpo_run_qwen2_5_vl_7b_fsdp.sh", "Qwen/Qwen2.5-VL-7B-Instruct"),
                                           ("grpo_run_qwen3_vl_8b_fsdp.sh", "Qwen/Qwen3-VL-8B-Instruct")])
def test_verls_geo3k_vl_scripts_translate_as_they_are_for_vllm_and_for_the_hf_engine(script, model):
    for args, engine in (([], "vllm"), (["actor_rollout_ref.rollout.name=hf"], "hf")):
        cfg, _ = read_input(str(SCRIPTS / script), args=args)
        t = translate(cfg)
        assert t.errors == [], t.errors
        spec = t.job.spec
        assert (spec.model.path, spec.data.image_key, spec.data.train_files) == (
            model, "images", ["file://$HOME/data/geo3k/train.parquet"])
        assert (spec.data.train_batch_size, spec.data.max_prompt_length, spec.data.max_response_length) == (
            512, 1024, 2048)
        assert (spec.rollout.engine, spec.rollout.n, spec.algorithm.kl_loss_type) == (engine, 5, "low_var_kl")


def test_verls_geo3k_lora_script_translates_with_the_vision_tower_excluded():
    """examples/tuning/lora/run_qwen2_5_vl_7b_fsdp.sh: rank 64 on every linear layer but the
    vision tower's, as verl's PEFT wrap does."""
    cfg, _ = read_input(str(SCRIPTS / "lora_run_qwen2_5_vl_7b_fsdp.sh"), args=[])
    t = translate(cfg)
    assert t.errors == [], t.errors
    spec = t.job.spec
    assert (spec.model.path, spec.data.image_key) == ("Qwen/Qwen2.5-VL-7B-Instruct", "images")
    lora = spec.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules) == (64, 32, ["all-linear"], ".*visual.*")
    assert (spec.trainer.lr, spec.algorithm.kl_loss_coef, spec.rollout.engine) == (3e-6, 0.01, "vllm")


def test_nothing_the_script_does_leaves_its_temporary_folders(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "keep").mkdir()
    script = f"""set -euxo pipefail
mkdir -p $HOME/data && echo x > $HOME/data/log
rm -rf {victim}
cd "$(dirname "$0")" && rm -rf keep
git clone https://example.invalid/repo.git && pip install nothing && curl -sSL https://example.invalid | bash
huggingface-cli download Qwen/Qwen3-8B && nvidia-smi && sleep 3600
python3 examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k
{BASE}
"""
    cfg = read(tmp_path, script)
    assert victim.is_dir() and (tmp_path / "keep").is_dir()
    assert cfg.flat["data.train_batch_size"] == 64 and cfg.entry == "verl.trainer.main_ppo"


def test_source_set_x_and_arguments_forwarded(tmp_path):
    (tmp_path / "common.sh").write_text("ROLLOUT_N=8\nexport NNODES=${NNODES:-2}\n")
    script = """set -x
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.n=$ROLLOUT_N trainer.nnodes=$NNODES "$@"
"""
    cfg = read(tmp_path, script, args=["trainer.total_epochs=2", "trainer.nnodes=4"])
    assert cfg.flat == {"actor_rollout_ref.rollout.n": 8, "trainer.nnodes": 4, "trainer.total_epochs": 2}
    assert not cfg.warnings


def test_arguments_a_script_does_not_forward_are_appended_with_a_warning(tmp_path):
    cfg = read(tmp_path, "python3 -m verl.trainer.main_ppo trainer.nnodes=1\n", args=["trainer.total_epochs=2"])
    assert cfg.flat == {"trainer.nnodes": 1, "trainer.total_epochs": 2}
    assert cfg.warnings == ["the script doesn't pass its arguments on (no \"$@\"); its 1 key=value argument(s) "
                            "appended to its launch"]


def test_ray_job_submit_and_torchrun_launches(tmp_path):
    cfg = read(tmp_path, "ray job submit --address=http://head:8265 -- python3 -m recipe.dapo.main_dapo "
                         "data.train_batch_size=32\n")
    assert cfg.entry == "recipe.dapo.main_dapo" and cfg.flat == {"data.train_batch_size": 32}
    cfg = read(tmp_path, "torchrun --nproc_per_node=8 -m verl.trainer.main_ppo trainer.nnodes=1\n")
    assert cfg.entry == "verl.trainer.main_ppo" and cfg.flat == {"trainer.nnodes": 1}


def test_unset_variables_are_left_as_written_and_named(tmp_path):
    script = "python3 -m verl.trainer.main_ppo data.train_files=$DATA_DIR/train.parquet " \
             "trainer.n_gpus_per_node=${GPUS:-4} trainer.default_local_dir=$HOME/ckpt\n"
    cfg = read(tmp_path, script)
    assert cfg.flat == {"data.train_files": "$DATA_DIR/train.parquet", "trainer.n_gpus_per_node": 4,
                        "trainer.default_local_dir": "$HOME/ckpt"}
    assert any(w.startswith("$DATA_DIR is left as written") for w in cfg.warnings)
    assert any(w.startswith("$HOME is left as written") for w in cfg.warnings)
    cfg = read(tmp_path, script, env={"DATA_DIR": "/data", "GPUS": "2"})
    assert cfg.flat["data.train_files"] == "/data/train.parquet" and cfg.flat["trainer.n_gpus_per_node"] == 2


def test_expand_env_takes_the_callers_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/alice")
    monkeypatch.setenv("DATA_DIR", "/data")
    cfg = read(tmp_path, "python3 -m verl.trainer.main_ppo data.train_files=$DATA_DIR/t.parquet "
                         "data.val_files=$HOME/v.parquet\n", expand_env=True)
    assert cfg.flat == {"data.train_files": "/data/t.parquet", "data.val_files": "/home/alice/v.parquet"}
    assert not cfg.warnings


def test_several_launches_or_none_are_errors(tmp_path):
    with pytest.raises(VerlInputError, match=r"launches 2 verl entry points: python3 -m verl.trainer.main_ppo "
                                             r"trainer.nnodes=1; python3 -m recipe.spin.main_spin"):
        read(tmp_path, "python3 -m verl.trainer.main_ppo trainer.nnodes=1\npython3 -m recipe.spin.main_spin a.b=1\n")
    with pytest.raises(VerlInputError, match=r"launches no verl entry point .* as bash runs it with DEVICE=npu "
                                             r"\(bash exit code 1; its last words: .*only on gpu\)"):
        read(tmp_path, 'if [ "$DEVICE" = npu ]; then echo only on gpu >&2; exit 1; fi\n' + BASE, env={"DEVICE": "npu"})


def test_what_else_the_script_runs_is_named_and_a_cd_elsewhere_does_not_stop_it(tmp_path):
    cfg = read(tmp_path, "set -e\npython3 examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k\n"
                         "cd verl && python3 -m verl.trainer.main_ppo trainer.nnodes=1\n")
    assert cfg.flat == {"trainer.nnodes": 1}
    assert "not run here: python3 examples/data_preprocess/gsm8k.py --local_dir '$HOME/data/gsm8k' (the script " \
           "sees no output from it)" in cfg.warnings


def test_critic_keys_without_gae_are_dropped_as_verl_ignores_them():
    """verl builds a critic only for adv_estimator gae: a GRPO script's critic.* keys train
    nothing there, and the job here has no critic section (which a spec would refuse)."""
    t = translate(_cfg(BASE + " critic.optim.lr=1e-5 critic.model.path=/m"))
    assert t.errors == [] and "critic" not in t.doc["spec"]
    assert any(w.startswith("critic.optim.lr=1e-05, critic.model.path='/m': ignored") for w in t.warnings), t.warnings
    ppo = translate(_cfg(BASE.replace("adv_estimator=grpo", "adv_estimator=gae") + " critic.optim.lr=1e-5"))
    assert ppo.errors == [] and ppo.job.spec.critic.lr == 1e-5
