"""Helpers of the chart's tests: paths, rendering, running helm and kubectl."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "grpo-operator"
ALL_VALUES = Path(__file__).parent / "values-all.yaml"


def run(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), input=stdin, capture_output=True, text=True, check=check, timeout=180)


def render(helm: str, *args: str, namespace: str = "grpo-system") -> list[dict]:
    out = run(helm, "template", "grpo", str(CHART), "--namespace", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
