"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer and scheduler (of the
policy, and of PPO's critic), sampler, RNG, step and policy version under `<root>/checkpoints/step-N/`, `manifest.json` written last.

Only a checkpoint with a manifest is complete; `resume: auto` takes the latest complete one, so
a trainer killed mid-write resumes from the previous checkpoint.

DCP reads `.metadata` with pickle, so a checkpoint is code: the manifest lists every file with
its size and sha256 and is signed with the job's checkpoint key (grpo_api.signing). Saving, each
rank writes its DCP files into a local folder, hashes and uploads them; rank 0 signs the list.
Loading, each rank checks the signature, copies every listed file into a private local folder
(mode 0700) checking its hash on the way, and only then lets DCP read that copy: a file changed
in storage after the check is never read.

`Checkpointer` decides when: every trainer.saveFreq steps, at the last step, before a stop
(SIGTERM), and with trainer.saveBest at every step that beats the best so far (whose checkpoint
it then keeps, and whose policy it exports as hf/best); it keeps trainer.keepCheckpoints and
resumes what spec.resume names. What the
trainer's components need back (step, version, sampler, a batch generated ahead, tracker
runs, ...) is `trainer_state.json`, one typed part per component (state.TrainerState).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from grpo_api import signing
from grpo_api.records import RunLayout
from grpo_api.signing import ManifestError
from grpo_api.spec import StorageSpec, TrainerSpec
from grpo_api.storage import Storage
from grpo_trainer.collectives import all_gather_json, broadcast_json
from grpo_trainer.compile_cache import CompileCache, model_config_digest
from grpo_trainer.state import FILE as TRAINER_STATE
from grpo_trainer.state import CheckpointerState, TrainerState

log = logging.getLogger("grpo.trainer")
MANIFEST = "manifest.json"
FORMAT = "torch.distributed.checkpoint"
_STEP_DIR = re.compile(r"step-(\d+)$")


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
    uri = resume.rstrip("/")
    if uri.startswith("file://") and not uri.startswith("file:///"):   # relative: as job_root reads it
        uri = f"file://{Path(uri.removeprefix('file://')).absolute()}"
    parent, _, name = uri.rpartition("/")
    if parent != layout.checkpoints or not _STEP_DIR.fullmatch(name):
        # Only this job's checkpoints are signed with its key; one elsewhere would be refused
        # anyway, and the prefix is the first thing to tell the user.
        raise FileNotFoundError(f"spec.resume: {resume} is not one of this job's checkpoints "
                                f"({layout.checkpoints}/step-N): a job resumes only from its own checkpoints. "
                                f"To start from another run's weights, `grpo export` them and set spec.model.path")
    if not storage.exists(f"{uri}/{MANIFEST}"):
        raise FileNotFoundError(f"spec.resume: {resume} is not a complete checkpoint (no {MANIFEST})")
    return uri


def _keys(part: str) -> tuple[str, str]:
    """(model, optimizer) keys of a part in DCP's files: the policy's are the names checkpoints
    had before a critic could be in them."""
    return ("model", "optim") if part == "policy" else (part, f"{part}_optim")


def _model_options(model) -> StateDictOptions:
    """A LoRA policy's checkpoint holds its adapters only: the frozen base is spec.model.path."""
    from grpo_trainer.lora import is_lora
    return StateDictOptions(ignore_frozen_params=True, strict=False) if is_lora(model) else StateDictOptions()


def _dcp_state(parts: dict) -> dict:
    state = {}
    for part, (model, optimizer, _) in parts.items():
        model_key, optim_key = _keys(part)
        state[model_key] = get_model_state_dict(model, options=_model_options(model))
        state[optim_key] = get_optimizer_state_dict(model, optimizer)
    return state


def save(uri: str, *, parts: dict, trainer_state: TrainerState, storage: Storage,
         keep: int | None, layout: RunLayout, key: bytes, device: torch.device, protect: str | None = None) -> None:
    """`parts`: (model, optimizer, scheduler) by name ("policy", "critic"). Of the older
    checkpoints, `keep` are kept, and `protect` (the best one) whatever its age."""
    rank = dist.get_rank()
    staging = tempfile.mkdtemp(prefix="grpo-ckpt-")
    try:
        dcp.save(_dcp_state(parts), checkpoint_id=staging)
        # Every rank's generator: each draws its own dropout masks (LoRA's dropout) from it.
        by_rank = all_gather_json(torch.get_rng_state().tolist(), device)
        if rank == 0:
            # The checkpointer's own part: the schedulers and generators are saved beside the models.
            own = trainer_state.checkpointer.model_copy(update={
                "rng": {"torch": by_rank[0], "torch_by_rank": by_rank},
                "schedulers": {part: scheduler.state_dict() for part, (_, _, scheduler) in parts.items()}})
            with open(os.path.join(staging, TRAINER_STATE), "w") as f:
                f.write(trainer_state.model_copy(update={"checkpointer": own}).to_json())
        files = {}
        for name in sorted(os.listdir(staging)):
            path = os.path.join(staging, name)
            size, sha = signing.sha256_file(path)
            files[name] = {"size": size, "sha256": sha}
            with open(path, "rb") as f:
                storage.write_bytes(f"{uri}/{name}", f.read())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    everyone = all_gather_json(files, device)     # also the barrier: every rank's files are written
    if rank == 0:
        listed = {name: entry for ranks_files in everyone for name, entry in ranks_files.items()}
        body = {"step": trainer_state.trainer.step, "policy_version": trainer_state.trainer.policy_version,
                "format": FORMAT, "files": listed}
        storage.write_bytes(f"{uri}/{MANIFEST}", signing.sign(body, key))
        if keep:
            for _, old in complete_checkpoints(layout, storage)[:-keep]:
                if old != protect:
                    storage.delete_dir(old)
    dist.barrier()


def stage(uri: str, storage: Storage, key: bytes) -> tuple[str, dict]:
    """A private local copy of the checkpoint at `uri`, every file checked against its signed
    manifest, and the manifest; ManifestError (naming the file) for anything that doesn't
    match. Delete the folder when done."""
    where = f"{uri}/{MANIFEST}"
    manifest = signing.verify(storage.read_bytes(where), key, where)
    m = _STEP_DIR.search(uri)
    if manifest.get("format") != FORMAT or m is None or manifest.get("step") != int(m.group(1)):
        # A whole checkpoint of another step put under this name rolls the run back.
        raise ManifestError(f"{where}: the manifest is of step {manifest.get('step')} ({manifest.get('format')}), "
                            f"not of this folder; refusing to load it")
    staging = tempfile.mkdtemp(prefix="grpo-ckpt-")   # 0700: no one else can change the copy
    try:
        for name, entry in manifest["files"].items():
            try:
                size, sha = storage.download(f"{uri}/{name}", os.path.join(staging, name))
            except FileNotFoundError:
                raise ManifestError(f"{uri}/{name}: listed in the signed manifest but missing") from None
            if size != entry["size"]:
                raise ManifestError(f"{uri}/{name}: {size} bytes, the signed manifest says {entry['size']} "
                                    f"(truncated or replaced); refusing to load the checkpoint")
            if sha != entry["sha256"]:
                raise ManifestError(f"{uri}/{name}: its sha256 does not match the signed manifest (changed or "
                                    f"replaced since the trainer wrote it); refusing to load the checkpoint")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging, manifest


def load(uri: str, *, parts: dict, storage: Storage, key: bytes, device: torch.device) -> TrainerState:
    """Load a complete, verified checkpoint into the sharded model and optimizer; return the
    trainer state. Every rank checks its own copy; all stop (ManifestError) if any copy fails,
    instead of the others waiting in DCP's collectives for it."""
    staging, problem = None, None
    try:
        staging, _ = stage(uri, storage, key)
    except ManifestError as exc:
        problem = str(exc)
    problems = [p for p in all_gather_json(problem, device) if p]
    if problems:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        raise ManifestError(problems[0])
    try:
        with open(os.path.join(staging, TRAINER_STATE)) as f:
            extras = TrainerState.from_json(f.read())
        schedulers = extras.checkpointer.schedulers
        for part in parts:
            if part not in schedulers:   # every rank reads the same file: all stop here
                raise ManifestError(f"{uri}: the checkpoint has no {part} (written by a job without one: "
                                    f"advEstimator gae trains a critic); start this job from its exported "
                                    f"model instead (spec.model.path)")
        state = _dcp_state(parts)
        dcp.load(state, checkpoint_id=staging)
        for part, (model, optimizer, scheduler) in parts.items():
            model_key, optim_key = _keys(part)
            set_model_state_dict(model, state[model_key], options=_model_options(model))
            set_optimizer_state_dict(model, optimizer, state[optim_key])
            scheduler.load_state_dict(schedulers[part])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # This rank's generator; rank 0's where the checkpoint has none for it (older, or fewer ranks).
    rng = extras.checkpointer.rng
    by_rank = rng.get("torch_by_rank", [])
    mine = by_rank[dist.get_rank()] if dist.get_rank() < len(by_rank) else rng["torch"]
    torch.set_rng_state(torch.tensor(mine, dtype=torch.uint8))
    return extras


def load_full_state_dict(uri: str, storage: Storage, key: bytes) -> tuple[dict[str, torch.Tensor], TrainerState]:
    """The model weights of a verified checkpoint as plain tensors, without a process group (for
    export), and its trainer state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    staging, _ = stage(uri, storage, key)
    try:
        out = os.path.join(staging, "full.pt")
        dcp_to_torch_save(staging, out)
        full = torch.load(out, weights_only=True)["model"]
        with open(os.path.join(staging, TRAINER_STATE)) as f:
            extras = TrainerState.from_json(f.read())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return full, extras


def open_compile_cache(spec: StorageSpec, storage: Storage, layout: RunLayout, key: bytes, *, device: torch.device,
                       compile: bool, model_path: str) -> CompileCache | None:
    """spec.storage.compileCache: the decoder layers an earlier trainer of this run compiled, kept
    in the run and signed with the job's checkpoint key as its checkpoints are. Every rank restores
    (the first of a machine unpacks), before anything compiles; rank 0 saves after a step that
    compiled something new. None without a GPU or trainer.useTorchCompile (`compile`)."""
    if device.type != "cuda" or not compile:
        return None
    cache = CompileCache.for_run(spec, storage, layout.root, key, "trainer", torch=torch.__version__,
                                 gpu=torch.cuda.get_device_name(device), model=model_config_digest(model_path))
    if cache is not None:
        cache.restore()
    return cache


class Checkpointer:
    def __init__(self, trainer: TrainerSpec, *, resume: str, parts: dict, layout: RunLayout, storage: Storage,
                 key: bytes, device: torch.device, model_spec, adapter: Callable[[], dict | None] = lambda: None,
                 lora_config: dict | None = None):
        """trainer: spec.trainer (saveFreq, keepCheckpoints, saveBest); resume: spec.resume.
        parts: (model, optimizer, scheduler) by name, as the actor holds them; model_spec: the
        policy's model as loaded (its config and tokenizer go into the exports); adapter: with
        LoRA, a collective returning the adapters on rank 0 (exported beside the merged model,
        with their PEFT `lora_config`)."""
        self.adapter, self.lora_config = adapter, lora_config
        self.trainer, self.resume_from = trainer, resume
        self.layout, self.storage, self.key, self.device = layout, storage, key, device
        self.model_spec = model_spec
        self.parts = parts
        self.last: str | None = None   # the latest complete checkpoint, saved or resumed from
        self.best: dict | None = None  # trainer.saveBest: {"step", "score"} of the best step so far
        self.resumed_own = False       # resumed from this job's own checkpoint (not spec.resume's <uri>)

    def resume(self) -> TrainerState | None:
        """Collective: load the checkpoint spec.resume names into the model and optimizer, and
        return its trainer state, or None to start fresh."""
        uri = resolve_resume(self.resume_from, self.layout, self.storage)
        if uri is None:
            return None
        state = load(uri, parts=self.parts, storage=self.storage, key=self.key, device=self.device)
        self.last, self.best = uri, state.checkpointer.best
        self.resumed_own = uri.startswith(self.layout.checkpoints + "/")
        log.info("Resumed from %s (step %d, policy version %d)", uri, state.trainer.step,
                 state.trainer.policy_version)
        return state

    def should_save(self, step: int, *, last: bool) -> bool:
        freq = self.trainer.save_freq
        return last or (freq > 0 and step % freq == 0)

    def maybe_save(self, step: int, trainer_state: Callable[[], dict], metrics: dict, *, last: bool,
                   weights: Callable[[], dict | None]) -> dict[str, float]:
        """Collective, after step `step` with its metrics: save when due or when the step is the
        best so far (then `weights()`, the policy on rank 0, becomes hf/best too).
        {"timing_s/checkpoint": seconds} or {}."""
        best = self._new_best(step, metrics)
        if not (best or self.should_save(step, last=last)):
            return {}
        seconds = self.save(step, trainer_state())
        if best:
            policy, adapter = weights(), self.adapter()
            if dist.get_rank() == 0:
                self.storage.delete_dir(self.layout.hf_best)
                self.export(policy, self.layout.hf_best, adapter)
        return {"timing_s/checkpoint": seconds}

    def _new_best(self, step: int, metrics: dict) -> bool:
        """Collective: whether rank 0's metrics make `step` the best so far (trainer.saveBest)."""
        rule = self.trainer.save_best
        if rule is None:
            return False
        score = metrics.get(rule.metric) if dist.get_rank() == 0 else None
        better = (score is not None and math.isfinite(score) and
                  (self.best is None or (score > self.best["score"] if rule.mode == "max" else score < self.best["score"])))
        decided = broadcast_json({"step": step, "score": score} if better else None, self.device)
        if decided is not None:
            self.best = decided
            if dist.get_rank() == 0:
                log.info("New best %s %.4g at step %d (trainer.saveBest)", rule.metric, score, step)
        return decided is not None

    def save(self, step: int, trainer_state: dict) -> float:
        """Collective: checkpoint step `step` now. `trainer_state`: each component's part by name
        (state.TrainerState; rank 0's is the one kept)."""
        start = time.perf_counter()
        uri = self.layout.checkpoint(step)
        state = TrainerState.model_validate({**trainer_state, "checkpointer": CheckpointerState(best=self.best)})
        save(uri, parts=self.parts, trainer_state=state,
             storage=self.storage, keep=self.trainer.keep_checkpoints, layout=self.layout, key=self.key,
             device=self.device, protect=self.layout.checkpoint(self.best["step"]) if self.best else None)
        self.last = uri
        if dist.get_rank() == 0:
            log.info("Saved checkpoint to %s", uri)
        return time.perf_counter() - start

    def export(self, weights: dict[str, torch.Tensor], uri: str, adapter: dict | None = None) -> None:
        """Rank 0: a policy as a Hugging Face model at `uri` (hf/step-N at the end, hf/best);
        with LoRA (`adapter`) merged, and the PEFT adapter folder in `uri`/lora_adapter."""
        from grpo_trainer.export import save_adapter, save_hf
        save_hf(weights, self.model_spec, uri, self.storage)
        if adapter is not None:
            save_adapter(adapter, self.lora_config, self.model_spec, uri, self.storage)
        log.info("Exported the %s policy to %s", "best" if uri == self.layout.hf_best else "final", uri)
