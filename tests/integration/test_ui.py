"""Issue 35 item 2, `grpo ui RUN`, in a real headless browser (Debian's chromium, driven by its
chromedriver through selenium) on a real run: conftest's `resumed_run` (3 steps of the tiny model
on 4 prompts, storage.keepRolloutsSteps 1, so step 1's rollouts are gone), shared with
test_replay.py. `grpo ui` runs as a subprocess on a free port.

- the overview draws the curves (uPlot canvases) from metrics.jsonl, lists the steps from the
  rollouts folder and says step 1 was deleted by retention;
- a step page lists its 4 groups of 4 responses, every response token (unshaded: an on-policy run
  records no behaviour log-probs), and GRPO's
  advantages as (r - mean) / (std + 1e-6) of the group's rewards (float64, by hand here);
- the reward and text filters show what a hand filter of the step's shards selects;
- one prompt's responses across steps 2 and 3;
- a screenshot of each view under $GRPO_TEST_ARTIFACTS (default tests/.artifacts)/ui.

Without chromium, chromedriver or selenium the test is skipped; with GRPO_REQUIRE_E2E=1 (CI,
scripts/test.sh) it fails instead (browser_helpers)."""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from browser_helpers import chromium, serving_ui
from polling import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def browser():
    with chromium() as driver:
        yield driver


@pytest.fixture
def ui(resumed_run, tmp_path):
    with serving_ui(resumed_run, tmp_path / "ui.log") as base:
        yield base


def artifacts() -> Path:
    folder = Path(os.environ.get("GRPO_TEST_ARTIFACTS") or REPO / "tests" / ".artifacts") / "ui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def screenshot(driver, name: str) -> Path:
    """The whole page as PNG (chromium's DevTools capture beyond the window)."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 8000), "scale": 1}
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                            "clip": clip})
    path = artifacts() / f"{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def charts_drawn(driver) -> list[str]:
    """The titles of the charts once every one has its canvas (else [])."""
    done = driver.execute_script(
        "const c = [...document.querySelectorAll('div.chart')];"
        "return c.length > 0 && c.every(e => e.dataset.rendered === '1' && e.querySelector('canvas'));")
    return [e.text for e in driver.find_elements("css selector", "div.chart .u-title")] if done else []


def step_rows(run: Path, step: int) -> list[dict]:
    record = json.loads((run / "rollouts" / f"step-{step}" / "accepted.json").read_text())
    return [row for name in record["shards"] for row in pq.read_table(run / "rollouts" / f"step-{step}" / name).to_pylist()]


def shown(driver) -> list[tuple[str, int, float]]:
    """(group uid, sample index, reward) of the responses on the page."""
    return [(r.find_element("xpath", "ancestor::section").get_attribute("data-uid"),
             int(r.find_element("css selector", "td").text), float(r.get_attribute("data-reward")))
            for r in driver.find_elements("css selector", "tr.response")]


def filter_by(driver, **fields: str) -> None:
    form = driver.find_element("css selector", "form.filters")
    for name, value in fields.items():
        box = form.find_element("name", name)
        box.clear()
        box.send_keys(value)
    before = driver.current_url
    form.find_element("css selector", "button").click()
    wait_until(lambda: driver.current_url != before, what="the filtered page")


def test_the_run_page_in_chromium(resumed_run, tiny_model, browser, ui, capsys):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    shots = []

    # The overview: curves, the steps with rollouts, the deleted one named.
    browser.get(ui + "/")
    titles = wait_until(lambda: charts_drawn(browser), timeout=60, what="the curves")
    assert {"Reward", "KL", "Entropy", "Response length", "Step time (s)"} <= set(titles), titles
    assert browser.find_element("id", "deleted").text == \
        "Rollouts of step 1 deleted by storage.keepRolloutsSteps (1)."
    assert [a.text for a in browser.find_elements("css selector", "#steps a")] == ["step 3", "step 2"]
    shots.append(screenshot(browser, "1-overview"))

    # Step 3: its 4 groups of 4, each token, GRPO's advantages.
    browser.find_element("link text", "step 3").click()
    rows = step_rows(resumed_run, 3)
    wait_until(lambda: len(browser.find_elements("css selector", "section.group")) == 4, what="step 3's groups")
    assert sorted(shown(browser)) == sorted((r["uid"], r["sample_index"], pytest.approx(r["reward"])) for r in rows)
    spans = browser.find_elements("css selector", "tr.response td.tokens span")
    assert len(spans) == sum(len(r["response_ids"]) for r in rows)
    # An on-policy run without rollout.calculateLogProbs records no behaviour log-probs (issue 47):
    # its tokens are shown unshaded, and say why.
    assert all(r["response_logprobs"] is None for r in rows)
    assert all(not s.get_attribute("style") and s.get_attribute("title").startswith("log-prob not recorded")
               for s in spans)
    for section in browser.find_elements("css selector", "section.group"):
        uid = section.get_attribute("data-uid")
        rewards = np.array([r["reward"] for r in sorted(rows, key=lambda r: r["sample_index"]) if r["uid"] == uid],
                           dtype=np.float64)
        expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
        cells = [float(tr.find_elements("css selector", "td")[2].text)
                 for tr in section.find_elements("css selector", "tr.response")]
        assert cells == pytest.approx(expected, abs=6e-4), (uid, cells, expected)
    shots.append(screenshot(browser, "2-step"))

    # The reward filter: what a hand filter of the shards keeps (a threshold inside the range).
    rewards = sorted({r["reward"] for r in rows})
    assert len(rewards) > 1, "the dense reward gave every sample of step 3 the same reward"
    threshold = rewards[len(rewards) // 2]
    filter_by(browser, min_reward=repr(threshold))
    kept = sorted((r["uid"], r["sample_index"]) for r in rows if r["reward"] >= threshold)
    assert 0 < len(kept) < len(rows)
    assert sorted((u, i) for u, i, _ in shown(browser)) == kept
    assert browser.find_element("id", "summary").text.startswith(f"{len(kept)} of {len(rows)} samples")
    shots.append(screenshot(browser, "3-step-reward-filter"))

    # The text filter (no reward bound): the samples whose prompt or response has the text.
    # A word of one prompt that not every prompt has.
    prompts = {r["uid"]: tokenizer.decode(r["prompt_ids"]) for r in rows}
    needle = next(w for w in prompts[rows[0]["uid"]].split() if sum(w in p for p in prompts.values()) < len(prompts))
    filter_by(browser, min_reward="", q=needle)
    kept = sorted((r["uid"], r["sample_index"]) for r in rows
                  if needle.lower() in (prompts[r["uid"]] + "\n" + tokenizer.decode(r["response_ids"])).lower())
    assert 0 < len(kept) < len(rows)
    assert sorted((u, i) for u, i, _ in shown(browser)) == kept
    shots.append(screenshot(browser, "4-step-text-filter"))

    # One prompt across steps: its groups of steps 2 and 3 (every step is an epoch of the 4 prompts).
    browser.get(ui + "/step/3")
    section = browser.find_element("css selector", "section.group")
    key = section.get_attribute("data-uid").split("-", 1)[1]
    section.find_element("css selector", "a.follow").click()
    wait_until(lambda: charts_drawn(browser), timeout=60, what="the prompt's chart")
    groups = browser.find_elements("css selector", "section.group")
    assert [g.find_element("css selector", "h3 a").text for g in groups] == ["step 2", "step 3"]
    assert all(g.get_attribute("data-uid").split("-", 1)[1] == key for g in groups)
    assert [len(g.find_elements("css selector", "tr.response")) for g in groups] == [4, 4]
    shots.append(screenshot(browser, "5-prompt-across-steps"))

    # A deleted step says why it's gone.
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(ui + "/step/1", timeout=30)
    assert gone.value.code == 404 and "step 1 deleted by storage.keepRolloutsSteps (1)" in gone.value.read().decode()

    with capsys.disabled():
        print("\ngrpo ui screenshots:", *shots, sep="\n  ")
    assert all(p.stat().st_size > 10_000 for p in shots)
