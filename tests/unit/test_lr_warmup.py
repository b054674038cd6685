"""The learning-rate warmup from trainer.lrWarmupStepsRatio (verl: optim.lr_warmup_steps_ratio):
int(ratio x the run's total steps) warmup steps when lrWarmupSteps is 0, as verl's FSDP engine does."""

import pytest
import torch

from grpo_api.jobfile import JobError, parse_job
from grpo_api.spec import CriticSpec, TrainerSpec
from grpo_trainer.model import build_optimizer, warmup_steps


def lrs(section, total_steps: int, steps: int) -> list[float]:
    """The learning rate of each of the first `steps` optimizer steps."""
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 1), section, total_steps)
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def test_the_ratio_of_the_total_steps_is_truncated_as_verl_does():
    # int(0.25 x 10) = 2; int(0.1 x 9) = int(0.9) = 0: no warmup at all; steps, when set, are used as given
    assert warmup_steps(TrainerSpec(lr_warmup_steps_ratio=0.25), 10) == 2
    assert warmup_steps(TrainerSpec(lr_warmup_steps_ratio=0.1), 9) == 0
    assert warmup_steps(TrainerSpec(lr_warmup_steps=3), 10) == 3
    assert warmup_steps(CriticSpec(lr_warmup_steps_ratio=0.5), 7) == 3


def test_constant_schedule_warms_up_over_the_ratios_steps():
    # 2 warmup steps: (0+1)/2, (1+1)/2 of lr, then lr
    assert lrs(TrainerSpec(lr=1.0, lr_warmup_steps_ratio=0.25), 10, 5) == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0])
    assert lrs(TrainerSpec(lr=1.0, lr_warmup_steps_ratio=0.1), 9, 2) == pytest.approx([1.0, 1.0])


def test_cosine_schedule_decays_over_the_steps_after_the_ratios_warmup():
    # 10 steps, ratio 0.2: 2 warmup steps, then 0.5 x (1 + cos(pi x k/8)) over the 8 left, k = step - 2
    got = lrs(TrainerSpec(lr=1.0, lr_warmup_steps_ratio=0.2, lr_scheduler="cosine"), 10, 7)
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.9619397662556434, 0.8535533905932737, 0.6913417161825449, 0.5])


def test_critic_ratio_and_steps_together_are_an_error_naming_the_field():
    doc = {"spec": {"model": {"path": "Qwen/Qwen3-8B"}, "data": {"trainFiles": ["t.parquet"], "trainBatchSize": 16},
                    "trainer": {"miniBatchSize": 8}, "algorithm": {"advEstimator": "gae"},
                    "critic": {"lrWarmupSteps": 4, "lrWarmupStepsRatio": 0.1}}}
    with pytest.raises(JobError) as info:
        parse_job(doc)
    assert any(e.startswith("spec.critic.lrWarmupStepsRatio:") and "not both" in e for e in info.value.errors)
