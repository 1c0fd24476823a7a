"""`shardrl report RUN`: PNG plots of a run's metrics, written into RUN/plots.

Reads only files of the run directory: metrics/trainer.jsonl, metrics/eval.jsonl, metrics/rollout-*.jsonl and the
plans (staleness of consumed samples).  A plot is drawn only when it has data; a run with none gets no PNG at all.
Needs matplotlib (the `plots` or `dev` extra).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer import metrics, plans
from buffer.layout import RunLayout
from buffer.records import RecordError

INSTALL_HINT = "matplotlib is not installed; install the plots extra: pip install 'shardrl[plots]'"


class PlotsUnavailable(RuntimeError):
    """matplotlib is missing (the message says how to install it)."""


@dataclass
class RunMetrics:
    """What the plots draw, read once from the run directory."""

    trainer: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    staleness: list[int]
    rollout: dict[str, list[dict[str, Any]]]  # worker id -> its records
    problems: list[str] = field(default_factory=list)  # plan files left out

    @classmethod
    def read(cls, layout: RunLayout) -> RunMetrics:
        problems: list[str] = []
        stale = [
            s for p in plans.valid_plans(layout, problems).values() for s in p.extra.get("staleness", [])
        ]
        files = sorted(layout.metrics.glob("rollout-*.jsonl")) if layout.metrics.is_dir() else []
        rollout = {f.stem.removeprefix("rollout-"): metrics.read_all(f) for f in files}
        return cls(
            trainer=metrics.one_per_step(metrics.read_all(layout.metrics_file("trainer"))),
            evals=metrics.read_all(layout.metrics_file("eval")),
            staleness=[int(s) for s in stale],
            rollout={w: recs for w, recs in rollout.items() if recs},
            problems=problems,
        )

    @property
    def empty(self) -> bool:
        return not (self.trainer or self.evals or self.staleness or self.rollout)


def staleness_bins(stale: list[int]) -> list[float]:
    """Histogram edges with one bin per integer staleness 0..max, centred on it."""
    return [k - 0.5 for k in range(max(stale, default=0) + 2)]


def _trainer_plot(plt: Any, layout: RunLayout, data: RunMetrics) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if data.trainer:
        ax.plot(
            [m["step"] for m in data.trainer],
            [m.get("reward_mean", 0) for m in data.trainer],
            label="mean reward (samples)",
        )
    if data.evals:
        ax.plot(
            [e["step"] for e in data.evals],
            [e.get("accuracy", e.get("reward_mean", 0)) for e in data.evals],
            "o-",
            label=eval_label(data.evals),
        )
    ax.set(
        xlabel="trainer step",
        ylabel="reward / accuracy (0-1)",
        title="Reward and greedy accuracy vs step",
        ylim=(0, 1.05),
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, layout, "reward_accuracy.png")


def eval_label(evals: list[dict[str, Any]]) -> str:
    """The legend of the eval curve: accuracy or reward mean, over the prompt count the evaluator recorded."""
    what = (
        "greedy accuracy"
        if any("accuracy" in e and e["accuracy"] is not None for e in evals)
        else "greedy reward"
    )
    counts = sorted({e["prompts"] for e in evals if isinstance(e.get("prompts"), int)})
    if not counts:
        return what
    shown = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{what} ({shown} prompts)"


def _staleness_plot(plt: Any, layout: RunLayout, data: RunMetrics) -> Path:
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(data.staleness, bins=staleness_bins(data.staleness), rwidth=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        xlabel="staleness (trainer version - sample's policy version)",
        ylabel="consumed samples",
        title="Policy staleness of consumed samples",
    )
    return _save(plt, fig, layout, "staleness_hist.png")


def _rollout_plot(plt: Any, layout: RunLayout, data: RunMetrics) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t0 = min(recs[0]["time"] for recs in data.rollout.values())
    for worker, recs in data.rollout.items():
        ax.plot([r["time"] - t0 for r in recs], [r.get("tokens_per_s", 0) for r in recs], label=worker)
    ax.set(
        xlabel="time since first batch (s)",
        ylabel="generated tokens/s",
        title="Rollout throughput per worker",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(plt, fig, layout, "rollout_tokens_per_s.png")


def _trainer_timing_plot(plt: Any, layout: RunLayout, data: RunMetrics) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [m["step"] for m in data.trainer]
    a1.plot(steps, [100 * m.get("wait_frac", 0) for m in data.trainer])
    a1.set(
        xlabel="trainer step",
        ylabel="waiting for samples (% of step)",
        title="Trainer wait fraction",
        ylim=(0, 100),
    )
    pub = [(m["step"], m["publish_s"]) for m in data.trainer if "publish_s" in m]
    a2.plot([s for s, _ in pub], [1000 * v for _, v in pub], ".")
    a2.set(xlabel="trainer step", ylabel="publish time (ms)", title="Weight publish time")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    return _save(plt, fig, layout, "trainer_wait_publish.png")


STEP_PHASES = ("wait", "plan", "load", "compute", "publish", "checkpoint")


def time_split(records: list[dict[str, Any]]) -> tuple[list[int], dict[str, list[float]]]:
    """Steps whose record splits the step's wall time (``compute_s`` and the other ``<phase>_s``), and the seconds of
    each phase per such step (0 where a record lacks one)."""
    split = [m for m in records if "compute_s" in m]
    return [m["step"] for m in split], {p: [float(m.get(f"{p}_s", 0.0)) for m in split] for p in STEP_PHASES}


def _step_time_plot(plt: Any, layout: RunLayout, data: RunMetrics) -> Path:
    from matplotlib.ticker import MaxNLocator

    steps, seconds = time_split(data.trainer)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(steps)
    width = 0.8 if len(steps) < 200 else 1.0
    for phase in STEP_PHASES:
        ax.bar(steps, seconds[phase], bottom=bottom, width=width, label=phase, linewidth=0)
        bottom = [b + v for b, v in zip(bottom, seconds[phase], strict=True)]
    ax.set(xlabel="trainer step", ylabel="seconds", title="Where each step's wall time went")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(ncols=len(STEP_PHASES), fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15))
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, layout, "trainer_step_time.png")


def _save(plt: Any, fig: Any, layout: RunLayout, name: str) -> Path:
    layout.plots.mkdir(parents=True, exist_ok=True)
    path = layout.plots / name
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(layout: RunLayout, data: RunMetrics | None = None) -> list[Path]:
    """The plots that have data, as PNG files in RUN/plots; [] when the run has nothing to plot yet.

    Raises PlotsUnavailable without matplotlib (only when there is something to plot).
    """
    data = data if data is not None else RunMetrics.read(layout)
    if data.empty:
        return []
    plt = _pyplot()
    out = []
    if data.trainer or data.evals:
        out.append(_trainer_plot(plt, layout, data))
    if data.staleness:
        out.append(_staleness_plot(plt, layout, data))
    if data.rollout:
        out.append(_rollout_plot(plt, layout, data))
    if data.trainer:
        out.append(_trainer_timing_plot(plt, layout, data))
    if time_split(data.trainer)[0]:
        out.append(_step_time_plot(plt, layout, data))
    return out


def main(layout: RunLayout) -> int:
    """`shardrl report RUN`: print the PNGs written, or why there are none.  Exit 1 when plots cannot be drawn."""
    try:
        data = RunMetrics.read(layout)
        paths = write_report(layout, data)
    except (PlotsUnavailable, RecordError) as e:
        print(f"shardrl report: {e}", file=sys.stderr)
        return 1
    for problem in data.problems:
        print(f"shardrl report: left out: {problem}", file=sys.stderr)
    if data.evals:  # the evaluator's latest score (rollout_worker --eval)
        ev = data.evals[-1]
        score = ", ".join(f"{k} {ev[k]:.3f}" for k in ("accuracy", "reward_mean") if ev.get(k) is not None)
        print(f"eval: weights v{ev.get('version')} (step {ev.get('step')}): {score}")
    if not paths:
        print(f"{layout.root}: no metrics or consumed samples yet, nothing to plot")
    for p in paths:
        print(p)
    return 0
