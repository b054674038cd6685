"""The wheel the images install, checked the way an image uses it: built from the files the
Dockerfiles' wheel stage copies, installed non-editable into a fresh venv, every module imported
from there and every `grpo` subcommand's `--help` run from there.

Every other test runs the editable install, which serves modules straight from the source tree,
so a subpackage missing from the wheel (grpo_trainer.algorithms once was) went unnoticed until a
pod crashed on import. The fresh venv gets only the wheel; third-party packages (torch, kopf, ...)
come from this test's own environment through a path entry, since downloading them again would
only test PyPI. The test checks that every module is loaded from the fresh venv, never from the
source tree or the editable install.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SOURCE_ROOTS = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]
COMMANDS = sorted(PYPROJECT["project"]["entry-points"]["grpo.commands"])


def _run(command: list, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built as the Dockerfiles' wheel stage builds it: from a copy holding only
    pyproject.toml and the source roots (so nothing else in the checkout can leak in)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copy(REPO / "pyproject.toml", src)
    for root in SOURCE_ROOTS:
        shutil.copytree(REPO / root, src / root, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", dist, src])
    (found,) = dist.glob("grpo_operator-*.whl")
    return found


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel) -> Path:
    """A new venv with the wheel installed (no deps), plus this environment's site-packages
    appended to its path for the third-party packages."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel])
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # A plain directory line: appended after the venv's own site-packages, and .pth files in it
    # (the editable install's finder among them) are not run.
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "zz_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return root


def _wheel_modules(wheel: Path) -> list[str]:
    names = zipfile.ZipFile(wheel).namelist()
    modules = []
    for name in names:
        if name.endswith(".py") and name.startswith("grpo_"):
            parts = name[:-3].split("/")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules.append(".".join(parts))
    return sorted(modules)


def test_wheel_holds_every_package_of_the_source_tree(wheel):
    in_wheel = set(_wheel_modules(wheel))
    in_tree = set()
    for root in SOURCE_ROOTS:
        for path in (REPO / root).rglob("*.py"):
            relative = path.relative_to(REPO / root).with_suffix("")
            parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
            if parts and parts[0].startswith("grpo_") and "__pycache__" not in parts:
                in_tree.add(".".join(parts))
    assert in_tree - in_wheel == set(), "modules missing from the wheel"
    data = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith((".proto", ".pyi"))}
    assert "grpo_api/proto/rollout.proto" in data
    # `grpo ui`'s templates and vendored charts (package data): the page needs every one.
    ui = REPO / "trainer_image" / "grpo_trainer" / "ui"
    assets = {f"grpo_trainer/ui/{p.relative_to(ui)}" for p in ui.rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert assets - set(zipfile.ZipFile(wheel).namelist()) == set(), "grpo ui files missing from the wheel"


def test_every_module_imports_from_the_installed_wheel(wheel, fresh_venv):
    modules = _wheel_modules(wheel)
    script = (
        "import importlib, json, sys\n"
        "files = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    files[name] = importlib.import_module(name).__file__\n"
        "print(json.dumps(files))\n"
    )
    done = _run([fresh_venv / "bin" / "python", "-c", script, json.dumps(modules)], cwd=fresh_venv)
    files = json.loads(done.stdout.strip().splitlines()[-1])
    outside = {m: f for m, f in files.items() if not Path(f).resolve().is_relative_to(fresh_venv.resolve())}
    assert not outside, f"modules not loaded from the installed wheel: {outside}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_grpo_subcommand_has_help(fresh_venv, command):
    done = _run([fresh_venv / "bin" / "grpo", command, "--help"], cwd=fresh_venv)
    assert "usage:" in done.stdout, done.stdout
