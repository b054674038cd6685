"""`grpo report RUN_DIR`: PNG plots and a text summary from a run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

# (file name, title, metric keys drawn on it)
PLOTS = (
    ("reward.png", "Reward (mean score per step)", ["critic/score/mean"]),
    ("validation.png", "Validation score", ["val/score"]),
    ("kl.png", "KL loss", ["actor/kl_loss"]),
    ("entropy.png", "Entropy", ["actor/entropy"]),
    ("response_length.png", "Response length", ["response_length/mean", "response_length/max"]),
    ("throughput.png", "Throughput (tokens/s per trainer process)", ["perf/throughput"]),
    ("timing.png", "Seconds per phase", ["timing_s/rollout", "timing_s/ref", "timing_s/old_log_prob",
                                         "timing_s/update_actor", "timing_s/weight_sync", "timing_s/checkpoint"]),
)


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
        present = [k for k in keys if any(k in r for r in rows)]
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
