"""User code named in a job: `package.module:name` (importable, e.g. shipped in the rollout image)
or `path/to/file.py:name` (a file loaded as a module, as verl's custom_reward_function; on
Kubernetes typically a ConfigMap mounted into the rollout pods). Reward functions, tools and
custom agent loops are all found this way; an error names the field and what is wrong."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_attribute(ref: str, field: str, *, what: str = "function") -> Any:
    """The object `ref` names; a ValueError starting `<field> '<ref>':` otherwise."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{field} {ref!r}: expected 'module:{what}' or 'path/file.py:{what}'")
    module = _load_file(target, ref, field) if target.endswith(".py") or "/" in target else _import(target, ref, field)
    obj = getattr(module, name, None)
    if obj is None:
        raise ValueError(f"{field} {ref!r}: {target} has no {what} {name!r}")
    return obj


def _import(module_name: str, ref: str, field: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{field} {ref!r}: can't import {module_name}: {exc}") from None


def _load_file(path: str, ref: str, field: str):
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{field} {ref!r}: no file {file.absolute()}")
    # verl registers the file as `custom_module`; a name derived from the path lets two
    # different files coexist.
    module_name = f"grpo_user_code_{abs(hash(str(file.absolute())))}"
    if module_name in sys.modules:         # the same file, named by two fields: one module
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"{field} {ref!r}: loading {file} failed: {type(exc).__name__}: {exc}") from None
    return module
