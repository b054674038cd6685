"""`grpo report RUN_DIR`: PNG plots and a text summary from a run's metrics.jsonl."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

# (file name, title, metric keys drawn on it: a `*` matches any part of a name, e.g. each reward
# model's rm/<name>/mean). A plot whose metrics the run didn't log is not drawn.
PLOTS = (
    ("reward.png", "Reward (mean score per step)", ["critic/score/mean"]),
    ("validation.png", "Validation score", ["val/score"]),
    ("kl.png", "KL loss", ["actor/kl_loss"]),
    ("entropy.png", "Entropy", ["actor/entropy"]),
    ("response_length.png", "Response length", ["response_length/mean", "response_length/max"]),
    ("throughput.png", "Throughput (tokens/s per trainer process)", ["perf/throughput"]),
    ("timing.png", "Seconds per phase", ["timing_s/rollout", "timing_s/ref", "timing_s/old_log_prob",
                                         "timing_s/adv", "timing_s/update_actor", "timing_s/weight_sync",
                                         "timing_s/checkpoint"]),
    # PPO (algorithm.advEstimator gae): the critic
    ("critic_loss.png", "Critic: value loss", ["critic/vf_loss"]),
    ("critic_fit.png", "Critic: explained variance and clipped fraction", ["critic/vf_explained_var",
                                                                          "critic/vf_clipfrac"]),
    ("critic_values.png", "Critic: values and returns (mean)", ["critic/values/mean", "critic/returns/mean"]),
    # rollout.multiTurn: the tools
    ("tools.png", "Tool calls and turns per sample", ["tool_calls/mean", "num_turns/mean"]),
    ("tool_errors.png", "Tool calls that failed per step", ["tool_calls/errors"]),
    # reward.rewardModels: each model's score, the rule's, and how often a judge's answer parsed
    ("reward_models.png", "Reward models and rule (mean score)", ["rm/*/mean", "rule_score/mean"]),
    ("reward_models_parsed.png", "Judges: share of outputs parsed", ["rm/*/parsed"]),
    ("reward_errors.png", "Reward function failures per step", ["reward/errors/*"]),
)


def plotted_keys(rows: list[dict], keys: list[str]) -> list[str]:
    """The metrics of `keys` the run logged, patterns expanded (sorted), in the plot's order."""
    logged = sorted({k for r in rows for k in r})
    out = []
    for key in keys:
        out += [k for k in logged if fnmatchcase(k, key) and k not in out]
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory with the jsonl logger on?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(rows: list[dict]) -> str:
    def series(key):
        return [(r["step"], r[key]) for r in rows if key in r]
    reward = series("critic/score/mean")
    val = series("val/score")
    lines = [f"steps: {rows[-1]['step']}"]
    if reward:
        k = max(1, len(reward) // 5)
        first = sum(v for _, v in reward[:k]) / k
        last = sum(v for _, v in reward[-k:]) / k
        lines.append(f"reward: {first:.3f} (first {k} steps) -> {last:.3f} (last {k} steps)")
    if val:
        lines.append(f"validation score: {val[0][1]:.3f} (step {val[0][0]}) -> {val[-1][1]:.3f} (step {val[-1][0]})")
    # PPO's critic, the tools, the reward models: where they started and ended
    for key in plotted_keys(rows, ["critic/vf_explained_var", "tool_calls/mean", "rm/*/mean", "rule_score/mean"]):
        (a, first), (b, last) = series(key)[0], series(key)[-1]
        lines.append(f"{key}: {first:.3f} (step {a}) -> {last:.3f} (step {b})")
    for key in plotted_keys(rows, ["tool_calls/errors", "reward/errors/*"]):
        if total := sum(v for _, v in series(key)):
            lines.append(f"{key}: {total:g} in all")
    step_s = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    if step_s:
        lines.append(f"seconds per step: {sum(step_s) / len(step_s):.2f} (mean), total {sum(step_s):.0f}")
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_metrics(run_dir)
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title, keys in PLOTS:
        present = plotted_keys(rows, keys)
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in present:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    (out_dir / "summary.txt").write_text(summary(rows))
    written.append(out_dir / "summary.txt")
    return written
