"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, scheduler, sampler,
RNG, step and policy version under `<root>/checkpoints/step-N/`, `manifest.json` written last.

Only a checkpoint with a manifest is complete; `resume: auto` takes the latest complete one, so
a trainer killed mid-write resumes from the previous checkpoint. On object storage each rank
stages its DCP files locally and uploads them before rank 0 writes the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from grpo_api.records import RunLayout
from grpo_api.storage import Storage

log = logging.getLogger("grpo.trainer")
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)$")


def _local_path(uri: str) -> str | None:
    return uri.removeprefix("file://") if uri.startswith("file://") else None


def complete_checkpoints(layout: RunLayout, storage: Storage) -> list[tuple[int, str]]:
    """(step, uri) of every checkpoint with a manifest, oldest first."""
    found = []
    for uri in storage.list(layout.checkpoints, recursive=True):
        if uri.endswith("/" + MANIFEST):
            step_dir = uri[: -len(MANIFEST) - 1]
            if m := _STEP_DIR.search(step_dir):
                found.append((int(m.group(1)), step_dir))
    return sorted(found)


def resolve_resume(resume: str, layout: RunLayout, storage: Storage) -> str | None:
    """The checkpoint URI to resume from, or None to start fresh."""
    if resume == "never":
        return None
    if resume == "auto":
        done = complete_checkpoints(layout, storage)
        return done[-1][1] if done else None
    if not storage.exists(resume.rstrip("/") + "/" + MANIFEST):
        raise FileNotFoundError(f"spec.resume: {resume} is not a complete checkpoint (no {MANIFEST})")
    return resume.rstrip("/")


def save(uri: str, *, model, optimizer, scheduler, trainer_state: dict, storage: Storage,
         keep: int | None, layout: RunLayout) -> None:
    rank = dist.get_rank()
    local = _local_path(uri)
    staging = local or tempfile.mkdtemp(prefix="grpo-ckpt-")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=staging)
    rng = {"torch": torch.get_rng_state().tolist()}
    extras = {**trainer_state, "scheduler": scheduler.state_dict(), "rng": rng}
    if rank == 0:
        storage.write_bytes(f"{uri}/trainer_state.json", json.dumps(extras).encode())
    if local is None:
        for name in os.listdir(staging):
            with open(os.path.join(staging, name), "rb") as f:
                storage.write_bytes(f"{uri}/{name}", f.read())
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    if rank == 0:
        manifest = {"step": trainer_state["step"], "policy_version": trainer_state["policy_version"],
                    "format": "torch.distributed.checkpoint"}
        storage.write_bytes(f"{uri}/{MANIFEST}", json.dumps(manifest).encode())
        if keep:
            for _, old in complete_checkpoints(layout, storage)[:-keep]:
                storage.delete_dir(old)
    dist.barrier()


def load(uri: str, *, model, optimizer, scheduler, storage: Storage) -> dict:
    """Load a complete checkpoint into the sharded model and optimizer; return trainer state."""
    local = _local_path(uri)
    staging = local or _download(uri, storage)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=staging)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    extras = json.loads(storage.read_bytes(f"{uri}/trainer_state.json"))
    scheduler.load_state_dict(extras["scheduler"])
    torch.set_rng_state(torch.tensor(extras["rng"]["torch"], dtype=torch.uint8))
    if local is None:
        shutil.rmtree(staging, ignore_errors=True)
    return extras


def _download(uri: str, storage: Storage) -> str:
    staging = tempfile.mkdtemp(prefix="grpo-ckpt-")
    for file_uri in storage.list(uri):
        name = file_uri.rsplit("/", 1)[-1]
        with open(os.path.join(staging, name), "wb") as f:
            f.write(storage.read_bytes(file_uri))
    return staging


def load_full_state_dict(uri: str, storage: Storage) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint as plain tensors, without a process group (for export)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    local = _local_path(uri)
    staging = local or _download(uri, storage)
    out = os.path.join(tempfile.mkdtemp(prefix="grpo-export-"), "full.pt")
    dcp_to_torch_save(staging, out)
    full = torch.load(out, weights_only=True)["model"]
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    if local is None:
        shutil.rmtree(staging, ignore_errors=True)
    return full


def full_weights_for_rollout(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full weights as the rollout engines hold them (collective; rank 0's dict has them,
    the others' is empty): cast to `dtype` on the device before the copy to the host (half
    the bytes of the float32 masters in bfloat16), and a tied tensor once, under its first name
    (the tied LM head is the embedding: engines load one and have both). `save_hf` reads
    this dict too (it casts to the model's dtype and re-ties)."""
    from torch.distributed.tensor import DTensor
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            out[name] = full.detach().to(dtype).cpu()
    return out


def full_state_dict_for_export(model) -> dict[str, torch.Tensor]:
    """Gather the sharded model to full CPU tensors (collective; rank 0 gets them)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
