"""trainer.saveBest, the Checkpointer in process (one gloo rank, the tiny model, file:// storage),
against hand-worked score sequences: which step is the best (the first to reach the best score;
steps without the metric, or with a non-finite one, are not ranked), that a best step is
checkpointed whatever saveFreq says and outlives keepCheckpoints, that hf/best is that step's
policy, and that a resumed run remembers the best. On a real run (progress.json's bestStep):
tests/integration/test_trainer.py's two_rank_run, and the e2e PPO + LoRA job."""

from __future__ import annotations

import math
import secrets

import pytest
import torch
import torch.distributed as dist

from grpo_api.records import RunLayout
from grpo_api.spec import ModelSpec, TrainerSpec
from grpo_api.storage import Storage
from grpo_trainer.checkpoint import Checkpointer

KEY = secrets.token_bytes(32)


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    if dist.is_initialized():      # another in-process test's group, still up
        assert dist.get_world_size() == 1
        yield
        return
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from grpo_rollout.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def run(tmp_path, tiny, scores: dict[int, float | None], **trainer) -> tuple[Checkpointer, dict, list]:
    """Steps 1..max(scores), each with its score (None: the step has no such metric) and its own
    weights (every parameter filled with the step number). The checkpointer, the policy after
    each step, and what maybe_save returned at each step."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    spec = TrainerSpec.model_validate({"saveBest": {"metric": "critic/score/mean"}, **trainer})
    layout = RunLayout(f"file://{tmp_path}/run")
    ckpt = Checkpointer(spec, resume="auto", parts={"policy": (model, optimizer, scheduler)}, layout=layout,
                        storage=Storage(), key=KEY, device=torch.device("cpu"), model_spec=ModelSpec(path=str(tiny)))
    last_step, policies, saved = max(scores), {}, []
    for step in range(1, last_step + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        policies[step] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        metrics = {} if scores[step] is None else {"critic/score/mean": scores[step]}
        state = {"trainer": {"step": step, "policy_version": step}}
        out = ckpt.maybe_save(step, lambda: state, metrics, last=step == last_step,
                              weights=lambda: {n: t.detach().clone() for n, t in model.state_dict().items()})
        saved.append(bool(out))
    return ckpt, policies, saved


def kept(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())


def hf_best(tmp_path) -> dict:
    from safetensors.torch import load_file
    return load_file(tmp_path / "run" / "hf" / "best" / "model.safetensors")


def test_the_first_step_to_reach_the_highest_score_is_kept_and_exported_as_hf_best(tmp_path, tiny):
    # max: 0.2 (best), 0.5 (best), 0.4, 0.5 (ties: not better), 0.7 (best), 0.1.
    ckpt, policies, saved = run(tmp_path, tiny, {1: 0.2, 2: 0.5, 3: 0.4, 4: 0.5, 5: 0.7, 6: 0.1},
                                saveFreq=1, keepCheckpoints=1)
    assert ckpt.best == {"step": 5, "score": 0.7}
    assert all(saved)
    # keepCheckpoints 1: the latest, and the best whatever its age
    assert kept(tmp_path) == ["step-5", "step-6"]
    best = hf_best(tmp_path)
    assert best and all(torch.equal(best[n], policies[5][n]) for n in best)
    assert not torch.equal(best["model.norm.weight"], policies[6]["model.norm.weight"])


def test_min_mode_ranks_only_finite_scores_and_checkpoints_a_best_step_whatever_save_freq_says(tmp_path, tiny):
    # min: 0.3 (best), NaN and a step without the metric (not ranked), 0.1 (best), 0.2.
    # saveFreq -1: only the best steps and the last are saved.
    ckpt, policies, saved = run(tmp_path, tiny, {1: 0.3, 2: math.nan, 3: 0.1, 4: None, 5: 0.2},
                                saveBest={"metric": "critic/score/mean", "mode": "min"}, saveFreq=-1,
                                keepCheckpoints=1)
    assert ckpt.best == {"step": 3, "score": 0.1}
    assert saved == [True, False, True, False, True]
    assert kept(tmp_path) == ["step-3", "step-5"]
    best = hf_best(tmp_path)
    assert all(torch.equal(best[n], policies[3][n]) for n in best)


def test_a_resumed_run_remembers_the_best_and_keeps_protecting_its_checkpoint(tmp_path, tiny):
    run(tmp_path, tiny, {1: 0.2, 2: 0.9, 3: 0.4}, saveFreq=1, keepCheckpoints=1)
    assert kept(tmp_path) == ["step-2", "step-3"]
    # the resumed run (from step 3) sees lower scores than step 2's: no new best, step 2 stays
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    spec = TrainerSpec.model_validate({"saveBest": {"metric": "critic/score/mean"}, "saveFreq": 1,
                                       "keepCheckpoints": 1})
    ckpt = Checkpointer(spec, resume="auto", parts={"policy": (model, optimizer, scheduler)},
                        layout=RunLayout(f"file://{tmp_path}/run"), storage=Storage(), key=KEY,
                        device=torch.device("cpu"), model_spec=ModelSpec(path=str(tiny)))
    state = ckpt.resume()
    assert state.trainer.step == 3 and ckpt.best == {"step": 2, "score": pytest.approx(0.9)}
    ckpt.maybe_save(4, lambda: {"trainer": {"step": 4, "policy_version": 4}}, {"critic/score/mean": 0.8},
                    last=True, weights=lambda: model.state_dict())
    assert ckpt.best["step"] == 2 and kept(tmp_path) == ["step-2", "step-4"]
