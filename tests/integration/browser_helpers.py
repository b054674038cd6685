"""Headless Chromium (Debian's chromium, driven by its chromedriver through selenium) on `grpo ui`,
for the run-page tests (test_ui.py, test_vl_run.py). Without chromium, chromedriver or selenium a
test is skipped; with GRPO_REQUIRE_E2E=1 (CI, scripts/test.sh) it fails instead."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration_helpers import child_env, free_port, grpo_cli
from polling import wait_until

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def require_browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package (the dev extra)")
    if missing:
        msg = f"{', '.join(missing)} missing (scripts/install-node-packages.sh installs chromium and chromium-driver)"
        if os.environ.get("GRPO_REQUIRE_E2E") == "1":
            pytest.fail(msg + " and GRPO_REQUIRE_E2E=1")
        pytest.skip(msg)


@contextlib.contextmanager
def chromium() -> Iterator:
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.contextmanager
def serving_ui(run: Path, log: Path) -> Iterator[str]:
    """`grpo ui RUN` as a subprocess on a free port; yields its base URL once it serves."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([*grpo_cli(), "ui", str(run), "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=child_env())
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is None and urllib.request.urlopen(base + "/", timeout=30).status == 200,
                   timeout=180, what="grpo ui to serve", retry_on=(OSError,), diagnose=log.read_text)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)
