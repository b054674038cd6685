"""The GRPOJob API: defaults, validation with field-named errors, overrides, the CRD."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_api.crd import build_crd, crd_yaml
from grpo_api.jobfile import JobError, dump_job, load_job, parse_job

REPO = Path(__file__).resolve().parents[2]
BASE = {"spec": {"model": {"path": "Qwen/Qwen3-8B"}, "data": {"trainFiles": ["t.parquet"], "trainBatchSize": 16},
                 "trainer": {"miniBatchSize": 8}}}


def job_with(**changes):
    """BASE with dotted-path changes, e.g. job_with(**{"rollout.n": 1})."""
    doc = yaml.safe_load(yaml.safe_dump(BASE))
    for path, value in changes.items():
        node = doc["spec"]
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return doc


def errors_of(doc):
    with pytest.raises(JobError) as info:
        parse_job(doc)
    return info.value.errors


def test_defaults_follow_verl():
    spec = parse_job(BASE).spec
    assert spec.algorithm.adv_estimator.value == "grpo"
    assert spec.algorithm.kl_loss_type == "low_var_kl" and spec.algorithm.kl_loss_coef == 0.001
    assert spec.algorithm.use_kl_loss is False           # verl: actor.use_kl_loss=False
    assert spec.algorithm.clip_ratio_low == spec.algorithm.clip_ratio_high == 0.2
    assert spec.algorithm.loss_agg_mode == "token-mean"
    assert spec.data.max_prompt_length == 512 and spec.data.truncation == "error"
    assert spec.rollout.gpu_memory_utilization == 0.5 and spec.rollout.top_k == -1
    assert spec.resume == "auto"


# (changes to BASE, the field named, part of the reason): also what tests/faults feeds to
# `grpo validate` and to the API server through the CRD.
INVALID_SPECS = [
    ({"rollout.maxStaleness": 2}, "spec.rollout.maxStaleness", "less than or equal to 1"),
    ({"data.trainBatchSize": -3}, "spec.data.trainBatchSize", "greater than or equal to 1"),
    ({"data.trainBatchSize": "many"}, "spec.data.trainBatchSize", "valid integer"),
    ({"data.trainFiles": []}, "spec.data.trainFiles", "at least 1"),
    ({"data.truncation": "middle"}, "spec.data.truncation", "'error', 'left' or 'right'"),
    ({"data.maxPromptLength": 0}, "spec.data.maxPromptLength", "greater than or equal to 1"),
    ({"data.maxPromptLength": 100000, "data.maxResponseLength": 40000}, "spec.data.maxResponseLength", "<= 131072"),
    ({"rollout.n": 1}, "spec.rollout.n", "must be >= 2 for advEstimator grpo"),
    ({"rollout.n": 1, "algorithm.advEstimator": "rloo"}, "spec.rollout.n", "advEstimator rloo"),
    ({"rollout.engine": "sglang"}, "spec.rollout.engine", "'vllm' or 'hf'"),
    ({"rollout.temperature": -1}, "spec.rollout.temperature", "greater than or equal to 0"),
    ({"rollout.topP": 1.5}, "spec.rollout.topP", "less than or equal to 1"),
    ({"rollout.gpuMemoryUtilization": 0}, "spec.rollout.gpuMemoryUtilization", "greater than 0"),
    ({"rollout.temprature": 1}, "spec.rollout.temprature", "did you mean 'temperature'"),
    ({"algorithm.advEstimator": "remax"}, "spec.algorithm.advEstimator", "'grpo'"),
    ({"algorithm.lossAggMode": "mean"}, "spec.algorithm.lossAggMode", "token-mean"),
    ({"algorithm.klLossType": "k4"}, "spec.algorithm.klLossType", "low_var_kl"),
    ({"algorithm.clipRatioLow": -0.1}, "spec.algorithm.clipRatioLow", "greater than or equal to 0"),
    ({"algorithm.clipRatioC": 1.0}, "spec.algorithm.clipRatioC", "greater than 1"),
    ({"algorithm.gamma": 2}, "spec.algorithm.gamma", "less than or equal to 1"),
    ({"trainer.miniBatchSize": 5}, "spec.trainer.miniBatchSize", "must divide data.trainBatchSize"),
    ({"trainer.microBatchSizePerGPU": 41}, "spec.trainer.microBatchSizePerGPU", "= 40 (got 41)"),
    ({"trainer.nprocPerNode": 3}, "spec.trainer.nprocPerNode", "split evenly"),
    ({"trainer.maxTokensPerGPU": 100}, "spec.trainer.maxTokensPerGPU", "so one sequence fits"),
    ({"trainer.logProbMaxTokensPerGPU": 100}, "spec.trainer.logProbMaxTokensPerGPU", "so one sequence fits"),
    ({"algorithm.policyLoss": "gspo"}, "spec.algorithm.lossAggMode", "seq-mean-token-mean with policyLoss gspo"),
    ({"algorithm.policyLoss": "sapo"}, "spec.algorithm.lossAggMode", "seq-mean-token-mean with policyLoss sapo"),
    ({"algorithm.policyLoss": "geo_mean", "algorithm.lossAggMode": "token-mean"}, "spec.algorithm.lossAggMode",
     "seq-mean-token-mean with policyLoss geo_mean"),
    ({"algorithm.policyLoss": "ppo"}, "spec.algorithm.policyLoss", "'clip_cov'"),
    ({"algorithm.policyLoss": "dro"}, "spec.algorithm.policyLossConfig.droBeta", "required with policyLoss dro"),
    ({"algorithm.policyLossConfig": {"clipCovLb": 5.0, "clipCovUb": 1.0}}, "spec.algorithm.policyLossConfig.clipCovUb",
     "must be > clipCovLb"),
    ({"algorithm.policyLossConfig": {"clipCovRatio": 0}}, "spec.algorithm.policyLossConfig.clipCovRatio",
     "greater than 0"),
    ({"algorithm.policyLossConfig": {"tauNeg": 0}}, "spec.algorithm.policyLossConfig.tauNeg", "greater than 0"),
    ({"algorithm.policyLoss": "geo_mean", "algorithm.lossAggMode": "seq-mean-token-mean",
      "algorithm.rolloutCorrection": {"rolloutIs": "token"}}, "spec.algorithm.rolloutCorrection.rolloutIs",
     "geometric mean of its token weights"),
    ({"algorithm.advEstimator": "grpo_passk", "rollout.n": 1}, "spec.rollout.n", "must be >= 2 for advEstimator grpo_passk"),
    ({"trainer.lr": -1e-6}, "spec.trainer.lr", "greater than or equal to 0"),
    ({"trainer.loggers": ["neptune"]}, "spec.trainer.loggers[0]", "'wandb' or 'mlflow'"),
    ({"trainer.trackerSecretRef": "WandB_Keys"}, "spec.trainer.trackerSecretRef", "match"),
    ({"trainer.testFreq": -2}, "spec.trainer.testFreq", "greater than or equal to -1"),
    ({"storage.uri": "gs://bucket"}, "spec.storage.uri", "(file|s3)"),
    ({"storage.endpoint": "minio:9000"}, "spec.storage.endpoint", "https?"),
    ({"weightSync.backend": "rdma"}, "spec.weightSync.backend", "'nccl' or 'grpc'"),
    ({"resume": "yes"}, "spec.resume", "auto|never"),
    ({"runPolicy.backoffLimit": -1}, "spec.runPolicy.backoffLimit", "greater than or equal to 0"),
    ({"model.path": ""}, "spec.model.path", "at least 1 character"),
    ({"model.dtype": "int8"}, "spec.model.dtype", "bfloat16"),
    ({"model.lora": {"rank": 0}}, "spec.model.lora.rank", "greater than or equal to 1"),
    ({"model.lora": {"alpha": 32}}, "spec.model.lora.rank", "required (or set adapterPath"),
    ({"model.lora": {"rank": 8, "targetModules": []}}, "spec.model.lora.targetModules", "at least 1"),
    ({"model.lora": {"rank": 8, "dropout": 1.0}}, "spec.model.lora.dropout", "less than 1"),
    # refusals the rollout server and the trainer used to make only at start-up (issue 23)
    ({"reward.overlongBuffer.enable": True}, "spec.reward.overlongBuffer.len", "must be in 1..data.maxResponseLength"),
    ({"reward.overlongBuffer.enable": True, "reward.overlongBuffer.len": 600}, "spec.reward.overlongBuffer.len",
     "must be in 1..data.maxResponseLength"),
    ({"algorithm.filterGroups": True, "algorithm.advEstimator": "reinforce_plus_plus", "rollout.n": 1},
     "spec.algorithm.filterGroups", "needs rollout.n >= 2"),
    ({"reward.function": "my_rewards.py"}, "spec.reward.function", "match"),
    ({"model.path": "/models/qwen", "model.cache": {"claimName": "models"}}, "spec.model.cache",
     "nothing to fetch: model.path '/models/qwen' is a folder the pods already see"),
    ({"model.cache": {"claimName": "Models_PVC"}}, "spec.model.cache.claimName", "match"),
    # sections the chosen algorithm ignores, and strings where the CRD wants a boolean or a number (issue 48)
    ({"critic.lr": 1e-4}, "spec.critic", "used only with algorithm.advEstimator gae (got grpo)"),
    ({"rollout.multiTurn.python.replicas": 2}, "spec.rollout.multiTurn.python.replicas",
     "sandbox servers run only the python tool"),
    ({"algorithm.useKLLoss": "yes"}, "spec.algorithm.useKLLoss", "valid boolean (got 'yes')"),
    ({"data.trainBatchSize": "16"}, "spec.data.trainBatchSize", "valid integer (got '16')"),
    ({"rollout.n": 4.5}, "spec.rollout.n", "valid integer"),
    ({"trainer.lrWarmupSteps": 5, "trainer.lrWarmupStepsRatio": 0.1}, "spec.trainer.lrWarmupStepsRatio",
     "not both"),
    ({"trainer.lrWarmupStepsRatio": 1.5}, "spec.trainer.lrWarmupStepsRatio", "less than or equal to 1"),
    ({"trainer.valOnly": True}, "spec.trainer.valOnly", "needs data.valFiles"),
    ({"rollout.kvCacheDtype": "fp8", "rollout.engine": "hf"}, "spec.rollout.kvCacheDtype", "needs rollout.engine vllm"),
    ({"rollout.kvCacheDtype": "fp8_e5m2"}, "spec.rollout.kvCacheDtype", "'auto' or 'fp8'"),
]


@pytest.mark.parametrize("changes, field, reason", INVALID_SPECS)
def test_bad_spec_names_field_and_reason(changes, field, reason):
    errors = errors_of(job_with(**changes))
    assert any(e.startswith(field + ":") and reason in e for e in errors), errors


def test_sections_at_their_defaults_and_yaml_numbers_pass(tmp_path):
    # A resolved job (every default written out, critic included) reads back; the critic is PPO's.
    assert parse_job(yaml.safe_load(dump_job(parse_job(BASE)))).spec.critic.lr == 1e-5
    ppo = parse_job(job_with(**{"algorithm.advEstimator": "gae", "rollout.n": 1, "critic.lr": 1e-4}))
    assert ppo.spec.critic.lr == 1e-4
    python = job_with(**{"rollout.multiTurn": {"enable": True, "tools": ["python"], "python": {"replicas": 2}}})
    assert parse_job(python).spec.rollout.multi_turn.python.replicas == 2
    # kubectl reads `1e-6` as a number (YAML 1.1 as a string): so does grpo validate, strict as it is
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE) + "  algorithm: {klLossCoef: 1e-3}\n")   # under spec:
    assert load_job(path, ["trainer.lr=2e-6"]).spec.trainer.lr == 2e-6
    assert load_job(path).spec.algorithm.kl_loss_coef == 1e-3
    assert parse_job(job_with(**{"rollout.n": 4.0})).spec.rollout.n == 4    # kubectl sends 4.0 as 4


def test_all_field_errors_reported_at_once():
    errors = errors_of(job_with(**{"data.trainBatchSize": -3, "rollout.topP": 3, "trainer.lr": -1}))
    assert {e.split(":")[0] for e in errors} == {"spec.data.trainBatchSize", "spec.rollout.topP", "spec.trainer.lr"}


def test_all_cross_field_errors_reported_at_once():
    errors = errors_of(job_with(**{"rollout.n": 1, "trainer.miniBatchSize": 12}))
    assert {e.split(":")[0] for e in errors} == {"spec.rollout.n", "spec.trainer.miniBatchSize"}


def test_missing_required_sections():
    errors = errors_of({"spec": {"data": {"trainFiles": ["x"]}}})
    assert errors == ["spec.model: Field required"]


def test_overrides_are_typed_and_validated(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    job = load_job(path, ["trainer.totalSteps=5", "algorithm.clipRatioHigh=0.28", "spec.rollout.engine=hf",
                          "data.valFiles=[a.parquet, b.parquet]"])
    assert job.spec.trainer.total_steps == 5
    assert job.spec.algorithm.clip_ratio_high == 0.28
    assert job.spec.rollout.engine == "hf"
    assert job.spec.data.val_files == ["a.parquet", "b.parquet"]
    with pytest.raises(JobError, match="did you mean 'spec.trainer.totalSteps'"):
        load_job(path, ["trainer.totalStep=5"])
    with pytest.raises(JobError, match="spec.trainer.totalSteps: Input should be a valid integer"):
        load_job(path, ["trainer.totalSteps=five"])


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("spec:\n  model: {path: x\n  data: 3\n")
    with pytest.raises(JobError, match="malformed YAML at line 3"):
        load_job(path)


def test_resolved_job_round_trips():
    job = parse_job(job_with(**{"algorithm.useKLLoss": True}))
    text = dump_job(job)
    assert "useKLLoss: true" in text and "trainBatchSize: 16" in text
    assert parse_job(yaml.safe_load(text)) == job


def test_examples_validate():
    for path in sorted((REPO / "examples").glob("*.yaml")):
        load_job(path)


def test_seed_recipe_matches_the_tutorial():
    spec = load_job(REPO / "examples/gsm8k-qwen3-8b-grpo.yaml").spec
    assert (spec.model.path, spec.rollout.n, spec.data.train_batch_size) == ("Qwen/Qwen3-8B", 5, 128)
    assert (spec.data.max_prompt_length, spec.data.max_response_length) == (512, 1024)
    assert spec.algorithm.use_kl_loss and spec.algorithm.kl_loss_coef == 0.001
    assert spec.algorithm.kl_loss_type == "low_var_kl"
    assert spec.trainer.nproc_per_node == 4 and spec.trainer.total_epochs == 3
    drgrpo = load_job(REPO / "examples/drgrpo.yaml").spec.algorithm
    assert (drgrpo.norm_adv_by_std, drgrpo.loss_agg_mode, drgrpo.use_kl_loss) == (False, "seq-mean-token-sum-norm", False)


def test_crd_file_matches_generator():
    assert (REPO / "crds/grpojob.yaml").read_text() == crd_yaml(), "run: grpo crd > crds/grpojob.yaml"


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_crd_schema_is_structural_and_documented():
    version = build_crd()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        if isinstance(node, dict):
            assert not {"$ref", "anyOf", "allOf", "oneOf", "title", "const"} & node.keys(), path
            if "properties" in node:
                assert node.get("type") == "object", path
                for name, sub in node["properties"].items():
                    assert "type" in sub or sub.get("x-kubernetes-preserve-unknown-fields"), f"{path}.{name}"
    rollout = schema["properties"]["spec"]["properties"]["rollout"]
    assert "GRPO group size" in rollout["properties"]["n"]["description"]
    assert all(p.get("description") for p in rollout["properties"].values())
    rules = schema["properties"]["spec"]["x-kubernetes-validations"]
    assert any("self.rollout.n >= 2" in r["rule"] for r in rules)
    assert version["subresources"] == {"status": {}, "scale": {"specReplicasPath": ".spec.rollout.replicas",
                                                               "statusReplicasPath": ".status.rolloutReplicas"}}
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns if not c.get("priority")] == ["Phase", "Step", "Total", "Reward", "Val", "Age"]
    assert [c["name"] for c in columns if c.get("priority") == 1] == [   # -o wide
        "Best", "Best-Step", "Restarts", "Resumed-From", "Epoch", "Reason"]
    assert build_crd()["spec"]["names"]["shortNames"] == ["gj"]


def test_validate_is_fast_and_never_imports_torch():
    code = ("import sys, grpo_api.spec, grpo_api.jobfile, grpo_api.crd, grpo_api.commands;"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_validate_cli_exit_codes(tmp_path):
    good = subprocess.run([sys.executable, "-m", "grpo_api.cli", "validate", *map(str, (REPO / "examples").glob("*.yaml"))],
                          capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job_with(**{"data.trainBatchSize": -3})))
    out = subprocess.run([sys.executable, "-m", "grpo_api.cli", "validate", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "spec.data.trainBatchSize" in out.stderr and "trainBatchSize" in out.stderr


def test_api_reference_matches_models():
    from grpo_api.apidoc import markdown
    assert (REPO / "docs/API.md").read_text() == markdown(), "run: python -m grpo_api.apidoc > docs/API.md"


def test_help_says_what_every_command_does_without_importing_torch():
    code = ("import sys; from grpo_api.cli import main; main(['--help']);"
            "heavy = {'torch', 'transformers', 'kopf', 'kubernetes'} & set(sys.modules);"
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    listed = dict(line.strip().split(None, 1) for line in out.split("commands:\n")[1].split("\n\n")[0].splitlines())
    assert {"validate", "run", "operator", "trainer", "rollout", "from-verl", "crd", "export"} <= set(listed)
    assert all(len(text) > 20 for text in listed.values()), listed
    assert listed["validate"] == "Check GRPOJob files and list every error with its field path (the operator's checks too)."
    # each summary a whole sentence, none cut where its docstring wraps
    assert all(text.endswith(".") for text in listed.values()), listed
    assert listed["export"].endswith("its adapter in OUT/lora_adapter)."), listed["export"]
