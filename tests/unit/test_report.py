"""`shardrl report`: plots only what has data, says so on an empty run, says how to get matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from buffer import metrics, plans
from shardrl import report

from .buffer_helpers import make_layout


def test_an_empty_run_has_nothing_to_plot_and_gets_no_png(tmp_path: Path, capsys) -> None:
    layout = make_layout(tmp_path)
    assert report.main(layout) == 0
    assert "nothing to plot" in capsys.readouterr().out
    assert not layout.plots.exists()


def test_without_matplotlib_it_says_how_to_install_it(tmp_path: Path, capsys, monkeypatch) -> None:
    layout = make_layout(tmp_path)
    metrics.append(layout.metrics_file("trainer"), {"step": 1, "reward_mean": 0.2})
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report.main(layout) == 1
    err = capsys.readouterr().err
    assert "pip install 'shardrl[plots]'" in err and len(err.strip().splitlines()) == 1
    assert not layout.plots.exists()


def test_only_plots_with_data_are_drawn(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    layout = make_layout(tmp_path)
    for s in (1, 2):
        metrics.append(layout.metrics_file("trainer"), {"step": s, "reward_mean": 0.1 * s, "wait_frac": 0.5})
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, ["a"], [("a", 0), ("a", 1), ("a", 2)], extra={"staleness": [0, 2, 2]})
    assert report.main(layout) == 0
    written = sorted(p.name for p in layout.plots.iterdir())
    assert written == ["reward_accuracy.png", "staleness_hist.png", "trainer_wait_publish.png"]  # no rollout
    assert capsys.readouterr().out.count(".png") == 3


def test_staleness_histogram_has_one_bin_per_integer() -> None:
    stale = [0, 0, 2, 3, 3, 3]
    bins = report.staleness_bins(stale)
    assert bins == [-0.5, 0.5, 1.5, 2.5, 3.5]
    counts, _ = np.histogram(stale, bins=bins)
    assert counts.tolist() == [2, 0, 1, 3]
    assert report.staleness_bins([]) == [-0.5, 0.5]


def test_the_step_time_split_is_drawn_from_records_that_have_it(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    metrics.append(
        layout.metrics_file("trainer"), {"step": 1, "reward_mean": 0.1}
    )  # an older trainer's record
    for s in (2, 3):
        metrics.append(
            layout.metrics_file("trainer"),
            {"step": s, "wait_s": 0.5, "load_s": 0.1, "compute_s": 2.0, "publish_s": 0.25 * s},
        )
    steps, seconds = report.time_split(metrics.read_all(layout.metrics_file("trainer")))
    assert steps == [2, 3]
    assert (
        seconds["compute"] == [2.0, 2.0]
        and seconds["publish"] == [0.5, 0.75]
        and seconds["plan"] == [0.0, 0.0]
    )
    pytest.importorskip("matplotlib")
    written = {p.name for p in report.write_report(layout)}
    assert "trainer_step_time.png" in written
