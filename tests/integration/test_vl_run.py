"""Vision-language GRPO end to end on CPU (issue 45): `grpo run` with the hf engine trains the tiny
random Qwen2.5-VL (grpo_rollout.tiny_vl) on the colours task, whose prompt text is the same on
every row: only the image says which colour is right.

- it learns, against an lr=0 control, and what it learns needs the image: a policy that doesn't
  read it gives every row the same answer distribution, so its accuracies per colour sum to at
  most 1;
- the images travel by reference: stored once in the run (images/<sha256>), named by every prompt
  and rollout record;
- and on to the records' readers: `grpo rollouts export` inlines each sample's image (verl's
  {bytes, path}) and the step page shows each group's, served from the run;
- the weight sync reaches the engine's vision tower under its own names (an unknown name fails
  the update), and the export is a VL model folder with its image processor;
- LoRA (verl's geo3k LoRA settings) on the tiny Qwen3-VL learns it too, against its own control;
- verl's own geo3k scripts (Qwen3-VL, and the Qwen2.5-VL LoRA one) go through `grpo from-verl` and
  `grpo run` as written, but for what CPU and tiny sizes need (the model, data, sizes, the hf engine).
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

from integration_helpers import child_env, grpo_cli, read_metrics, read_step_tables, run_grpo, run_root

pytestmark = pytest.mark.integration

LEARN_STEPS = 12           # measured: the mean reward 0.08 -> 0.53, the colours' accuracies summing to 2.03
CONTROL_STEPS = 4
LORA_STEPS = 8             # measured (Qwen3-VL, lr 5e-3): the mean reward 0.07 -> 0.41, 0.42, 0.69 at steps 2-4, 0.97 at step 8


def _job(tmp, name, model, train, *, lr, steps, lora=None):
    spec = {
        "model": {"path": str(model), "dtype": "float32", "gradientCheckpointing": False,
                  **({"lora": lora} if lora else {})},
        "data": {"trainFiles": [str(train)], "imageKey": "images", "trainBatchSize": 32, "maxPromptLength": 32,
                 "maxResponseLength": 2},
        # With LoRA, the KL loss's reference is the model with its adapters off.
        "algorithm": {"advEstimator": "grpo", "useKLLoss": bool(lora), "klLossCoef": 0.001},
        "rollout": {"engine": "hf", "n": 8, "replicas": 1, "temperature": 1.0},
        "trainer": {"projectName": "vl", "experimentName": name, "device": "cpu", "nprocPerNode": 1,
                    "miniBatchSize": 32, "microBatchSizePerGPU": 256, "lr": lr, "totalSteps": steps,
                    "saveFreq": steps, "loggers": ["jsonl"]},
        "storage": {"uri": f"file://{tmp}/store"},
        "weightSync": {"backend": "grpc"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob",
                                    "metadata": {"name": name}, "spec": spec}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from grpo_rollout.tiny_vl import build_tiny_vl_model, write_colour_dataset
    tmp = tmp_path_factory.mktemp("vl")
    model = build_tiny_vl_model(tmp / "model")
    train, _ = write_colour_dataset(tmp / "data")
    roots = {}
    for name, lr, steps in (("learn", 1e-2, LEARN_STEPS), ("control", 0.0, CONTROL_STEPS)):
        code, log = run_grpo(_job(tmp, name, model, train, lr=lr, steps=steps), tmp / name, tmp / "cache", [],
                             timeout=1200)
        assert code == 0, log[-6000:]
        roots[name] = run_root(tmp / "store", name)
    return roots


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """verl's geo3k LoRA settings (all-linear, `.*visual.*` excluded) on the tiny Qwen3-VL (so both
    architectures learn here: the runs above are Qwen2.5-VL's), whose LM head has a trained head's
    range (tiny_vl's head_scale: LoRA leaves the head frozen)."""
    from grpo_rollout.tiny_vl import build_tiny_vl_model, write_colour_dataset
    tmp = tmp_path_factory.mktemp("vl-lora")
    model = build_tiny_vl_model(tmp / "model", head_scale=5.0, arch="qwen3-vl")
    train, _ = write_colour_dataset(tmp / "data")
    lora = {"rank": 16, "alpha": 32, "excludeModules": ".*visual.*"}
    roots = {"model": model}
    for name, lr, steps in (("lora-learn", 5e-3, LORA_STEPS), ("lora-control", 0.0, CONTROL_STEPS)):
        code, log = run_grpo(_job(tmp, name, model, train, lr=lr, steps=steps, lora=lora), tmp / name,
                             tmp / "cache", [], timeout=1200)
        assert code == 0, log[-6000:]
        roots[name] = run_root(tmp / "store", name)
    return roots


def _accuracy_by_colour(root, step) -> dict[str, float]:
    table = read_step_tables(root, "rollouts", step)
    by = collections.defaultdict(list)
    for colour, reward in zip(table.column("ground_truth").to_pylist(), table.column("reward").to_pylist()):
        by[colour].append(reward)
    return {c: statistics.mean(r) for c, r in by.items()}


def test_the_vl_model_learns_a_task_that_needs_its_images(runs):
    learned = [m["critic/score/mean"] for m in read_metrics(runs["learn"])]
    frozen = [m["critic/score/mean"] for m in read_metrics(runs["control"])]
    late, control = statistics.mean(learned[-3:]), statistics.mean(frozen)
    detail = f"learning run {learned[0]:.3f} -> {late:.3f}; control (lr=0) {control:.3f}"
    assert late > 0.35 and late > control + 0.2, detail
    # Blind to the image, a policy's accuracies per colour sum to at most 1 (it answers every row alike).
    by_colour = _accuracy_by_colour(runs["learn"], LEARN_STEPS)
    assert sum(by_colour.values()) > 1.3, (by_colour, detail)
    assert sum(_accuracy_by_colour(runs["control"], CONTROL_STEPS).values()) < 1.0


def test_images_are_stored_once_and_named_by_the_records(runs):
    root = runs["learn"]
    stored = {p.name: p.read_bytes() for p in (root / "images").iterdir()}
    assert len(stored) == 4                                   # the four colours' PNGs, whatever the rows
    assert all(hashlib.sha256(data).hexdigest() == name for name, data in stored.items())
    for kind in ("prompts", "rollouts"):
        table = read_step_tables(root, kind, 1)
        for images in table.column("images").to_pylist():
            assert len(images) == 1 and images[0] == f"file://{root}/images/{images[0].rsplit('/', 1)[1]}"
            assert images[0].rsplit("/", 1)[1] in stored


def test_the_export_is_a_vl_model_with_its_image_processor(runs):
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText
    export = runs["learn"] / "hf" / f"step-{LEARN_STEPS}"
    AutoImageProcessor.from_pretrained(export)
    trained = AutoModelForImageTextToText.from_pretrained(export).state_dict()
    initial = AutoModelForImageTextToText.from_pretrained(runs["learn"].parent.parent.parent / "model").state_dict()
    visual = [n for n in trained if ".visual." in n]
    assert visual and any(not torch.equal(trained[n], initial[n]) for n in visual)   # the vision tower trained too


def test_each_prompts_image_reaches_the_rollouts_export_and_the_run_page(runs, tmp_path):
    """Issue 45 item 4, on the run's own records (no launch of its own): `grpo rollouts export`
    inlines every sample's prompt image in verl's {bytes, path}, the very PNG of its colour; the
    step page shows each group's image, which the image route serves from the run."""
    import re

    import pyarrow.parquet as pq
    from starlette.testclient import TestClient

    from grpo_api.images import check_local_images
    from grpo_api.storage import Storage
    from grpo_rollout.tiny_vl import colour_png
    from grpo_trainer.rollout_history import RolloutHistory
    from grpo_trainer.rollouts_export import rollouts
    from grpo_trainer.ui.app import build_app
    from grpo_trainer.ui.run_view import RunView
    from grpo_trainer.ui.text import IdsText

    root, out = runs["learn"], tmp_path / "rollouts.parquet"
    assert rollouts(["export", str(root), "-o", str(out), "--no-text", "--steps", "1:2"]) == 0
    rows = pq.read_table(out, columns=["ground_truth", "images"]).to_pylist()
    assert len(rows) == 2 * 32 * 8
    assert all([i["bytes"] for i in r["images"]] == [colour_png(r["ground_truth"])] for r in rows)
    check_local_images(out, "images")         # a data.imageKey dataset as it is

    client = TestClient(build_app(RunView(RolloutHistory(f"file://{root}", Storage()), IdsText(), None)))
    cards = re.findall(r'ground truth <code>(\w+)</code>.*?<img src="/image/([0-9a-f]{64})"',
                       client.get("/step/1").text, re.S)
    assert len(cards) == 20                   # a page of groups, each with its image
    for colour, name in cards:
        assert name == hashlib.sha256(colour_png(colour)).hexdigest()
        served = client.get(f"/image/{name}")
        assert served.headers["content-type"] == "image/png" and served.content == colour_png(colour)


def test_each_groups_image_shows_in_chromium(runs, tmp_path):
    """Issue 45 item 4 in a real browser (as tests/integration/test_ui.py): `grpo ui` on the learning
    run, step 1's page in headless Chromium; every group's <img> loads as the page is scrolled (they
    load lazily), and the pixel the browser draws at its centre is the colour its ground truth names."""
    from browser_helpers import chromium, serving_ui
    from polling import wait_until

    from grpo_rollout.tiny_vl import COLOURS

    with serving_ui(runs["learn"], tmp_path / "ui.log") as base, chromium() as driver:
        driver.get(base + "/step/1")
        # Each loaded image drawn on a canvas: its centre pixel's RGB, with the ground truth of its group.
        drawn = wait_until(lambda: driver.execute_script("""
            const imgs = Array.from(document.querySelectorAll('section.group img'));
            const waiting = imgs.filter(i => !(i.complete && i.naturalWidth > 0));
            if (waiting.length) { waiting[0].scrollIntoView(); return null; }   // loading="lazy": as a reader scrolls
            if (!imgs.length) return null;
            return imgs.map(i => {
              const c = document.createElement('canvas');
              c.width = i.naturalWidth; c.height = i.naturalHeight;
              const g = c.getContext('2d'); g.drawImage(i, 0, 0);
              const p = g.getImageData(c.width >> 1, c.height >> 1, 1, 1).data;
              const code = i.closest('section.group').innerText.match(/ground truth\\s+(\\w+)/);
              return [code ? code[1] : null, [p[0], p[1], p[2]]];
            });"""), timeout=60, what="step 1's images to load")
    assert len(drawn) == 20, drawn
    assert all(truth in COLOURS and tuple(rgb) == COLOURS[truth] for truth, rgb in drawn), drawn


def test_lora_on_the_vl_model_learns_the_task_that_needs_its_images(lora_runs):
    """The adapters alone learn it (the hf engine takes them at each sync and generates with them);
    the vision tower, excluded, is exported as loaded; the PEFT adapter folder on the base model
    computes what the merged export computes (PEFT's own merge: an independent implementation)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    learned = read_metrics(lora_runs["lora-learn"])
    scores = [m["critic/score/mean"] for m in learned]
    control = statistics.mean(m["critic/score/mean"] for m in read_metrics(lora_runs["lora-control"]))
    late = statistics.mean(scores[-3:])
    detail = f"LoRA run {scores[0]:.3f} -> {late:.3f}; control (lr=0) {control:.3f}"
    assert late > 0.35 and late > control + 0.2, detail
    assert sum(_accuracy_by_colour(lora_runs["lora-learn"], LORA_STEPS).values()) > 1.3, detail
    kl = [m["actor/kl_loss"] for m in learned]
    assert kl[0] == 0.0 and max(kl[1:]) > 1e-3, kl          # step 1: the policy is the reference (B = 0)

    export = lora_runs["lora-learn"] / "hf" / f"step-{LORA_STEPS}"
    merged = AutoModelForImageTextToText.from_pretrained(export).eval()
    base = AutoModelForImageTextToText.from_pretrained(lora_runs["model"]).eval()
    trained, initial = merged.state_dict(), base.state_dict()
    assert all(torch.equal(trained[n], initial[n]) for n in initial if ".visual." in n)
    assert any(not torch.equal(trained[n], initial[n]) for n in initial if ".language_model." in n)
    adapter = PeftModel.from_pretrained(base, export / "lora_adapter").eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(adapter(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)



VERL_SCRIPTS = Path(__file__).resolve().parents[1] / "unit" / "verl_scripts"


@pytest.mark.parametrize("script, arch, lora", [("grpo_run_qwen3_vl_8b_fsdp.sh", "qwen3-vl", False),
                                                ("lora_run_qwen2_5_vl_7b_fsdp.sh", "qwen2.5-vl", True)])
def test_verls_geo3k_scripts_translate_and_run_on_the_tiny_models(tmp_path, script, arch, lora):
    """Issue 45's acceptance: the script as verl ships it (colocated, sleep mode, low_var_kl, fused
    kernels, the reference offloaded; LoRA with the vision tower excluded), changed only where a CPU
    and the tiny models need it: the model and data paths, the sizes, the hf engine, one device, no
    wandb."""
    from grpo_rollout.tiny_vl import build_tiny_vl_model, write_colour_dataset
    model = build_tiny_vl_model(tmp_path / "model", arch=arch)
    train, test = write_colour_dataset(tmp_path / "data", n_train=64)
    # The scripts' own variables (the GPU count is NDEVICES_PER_NODE in one, NGPUS_PER_NODE in the other) ...
    variables = {"MODEL_PATH": model, "TRAIN_FILE": train, "TEST_FILE": test, "TRAIN_BATCH_SIZE": 16,
                 "PPO_MINI_BATCH_SIZE": 16, "MAX_PROMPT_LENGTH": 32, "MAX_RESPONSE_LENGTH": 2, "ROLLOUT_TP": 1,
                 "NDEVICES_PER_NODE": 1, "NGPUS_PER_NODE": 1}
    env_args = [a for k, v in variables.items() for a in ("--env", f"{k}={v}")]
    # ... and verl overrides appended, as `bash script.sh key=value` passes them (the LoRA script
    # writes its data paths inline).
    overrides = ["actor_rollout_ref.rollout.name=hf", 'trainer.logger=["console","file"]',
                 "trainer.total_training_steps=2", f"data.train_files={train}", f"data.val_files={test}"]
    job = tmp_path / "job.yaml"
    done = subprocess.run([*grpo_cli(), "from-verl", str(VERL_SCRIPTS / script), *env_args, "-o", str(job), "--",
                           *overrides], capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr.splitlines() if line.startswith("error")], done.stderr
    spec = yaml.safe_load(job.read_text())["spec"]
    assert (spec["data"]["imageKey"], spec["rollout"]["placement"], spec["algorithm"]["klLossType"]) == (
        "images", "colocated", "low_var_kl")
    assert bool(spec["model"].get("lora")) == lora
    code, log = run_grpo(job, tmp_path / "run", tmp_path / "cache", [], timeout=900)
    assert code == 0, log[-6000:]

    (root,) = (tmp_path / "run" / "outputs").glob("*/*")
    metrics = read_metrics(root)
    assert [m["step"] for m in metrics] == [0, 1, 2]                # 0: verl's validation before training
    assert "val/score" in metrics[0] and metrics[2]["actor/kl_loss"] > 0, metrics  # step 2's policy had moved
    stored = {p.name for p in (root / "images").iterdir()}
    named = {re.sub(r".*/images/", "", uri) for row in read_step_tables(root, "rollouts", 2).column("images").to_pylist()
             for uri in row}
    assert named and named <= stored
    export = root / "hf" / "step-2"
    architecture = json.loads((export / "config.json").read_text())["architectures"]
    assert architecture == ["Qwen3VLForConditionalGeneration" if arch == "qwen3-vl"
                            else "Qwen2_5_VLForConditionalGeneration"]
    assert (export / "lora_adapter").is_dir() == lora
