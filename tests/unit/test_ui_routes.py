"""`grpo ui`'s routes in process (Starlette's test client over grpo_trainer.ui.app) on a run folder
written here: a validation before training (rollouts/step-0, no training shard), steps 1 and 2.
The pages in a browser: tests/integration/test_ui.py."""

from __future__ import annotations

import hashlib
import html
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

from grpo_api.records import ROLLOUT_SCHEMA
from grpo_api.storage import Storage
from grpo_rollout.tiny import build_tokenizer
from grpo_trainer.rollout_history import RolloutHistory
from grpo_trainer.ui.app import build_app
from grpo_trainer.ui.run_view import RunView


def _shard(path, uid: str, rewards: list[float], logprobs: list[float] | None = (-0.5, -0.25)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"uid": uid, "prompt_index": 0, "sample_index": i, "prompt_ids": [5, 6], "response_ids": [7, 8],
             "response_logprobs": None if logprobs is None else list(logprobs), "reward": r, "reward_extra": "{}", "finish_reason": "stop",
             "policy_version": 1, "data_source": "d", "ground_truth": "7", "worker": "w"}
            for i, r in enumerate(rewards)]
    pq.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA), path)


@pytest.fixture
def client(tmp_path):
    _shard(tmp_path / "rollouts/step-0/val0-attempt-0.parquet", "val-3", [1.0])
    _shard(tmp_path / "rollouts/step-1/train-shard-000-attempt-1.parquet", "0-3", [0.0, 1.0])
    # Step 2 on-policy, without rollout.calculateLogProbs: the engine reported no log-probs (issue 47).
    _shard(tmp_path / "rollouts/step-2/train-shard-000-attempt-1.parquet", "0-3", [1.0, 1.0], logprobs=None)
    (tmp_path / "progress.json").write_text(json.dumps({"step": 2}))
    # Every step has a sample scoring 1 and one scoring 0; only the mean moves.
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "critic/score/mean": mean, "critic/score/max": 1.0, "critic/score/min": 0.0}) + "\n"
        for s, mean in ((1, 0.02), (2, 0.06))))
    view = RunView(RolloutHistory(f"file://{tmp_path}", Storage()), build_tokenizer(), None)
    return TestClient(build_app(view))


def charts(page: str) -> dict[str, dict]:
    specs = [json.loads(html.unescape(s)) for s in re.findall(r"data-spec='([^']*)'", page)]
    return {spec["title"]: spec for spec in specs}


def test_the_run_page_lists_the_trained_steps_and_not_the_validation_before_training(client):
    page = client.get("/").text
    assert re.findall(r'href="/step/(\d+)"', page) == ["2", "1"]
    step0 = client.get("/step/0")
    assert step0.status_code == 404
    assert "training starts at step 1" in step0.text
    step1 = client.get("/step/1").text         # its neighbours: step 2, no step 0
    assert re.findall(r'href="/step/(\d+)\?', step1) == ["2"]


def test_the_mean_reward_has_its_own_chart(client):
    drawn = charts(client.get("/").text)
    # With the max and min (1 and 0) on its axis the mean's 0.02 -> 0.06 was a flat line.
    assert drawn["Reward"]["series"] == {"critic/score/mean": [0.02, 0.06]}
    assert drawn["Reward range"]["series"] == {"critic/score/max": [1.0, 1.0], "critic/score/min": [0.0, 0.0]}


@pytest.mark.parametrize("key", ["abc", "3x", "-3", "007", "٣"])
def test_a_prompt_that_is_not_a_dataset_row_number_is_not_found(client, key):
    answer = client.get(f"/prompt/{key}")
    assert answer.status_code == 404
    assert "not a prompt; a prompt is its dataset row number" in answer.text


def test_a_prompt_across_its_steps(client):
    page = client.get("/prompt/3").text
    assert "Dataset prompt 3 appears in 2 of the steps 1-2." in page
    assert charts(page)["Reward of this prompt's responses"]["series"] == {"mean": [0.5, 1.0], "max": [1.0, 1.0]}


def test_tokens_are_shaded_by_their_log_prob_and_unshaded_where_none_was_recorded(client):
    spans = lambda step: re.findall(r'<span style="([^"]*)" title="([^"]*)"', client.get(f"/step/{step}").text)
    # 1 - p: 1 - e^-0.5 = 0.39 and 1 - e^-0.25 = 0.22, x 0.75.
    assert spans(1) == [("background: rgba(220, 40, 40, 0.30)", "logprob -0.500"),
                        ("background: rgba(220, 40, 40, 0.17)", "logprob -0.250")] * 2
    assert spans(2) == [("", "log-prob not recorded (rollout.calculateLogProbs)")] * 4


def _png(colour: str) -> bytes:
    import io

    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format="PNG")
    return out.getvalue()


RED_PNG = _png("red")
JPEG = b"\xff\xd8\xff\xe0" + b"not decoded by the route" * 4
RED, JPEG_NAME = hashlib.sha256(RED_PNG).hexdigest(), hashlib.sha256(JPEG).hexdigest()


@pytest.fixture
def vl_client(tmp_path):
    """A VL run's step 1: prompt 3 with the red PNG (two samples, the records naming it where the
    run was written), prompt 4 with no image; a JPEG stored beside it; a file outside images/."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / RED).write_bytes(RED_PNG)
    (tmp_path / "images" / JPEG_NAME).write_bytes(JPEG)
    (tmp_path / "secret").write_text("not an image")
    rows = [{"uid": uid, "prompt_index": p, "sample_index": i, "prompt_ids": [5, 6], "response_ids": [7, 8],
             "response_logprobs": [-0.5, -0.25], "reward": 1.0, "reward_extra": "{}", "finish_reason": "stop",
             "policy_version": 1, "data_source": "colours", "ground_truth": "red", "worker": "w", "images": images}
            for p, (uid, images) in enumerate([("0-3", [f"s3://bucket/run/images/{RED}"]), ("0-4", None)])
            for i in range(2)]
    (tmp_path / "rollouts/step-1").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA),
                   tmp_path / "rollouts/step-1/train-shard-000-attempt-1.parquet")
    (tmp_path / "progress.json").write_text(json.dumps({"step": 1}))
    return TestClient(build_app(RunView(RolloutHistory(f"file://{tmp_path}", Storage()), build_tokenizer(), None)))


def _group_images(page: str) -> dict[str, list[tuple[str, str]]]:
    """Each group's <img> tags: uid -> [(src, alt)]."""
    cards = re.findall(r'<section class="group" data-uid="([^"]+)">(.*?)</section>', page, re.S)
    return {uid: re.findall(r'<img src="([^"]+)" loading="lazy" alt="([^"]+)">', body) for uid, body in cards}


@pytest.mark.parametrize("url", ["/step/1", "/prompt/3?first=1&last=1"])
def test_a_vl_group_shows_its_image_beside_its_responses(vl_client, url):
    shown = _group_images(vl_client.get(url).text)
    assert shown["0-3"] == [(f"/image/{RED}", "image 1 of prompt 0-3")]
    assert shown.get("0-4", []) == []          # a text prompt: no image


def test_the_image_route_serves_the_stored_bytes_with_their_type(vl_client):
    png = vl_client.get(f"/image/{RED}")
    assert png.status_code == 200 and png.content == RED_PNG
    assert png.headers["content-type"] == "image/png" and png.headers["x-content-type-options"] == "nosniff"
    jpeg = vl_client.get(f"/image/{JPEG_NAME}")
    assert jpeg.status_code == 200 and jpeg.content == JPEG and jpeg.headers["content-type"] == "image/jpeg"


@pytest.mark.parametrize("name", ["0" * 64, RED.upper(), RED[:63], RED + "0", "secret", "..%2Fsecret",
                                  "..%2F..%2Fprogress.json", f"{RED}.png"])
def test_the_image_route_serves_nothing_but_stored_images(vl_client, name):
    answer = vl_client.get(f"/image/{name}")
    assert answer.status_code == 404
    assert answer.content not in (b"not an image", RED_PNG)
