"""`grpo ui`'s vendored chart library is the npm release VENDORED.md names, unchanged (its
sha256 there): a page never runs a script nobody can trace. The page in a browser:
tests/integration/test_ui.py."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

UPLOT = Path(__file__).resolve().parents[2] / "trainer_image" / "grpo_trainer" / "ui" / "static" / "uplot"


def test_vendored_uplot_matches_its_recorded_hashes():
    recorded = {
        name: sha for name, sha in re.findall(r"sha256 (\S+)\s+([0-9a-f]{64})", (UPLOT / "VENDORED.md").read_text())}
    assert set(recorded) == {"uPlot.iife.min.js", "uPlot.min.css"}
    for name, sha in recorded.items():
        assert hashlib.sha256((UPLOT / name).read_bytes()).hexdigest() == sha, name
    assert (UPLOT / "uPlot.iife.min.js").read_text().startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
