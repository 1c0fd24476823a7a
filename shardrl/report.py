"""`shardrl report RUN`: PNG plots of a run's metrics, written into RUN/plots.

Reads only files of the run directory: metrics/trainer.jsonl, metrics/eval.jsonl, metrics/rollout-*.jsonl and the
plans (staleness of consumed samples).  Needs matplotlib (the `plots` or `dev` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from buffer import plans
from buffer.layout import RunLayout


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being appended right now
    return out


def last_record(path: Path, tail_bytes: int = 65536) -> dict[str, Any]:
    """The last complete record of a JSONL file, reading only its tail (the live view polls it twice a second)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return {}
    for line in reversed(lines):
        try:
            return dict(json.loads(line))
        except ValueError:
            continue  # a line being appended, or cut by the seek
    return {}


def _trainer_plot(plt: Any, layout: RunLayout, trainer: list[dict], evals: list[dict]) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if trainer:
        ax.plot(
            [m["step"] for m in trainer],
            [m.get("reward_mean", 0) for m in trainer],
            label="mean reward (samples)",
        )
    if evals:
        ax.plot(
            [e["step"] for e in evals],
            [e["accuracy"] for e in evals],
            "o-",
            label="greedy accuracy (100 prompts)",
        )
    ax.set(
        xlabel="trainer step",
        ylabel="reward / accuracy (0-1)",
        title="Reward and greedy accuracy vs step",
        ylim=(0, 1.05),
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, layout, "reward_accuracy.png")


def _staleness_plot(plt: Any, layout: RunLayout) -> Path:
    stale: list[int] = []
    for p in plans.valid_plans(layout).values():
        stale.extend(p.extra.get("staleness", []))
    fig, ax = plt.subplots(figsize=(6, 4))
    if stale:
        ax.hist(stale, bins=range(0, max(stale) + 2), align="left", rwidth=0.8)
    ax.set(
        xlabel="staleness (trainer version - sample's policy version)",
        ylabel="consumed samples",
        title="Policy staleness of consumed samples",
    )
    return _save(fig, layout, "staleness_hist.png")


def _rollout_plot(plt: Any, layout: RunLayout) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    files = sorted(layout.metrics.glob("rollout-*.jsonl")) if layout.metrics.is_dir() else []
    per_worker = {f.stem.removeprefix("rollout-"): read_jsonl(f) for f in files}
    t0 = min((recs[0]["time"] for recs in per_worker.values() if recs), default=0.0)
    for worker, recs in per_worker.items():
        ax.plot([r["time"] - t0 for r in recs], [r.get("tokens_per_s", 0) for r in recs], label=worker)
    ax.set(
        xlabel="time since first batch (s)",
        ylabel="generated tokens/s",
        title="Rollout throughput per worker",
    )
    if files:
        ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, layout, "rollout_tokens_per_s.png")


def _trainer_timing_plot(plt: Any, layout: RunLayout, trainer: list[dict]) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [m["step"] for m in trainer]
    a1.plot(steps, [100 * m.get("wait_frac", 0) for m in trainer])
    a1.set(
        xlabel="trainer step",
        ylabel="waiting for samples (% of step)",
        title="Trainer wait fraction",
        ylim=(0, 100),
    )
    pub = [(m["step"], m["publish_s"]) for m in trainer if "publish_s" in m]
    a2.plot([s for s, _ in pub], [1000 * v for _, v in pub], ".")
    a2.set(xlabel="trainer step", ylabel="publish time (ms)", title="Weight publish time")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    return _save(fig, layout, "trainer_wait_publish.png")


def _save(fig: Any, layout: RunLayout, name: str) -> Path:
    layout.plots.mkdir(parents=True, exist_ok=True)
    path = layout.plots / name
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_report(layout: RunLayout) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trainer = read_jsonl(layout.metrics_file("trainer"))
    evals = read_jsonl(layout.metrics_file("eval"))
    return [
        _trainer_plot(plt, layout, trainer, evals),
        _staleness_plot(plt, layout),
        _rollout_plot(plt, layout),
        _trainer_timing_plot(plt, layout, trainer),
    ]
