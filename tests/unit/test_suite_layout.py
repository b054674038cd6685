"""The suite runs every test folder: pyproject's testpaths lists them one by one (tests/e2e last,
scripts/test.sh imports its images meanwhile), so a new folder must be added there."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_testpaths_name_every_test_folder_and_e2e_last():
    paths = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    folders = {f"tests/{p.parent.name}" for p in (REPO / "tests").glob("*/test_*.py")}
    assert folders == set(paths), f"add {sorted(folders - set(paths))} to testpaths in pyproject.toml"
    assert paths[-1] == "tests/e2e"
