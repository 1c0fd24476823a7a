"""Staleness: samples more than trainer.max_staleness versions behind are dropped, recorded in the plan and counted
in the trainer's metrics and status; with algorithm.staleness_mode = "keep" the same samples are trained on."""

from __future__ import annotations

import json
from pathlib import Path

from buffer import shards
from buffer.heartbeats import read_trainer
from buffer.layout import RunLayout
from buffer.plans import sample_ids_of, valid_plans
from buffer.weights import commit_version, staging_dir

from ._trainer_helpers import command, make_run, metrics, run_ok, trainer_args, write_groups

GROUP = 8


def _shard(layout: RunLayout, worker: str, version: int = 0, groups: int = 2) -> str:
    return write_groups(layout, worker, version, groups, group=GROUP)


def _ids(layout: RunLayout, worker: str) -> list[str]:
    return [
        s
        for sh in shards.list_ready(layout)
        if sh.worker_id == worker
        for s in shards.sample_ids(layout, sh.name)
    ]


def _publish_placeholder(layout: RunLayout, version: int) -> None:
    """A committed weight version (a placeholder file): the trainer counts its numbers from versions on disk."""
    staging = staging_dir(layout, version)
    (staging / "model.safetensors").write_bytes(b"\0" * 16)
    commit_version(layout, version, staging, step=0, dtype="float32")


def _run_at_version(tmp: Path, model: Path, mode: str) -> RunLayout:
    """A run whose trainer starts at weight version 3 (as if it had published 3 versions), with 16 samples of
    version 0 (3 behind, over the bound of 1) and 16 of version 3."""
    layout = make_run(
        tmp / mode,
        model,
        trainer__samples_per_step=2 * GROUP,
        trainer__max_staleness=1,
        rollout__max_staleness=1,
        algorithm__staleness_mode=mode,
    )
    _shard(layout, "old", version=0, groups=2)
    _shard(layout, "new", version=3, groups=2)
    _publish_placeholder(layout, 3)
    run_ok(command(1, *trainer_args(layout, "--max-steps", 1)), tmp / f"{mode}.log")
    return layout


def test_stale_samples_are_dropped_and_counted(tmp_path: Path, tiny_model_tied: Path) -> None:
    layout = _run_at_version(tmp_path, tiny_model_tied, "drop")
    plan = valid_plans(layout)[1]
    assert sorted(sample_ids_of(layout, plan, "drops")) == sorted(_ids(layout, "old"))
    assert sorted(sample_ids_of(layout, plan)) == sorted(_ids(layout, "new"))
    (rec,) = metrics(layout)
    assert rec["dropped_stale"] == 2 * GROUP and rec["samples"] == 2 * GROUP and rec["staleness_max"] == 0
    status = read_trainer(layout)
    assert (
        status is not None
        and status["dropped_stale"] == 2 * GROUP
        and status["consumed_samples"] == 4 * GROUP
    )
    assert json.loads(layout.latest_pointer.read_text())["version"] == 4  # numbering continued after v3


def test_keep_mode_trains_on_stale_samples_oldest_first(tmp_path: Path, tiny_model_tied: Path) -> None:
    layout = _run_at_version(tmp_path, tiny_model_tied, "keep")
    plan = valid_plans(layout)[1]
    assert sample_ids_of(layout, plan, "drops") == [] and sorted(sample_ids_of(layout, plan)) == sorted(
        _ids(layout, "old")
    )
    (rec,) = metrics(layout)
    assert rec["dropped_stale"] == 0 and rec["staleness_max"] == 3
    status = read_trainer(layout)
    assert status is not None and status["dropped_stale"] == 0 and status["unconsumed_samples"] == 2 * GROUP
