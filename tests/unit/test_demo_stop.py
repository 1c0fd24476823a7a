"""`shardrl demo --until-accuracy`: the watch that stops the run reads the newest eval record only."""

from __future__ import annotations

from pathlib import Path

from buffer import metrics
from buffer.layout import RunLayout
from shardrl.demo import _reached


def test_the_run_stops_at_the_first_record_at_the_bar(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "run")
    layout.metrics.mkdir(parents=True)
    assert _reached(layout, 0.8) is None  # no record yet
    metrics.append(layout.metrics_file("eval"), {"version": 0, "step": 0, "accuracy": 0.13})
    assert _reached(layout, 0.8) is None
    assert _reached(layout, None) is None  # no bar: the run takes its steps
    metrics.append(layout.metrics_file("eval"), {"version": 10, "step": 10, "accuracy": 0.8})
    rec = _reached(layout, 0.8)
    assert rec is not None and rec["version"] == 10


def test_a_reward_without_full_score_is_judged_by_its_mean(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "run")
    layout.metrics.mkdir(parents=True)
    metrics.append(layout.metrics_file("eval"), {"version": 5, "step": 5, "reward_mean": 0.5})
    assert _reached(layout, 0.6) is None
    rec = _reached(layout, 0.5)
    assert rec is not None and rec["version"] == 5
