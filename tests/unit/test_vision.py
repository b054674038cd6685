"""A VL policy's log-probs (issue 45): the trainer's forward (FSDP2, one gloo rank, gradient
checkpointing, its own mrope positions, padded rows with images, the fused head and the logits
path) against a float64 reference forward of the same tiny Qwen2.5-VL or Qwen3-VL (its own mrope
positions and DeepStack), one unpadded row at a time with the positions transformers computes
itself; and the image reaching the policy."""

import os

import pytest
import torch

from grpo_rollout.tiny_vl import ARCHS, COLOURS, QUESTION, build_tiny_vl_model, colour_png

T = 0.7


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl"), seed=3)


@pytest.fixture(scope="module", params=ARCHS)
def any_vl_model(request, tmp_path_factory):
    """Each tiny VL architecture, for the numerical checks (the others read the Qwen2.5-VL)."""
    return build_tiny_vl_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), seed=3, arch=request.param)


def _prompts(path):
    """Prompt ids (the trainer's rendering: <image> -> parts -> chat template -> the image's
    tokens) and the image bytes of three rows: red, blue, and red again (two samples of one
    prompt, as a GRPO group's: the trainer encodes their image once)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from grpo_trainer.vision import expand_image_tokens, image_parts, pixel_inputs
    tok, proc = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    rows = []
    for colour, extra in (("red", ""), ("blue", " the image"), ("red", "")):
        png = colour_png(colour)
        ids = tok.apply_chat_template(image_parts([{"role": "user", "content": QUESTION + extra}], 1),
                                      add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else list(ids["input_ids"])
        rows.append((expand_image_tokens(ids, image_id, pixel_inputs(proc, [png]).image_grid_thw, 2), png))
    return rows, proc


def _rank(_: int, path: str, out: str, init_file: str) -> None:
    import torch.distributed as dist

    from grpo_api.spec import ModelSpec
    from grpo_trainer import model as M
    from grpo_trainer.actor import forward_logprobs
    from grpo_trainer.batch import Sample, collate
    from grpo_trainer.vision import PixelInputs, pixel_inputs

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        rows, proc = _prompts(path)
        gen = torch.Generator().manual_seed(0)
        samples = [Sample(f"u{i}", i, 0, ids, torch.randint(0, 12, (r,), generator=gen).tolist(), [0.0] * r, 0.0,
                          "stop") for i, ((ids, _), r) in enumerate(zip(rows, (5, 2, 7)))]
        results = {}
        for fused in (True, False):
            spec = ModelSpec(path=path, dtype="float32", use_fused_kernels=fused, gradient_checkpointing=True)
            model = M.build_policy(spec, torch.device("cpu"))
            mb = collate([0, 1, 2], samples, None, 0, torch.device("cpu"))
            mb.pixels = pixel_inputs(proc, [png for _, png in rows])
            with torch.no_grad():
                logp, _ = forward_logprobs(model, mb, T)
            results[fused] = [logp[row, len(s.prompt_ids) - 1:len(s.prompt_ids) - 1 + len(s.response_ids)]
                              for row, s in enumerate(samples)]
            # Another image, same tokens: the policy sees the pixels.
            mb.pixels = pixel_inputs(proc, [colour_png("yellow")] * 3)
            with torch.no_grad():
                results[f"{fused}-yellow"] = forward_logprobs(model, mb, T)[0][mb.response_mask.bool()]
        # trainer.freezeVisionTower: the vision tower gets no gradient, the language model does.
        model = M.build_policy(ModelSpec(path=path, dtype="float32"), torch.device("cpu"), freeze_vision=True)
        mb = collate([0, 1, 2], samples, None, 0, torch.device("cpu"))
        mb.pixels = pixel_inputs(proc, [png for _, png in rows])
        forward_logprobs(model, mb, T)[0].sum().backward()
        graded = [n for n, p in model.named_parameters() if p.grad is not None]
        # The shared image's encoding gets the gradient of both rows: the vision tower's gradient is
        # that of each row encoding its own copy.
        grads, distinct = [], len(mb.pixels.image_grid_thw)
        apart = [pixel_inputs(proc, [png]) for _, png in rows]
        apart = PixelInputs(torch.cat([p.pixel_values for p in apart]), torch.cat([p.image_grid_thw for p in apart]),
                            torch.arange(len(rows)))
        for pixels in (mb.pixels, apart):
            model = M.build_policy(ModelSpec(path=path, dtype="float32"), torch.device("cpu"))
            mb.pixels = pixels
            forward_logprobs(model, mb, T)[0].sum().backward()
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters() if ".visual." in n})
        worst_grad = max(float((grads[0][n] - grads[1][n]).abs().max() / grads[1][n].abs().max().clamp_min(1e-12))
                         for n in grads[1])
        torch.save({"results": results, "samples": [(s.prompt_ids, s.response_ids) for s in samples],
                    "graded": graded, "distinct": distinct, "worst_grad": worst_grad}, out)
    finally:
        dist.destroy_process_group()


def test_vl_logprobs_match_a_float64_reference_forward(any_vl_model, tmp_path):
    import torch.multiprocessing as mp
    from transformers import AutoModelForImageTextToText

    from grpo_trainer.vision import pixel_inputs
    out = tmp_path / "out.pt"
    mp.spawn(_rank, args=(os.fspath(any_vl_model), os.fspath(out), os.fspath(tmp_path / "rdv")), nprocs=1, join=True)
    got = torch.load(out)
    rows, proc = _prompts(any_vl_model)
    ref = AutoModelForImageTextToText.from_pretrained(any_vl_model, dtype=torch.float64).eval()
    worst = 0.0
    for (prompt, response), (_, png), fused, logits_path in zip(got["samples"], rows, got["results"][True],
                                                                got["results"][False]):
        ids = torch.tensor([prompt + response])
        pixels = pixel_inputs(proc, [png])
        with torch.no_grad():
            logits = ref(input_ids=ids, pixel_values=pixels.pixel_values.double(),
                         image_grid_thw=pixels.image_grid_thw,
                         mm_token_type_ids=(ids == ref.config.image_token_id).int()).logits[0]
        want = (logits[len(prompt) - 1:-1] / T).log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        for trainer in (fused, logits_path):
            worst = max(worst, float((trainer.double() - want).abs().max()))
    assert worst < 2e-5, worst
    moved = float((got["results"]["True-yellow"] - torch.cat(got["results"][True])).abs().max())
    assert moved > 1e-4, "the log-probs did not change with the image"
    assert got["graded"] and not [n for n in got["graded"] if ".visual." in n], got["graded"]
    assert any(".language_model." in n for n in got["graded"])
    assert got["distinct"] == 2 and got["worst_grad"] < 1e-4, (got["distinct"], got["worst_grad"])


def test_hf_engine_generates_with_images_and_reports_the_logprobs_of_a_float64_forward(any_vl_model):
    """Left-padded rows of different lengths, each with its own image: the engine's behaviour
    log-probs are those of a float64 forward of prompt + response with the image, the image and
    video placeholders left out of the distribution (the engine never samples them)."""
    from transformers import AutoModelForImageTextToText

    from grpo_rollout.engine import SamplingParams
    from grpo_rollout.hf_engine import HFEngine
    from grpo_trainer.vision import pixel_inputs
    rows, proc = _prompts(any_vl_model)
    engine = HFEngine(any_vl_model)
    groups = engine.generate([ids for ids, _ in rows], SamplingParams(n=2, max_tokens=6, seed=1),
                             images=[[png] for _, png in rows])
    ref = AutoModelForImageTextToText.from_pretrained(any_vl_model, dtype=torch.float64).eval()
    never = torch.tensor([ref.config.image_token_id, ref.config.video_token_id])
    worst = 0.0
    for (prompt, png), group in zip(rows, groups):
        for sample in group:
            assert not set(sample.token_ids) & set(never.tolist())
            ids = torch.tensor([prompt + sample.token_ids])
            pixels = pixel_inputs(proc, [png])
            with torch.no_grad():
                logits = ref(input_ids=ids, pixel_values=pixels.pixel_values.double(),
                             image_grid_thw=pixels.image_grid_thw,
                             mm_token_type_ids=(ids == ref.config.image_token_id).int()).logits[0]
            logits = logits[len(prompt) - 1:-1].index_fill(-1, never, float("-inf"))
            want = logits.log_softmax(-1).gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            worst = max(worst, float((torch.tensor(sample.logprobs, dtype=torch.float64) - want).abs().max()))
    assert worst < 2e-5, worst
    with pytest.raises(ValueError, match="not a vision-language model"):
        from grpo_rollout import tiny
        HFEngine(tiny.build_tiny_model(any_vl_model.parent / "text")).generate([[1, 2]], SamplingParams(), images=[[]])


def test_prompts_count_their_image_tokens_and_store_each_image_once(vl_model, tmp_path):
    from grpo_api.records import RunLayout
    from grpo_api.spec import DataSpec, ModelSpec
    from grpo_api.storage import Storage
    from grpo_rollout.tiny_vl import write_colour_dataset
    from grpo_trainer.data import DataError, image_store, load_prompts
    from grpo_trainer.model import load_tokenizer
    train, _ = write_colour_dataset(tmp_path / "data", n_train=12, n_val=2)
    spec = ModelSpec(path=str(vl_model))
    tok, storage, layout = load_tokenizer(spec), Storage(), RunLayout(f"file://{tmp_path}/run")
    store = image_store(spec, tok, storage, layout)
    data = DataSpec(train_files=[str(train)], max_prompt_length=16)
    rows = load_prompts(data.train_files, data, tok, storage, images=store).rows
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    # 56 x 56 pixels: 4 x 4 patches, merged 2 x 2: 4 image tokens; 12 words and specials of text.
    assert {r.prompt_ids.count(image_id) for r in rows} == {4} and {len(r.prompt_ids) for r in rows} == {16}
    stored = sorted(p.name for p in (tmp_path / "run" / "images").iterdir())
    assert len(stored) == len({u for r in rows for u in r.images}) <= len(COLOURS) < len(rows)
    # The image tokens count: one token fewer and every row is overlong.
    with pytest.raises(DataError, match=r"row 0 has a 16-token prompt with its images, longer than data.maxPromptLength=15"):
        load_prompts(data.train_files, data.model_copy(update={"max_prompt_length": 15}), tok, storage, images=store)
    with pytest.raises(DataError, match="all filtered as overlong"):
        load_prompts(data.train_files, data.model_copy(update={"max_prompt_length": 15, "filter_overlong_prompts": True}),
                     tok, storage, images=store)
    # A text-only model refuses rows with images.
    with pytest.raises(DataError, match="row 0 has images .* not a vision-language model"):
        load_prompts(data.train_files, data, tok, storage, images=None)
    # verl's data.image_patch_size: the processor's own (14 here) is accepted, another refused by name.
    assert image_store(spec, tok, storage, layout, patch_size=14) is not None
    with pytest.raises(DataError, match="spec.data.imagePatchSize: 16, but the image processor of .* has patch size 14"):
        image_store(spec, tok, storage, layout, patch_size=16)


def test_an_unreadable_image_is_named_by_file_and_row_before_anything_starts(vl_model, tmp_path):
    """`grpo run` refuses it before any server or trainer starts (nothing written); the trainer,
    which reads every file (object storage too), names it the same way."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpo_api.spec import DataSpec, ModelSpec
    from grpo_api.storage import Storage
    from grpo_rollout.tiny_vl import make_rows
    from grpo_api.records import RunLayout
    from grpo_trainer.data import DataError, image_store, load_prompts
    from grpo_trainer.model import load_tokenizer
    rows = make_rows(6, "train", 0)
    rows[4]["images"] = [{"bytes": b"\x89PNG\r\n\x1a\n truncated", "path": None}]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), bad)
    job = tmp_path / "job.yaml"
    job.write_text(f"""apiVersion: grpo.dev/v1alpha1
kind: GRPOJob
metadata: {{name: bad-image}}
spec:
  model: {{path: {vl_model}, dtype: float32}}
  data: {{trainFiles: [{bad}], trainBatchSize: 2}}
  rollout: {{engine: hf, "n": 2}}
  trainer: {{device: cpu, miniBatchSize: 2, microBatchSizePerGPU: 4}}
  storage: {{uri: file://{tmp_path}/store}}
""")
    out = subprocess.run([sys.executable, "-m", "grpo_api.cli", "run", str(job)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith(f"error: {bad}: row 4: images[0]: not a readable image"), out.stderr
    assert not (tmp_path / "store").exists()
    spec, storage = ModelSpec(path=str(vl_model)), Storage()
    tok = load_tokenizer(spec)
    store = image_store(spec, tok, storage, RunLayout(f"file://{tmp_path}/run"))
    with pytest.raises(DataError, match=r"bad.parquet: row 4: images\[0\]: not a readable image"):
        load_prompts([str(bad)], DataSpec(train_files=[str(bad)]), tok, storage, images=store)


def _lora_rank(_: int, path: str, out: str, init_file: str) -> None:
    """The trainer's LoRA policy on the VL model (verl's geo3k LoRA settings: all-linear, the
    vision tower excluded), its adapters' B made nonzero: the log-probs it computes with the
    images, and the merged weights its weight sync sends (under the engines' names)."""
    import torch.distributed as dist

    from grpo_api.spec import LoRASpec, ModelSpec
    from grpo_trainer import lora
    from grpo_trainer import model as M
    from grpo_trainer.actor import forward_logprobs
    from grpo_trainer.batch import Sample, collate
    from grpo_trainer.vision import pixel_inputs

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        rows, proc = _prompts(path)
        gen = torch.Generator().manual_seed(1)
        samples = [Sample(f"u{i}", i, 0, ids, torch.randint(0, 12, (4,), generator=gen).tolist(), [0.0] * 4, 0.0,
                          "stop") for i, (ids, _) in enumerate(rows)]
        spec = ModelSpec(path=path, dtype="float32", lora=LoRASpec(rank=4, alpha=8, exclude_modules=".*visual.*"))
        model = M.build_policy(spec, torch.device("cpu"), wrap=lora.wrapper(spec))
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)
        mb = collate([0, 1, 2], samples, None, 0, torch.device("cpu"))
        mb.pixels = pixel_inputs(proc, [png for _, png in rows])
        with torch.no_grad():
            logp, _ = forward_logprobs(model, mb, T)
            merged = {name: t.clone() for name, t in lora.full_rollout_tensors(model)}
        torch.save({"logp": [logp[row, len(s.prompt_ids) - 1:len(s.prompt_ids) - 1 + len(s.response_ids)]
                             for row, s in enumerate(samples)],
                    "samples": [(s.prompt_ids, s.response_ids) for s in samples], "merged": merged,
                    "adapted": [m for m, _ in lora.adapter_modules(model)],
                    "trainable": [n for n, p in model.named_parameters() if p.requires_grad]}, out)
    finally:
        dist.destroy_process_group()


def test_lora_on_a_vl_model_computes_what_its_merged_weights_compute(vl_model, tmp_path):
    """verl's geo3k LoRA script (exclude_modules='.*visual.*'): adapters on the language model's
    linear layers only, the only weights that train; the policy's log-probs with images are those
    of a float64 VL model loaded with the merged weights the rollout engines get (every name one
    they load, strictly)."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForImageTextToText

    from grpo_api.spec import LoRASpec, ModelSpec
    from grpo_trainer.actor import Actor
    from grpo_trainer.vision import pixel_inputs
    out = tmp_path / "out.pt"
    mp.spawn(_lora_rank, args=(os.fspath(vl_model), os.fspath(out), os.fspath(tmp_path / "rdv")), nprocs=1, join=True)
    got = torch.load(out)
    assert got["adapted"] and all(".language_model." in m for m in got["adapted"]), got["adapted"]
    assert got["trainable"] and all(".lora_" in n for n in got["trainable"]), got["trainable"]
    ref = AutoModelForImageTextToText.from_pretrained(vl_model, dtype=torch.float64).eval()
    base = {n: t.clone() for n, t in ref.state_dict().items()}
    ref.load_state_dict({n: t.double() for n, t in got["merged"].items()}, strict=True)
    assert all(torch.equal(got["merged"][n], base[n].float()) for n in base if ".visual." in n)
    assert any(not torch.equal(got["merged"][n], base[n].float()) for n in base if ".language_model." in n)
    rows, proc = _prompts(vl_model)
    worst = 0.0
    for (prompt, response), (_, png), trainer in zip(got["samples"], rows, got["logp"]):
        ids, pixels = torch.tensor([prompt + response]), pixel_inputs(proc, [png])
        with torch.no_grad():
            logits = ref(input_ids=ids, pixel_values=pixels.pixel_values.double(), image_grid_thw=pixels.image_grid_thw,
                         mm_token_type_ids=(ids == ref.config.image_token_id).int()).logits[0]
        want = (logits[len(prompt) - 1:-1] / T).log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        worst = max(worst, float((trainer.double() - want).abs().max()))
    assert worst < 2e-5, worst
    # The start-up check reads a VL config (and names the linear layers it has).
    assert Actor.check(ModelSpec(path=str(vl_model), lora=LoRASpec(rank=4)))["r"] == 4
    with pytest.raises(Exception, match="spec.model.lora.targetModules: 'c_attn' names no linear layer"):
        Actor.check(ModelSpec(path=str(vl_model), lora=LoRASpec(rank=4, target_modules=["c_attn"])))
    assert Actor.check(ModelSpec(path=str(vl_model))) is None
