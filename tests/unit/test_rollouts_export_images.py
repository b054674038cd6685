"""`grpo rollouts export` of a vision-language run (issue 45 item 4), in process on a run folder
written here: its records name each prompt's image by URI (images/<sha256>, stored once); the
export carries the images as --images asks: inline in verl's {bytes, path} layout (parquet's
default, a dataset verl and data.imageKey read as they are), copied once beside the output (JSONL's
default), or the URIs."""

from __future__ import annotations

import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from grpo_api.contracts import BAD_INPUT_EXIT_CODE
from grpo_api.images import check_local_images
from grpo_api.records import ROLLOUT_SCHEMA
from grpo_trainer.rollouts_export import rollouts


def _encoded(colour: str, fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format=fmt)
    return out.getvalue()


RED, BLUE = _encoded("red", "PNG"), _encoded("blue", "JPEG")


def _name(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def run(tmp_path):
    """Step 1: prompt 3 (the red PNG) and prompt 4 (the blue JPEG), two samples each, and prompt 5
    with no image. The records name the images where the run was written (S3): the folder is a
    copy, and the export reads the copy's images/."""
    root = tmp_path / "run"
    (root / "images").mkdir(parents=True)
    for data in (RED, BLUE):
        (root / "images" / _name(data)).write_bytes(data)
    images = {"0-3": [f"s3://bucket/run/images/{_name(RED)}"], "0-4": [f"s3://bucket/run/images/{_name(BLUE)}"],
              "0-5": None}
    rows = [{"uid": uid, "prompt_index": p, "sample_index": i, "prompt_ids": [5, 6], "response_ids": [7],
             "response_logprobs": [-0.5], "reward": 1.0, "reward_extra": "{}", "finish_reason": "stop",
             "policy_version": 0, "data_source": "colours", "ground_truth": "red", "worker": "w",
             "images": images[uid]}
            for p, uid in enumerate(images) for i in range(2)]
    (root / "rollouts/step-1").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA),
                   root / "rollouts/step-1/train-shard-000-attempt-1.parquet")
    (root / "progress.json").write_text(json.dumps({"step": 1}))
    return root


def export(run, out, *options) -> int:
    return rollouts(["export", str(run), "-o", str(out), "--no-text", *options])


def test_parquet_inlines_each_samples_images_as_verl_reads_them(run, tmp_path, capsys):
    out = tmp_path / "rollouts.parquet"
    assert export(run, out) == 0
    table = pq.read_table(out)
    assert table.schema.field("images").type == pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    images = table["images"].to_pylist()
    assert [[i["bytes"] for i in row] if row is not None else None for row in images] == \
        [[RED], [RED], [BLUE], [BLUE], None, None]
    assert images[0][0]["path"] == f"s3://bucket/run/images/{_name(RED)}"     # where the record named it
    check_local_images(out, "images")      # grpo run's preflight of a data.imageKey column: every image opens
    assert not (tmp_path / "rollouts-images").exists()


def test_jsonl_copies_each_image_once_beside_the_output(run, tmp_path, capsys):
    out = tmp_path / "out" / "rollouts.jsonl"
    out.parent.mkdir()
    assert export(run, out) == 0
    folder = (tmp_path / "out" / "rollouts-images").resolve()
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{_name(RED)}.png", f"{_name(BLUE)}.jpg"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = [[i["path"] for i in r["images"]] if r["images"] is not None else None for r in rows]
    assert paths == [[str(folder / f"{_name(RED)}.png")]] * 2 + [[str(folder / f"{_name(BLUE)}.jpg")]] * 2 + [None] * 2
    assert all(i["bytes"] is None for r in rows[:4] for i in r["images"])
    assert (folder / f"{_name(BLUE)}.jpg").read_bytes() == BLUE
    assert f"2 images in {folder}" in capsys.readouterr().out


def test_uris_keeps_the_records_references(run, tmp_path):
    out = tmp_path / "rollouts.parquet"
    assert export(run, out, "--images", "uris") == 0
    assert pq.read_table(out)["images"].to_pylist()[::2] == [[f"s3://bucket/run/images/{_name(RED)}"],
                                                            [f"s3://bucket/run/images/{_name(BLUE)}"], None]


def test_inline_images_in_jsonl_are_refused(run, tmp_path, capsys):
    out = tmp_path / "rollouts.jsonl"
    assert export(run, out, "--images", "inline") == BAD_INPUT_EXIT_CODE
    assert capsys.readouterr().err.strip() == ("error: --images inline: JSONL can't hold image bytes; use --images "
                                               "files or uris, or --format parquet")
    assert not out.exists()


@pytest.mark.parametrize("damage, says", [("delete", "is missing from the run"),
                                          ("overwrite", "its bytes don't hash to its name")])
def test_a_missing_or_damaged_image_is_one_error_line_and_no_file(run, tmp_path, capsys, damage, says):
    stored = run / "images" / _name(BLUE)
    stored.unlink() if damage == "delete" else stored.write_bytes(RED)
    out = tmp_path / "rollouts.parquet"
    assert export(run, out) == BAD_INPUT_EXIT_CODE
    err = capsys.readouterr().err
    assert err.startswith(f"error: file://{run}/images/{_name(BLUE)}: ") and says in err, err
    assert list(tmp_path.glob("*rollouts*")) == []
