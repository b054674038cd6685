"""`grpo report` (grpo_operator.report) on metrics.jsonl files written here: a PPO run with tools and
two reward models gets its critic's, tools' and reward models' plots and summary lines; a plain
GRPO run gets none of them. On a real run: tests/integration/test_local_run.py."""

from __future__ import annotations

import json

import matplotlib.image

from grpo_operator.report import plotted_keys, read_metrics, write_report

BASE = ("reward.png", "kl.png", "summary.txt")
PPO_TOOLS_RM = ("critic_loss.png", "critic_fit.png", "critic_values.png", "tools.png", "tool_errors.png",
                "reward_models.png", "reward_models_parsed.png", "reward_errors.png")


def write_metrics(folder, rows) -> None:
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_ppo_tools_and_reward_models_get_their_plots_and_summary(tmp_path):
    rows = [{"step": s, "critic/score/mean": 0.1 * s, "actor/kl_loss": 0.01,
             "critic/vf_loss": 1.0 / s, "critic/vf_explained_var": -0.5 + 0.25 * s, "critic/vf_clipfrac": 0.1,
             "critic/values/mean": 0.2, "critic/returns/mean": 0.3,
             "num_turns/mean": 3.0, "tool_calls/mean": 1.0 + s, "tool_calls/errors": s - 1,
             "rm/judge/mean": 0.5, "rm/judge/parsed": 0.9, "rm/rm2/mean": 0.1 * s, "rule_score/mean": 0.4,
             "reward/errors/exception": 0, "reward/errors/timeout": 0}
            for s in (1, 2, 3)]
    write_metrics(tmp_path, rows)
    written = {p.name for p in write_report(tmp_path)}
    assert written == {"reward.png", "kl.png", "summary.txt", *PPO_TOOLS_RM}
    for name in PPO_TOOLS_RM:
        pixels = matplotlib.image.imread(tmp_path / "report" / name)
        assert pixels.shape[:2] == (350, 600) and pixels.std() > 0, name
    # every reward model on the one plot, the rule beside them
    assert plotted_keys(read_metrics(tmp_path), ["rm/*/mean", "rule_score/mean"]) == \
        ["rm/judge/mean", "rm/rm2/mean", "rule_score/mean"]
    summary = (tmp_path / "report" / "summary.txt").read_text().splitlines()
    assert "critic/vf_explained_var: -0.250 (step 1) -> 0.250 (step 3)" in summary
    assert "tool_calls/mean: 2.000 (step 1) -> 4.000 (step 3)" in summary
    assert "rm/rm2/mean: 0.100 (step 1) -> 0.300 (step 3)" in summary
    assert "tool_calls/errors: 3 in all" in summary
    assert not any(line.startswith("reward/errors/") for line in summary)     # none failed: not said


def test_a_grpo_run_without_them_gets_none_of_those_plots(tmp_path):
    write_metrics(tmp_path, [{"step": s, "critic/score/mean": 0.1 * s, "actor/kl_loss": 0.01} for s in (1, 2)])
    assert {p.name for p in write_report(tmp_path)} == set(BASE)
    assert (tmp_path / "report" / "summary.txt").read_text().splitlines()[1:] == \
        ["reward: 0.100 (first 1 steps) -> 0.200 (last 1 steps)"]
