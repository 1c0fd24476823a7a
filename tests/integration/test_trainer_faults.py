"""The trainer under bad storage states, as real trainer processes on the tiny model.

- a shard copied under a second valid name is quarantined, and no sample is planned twice;
- stale samples waiting in the backlog are dropped durably while the trainer waits (a plan of drops only), so the
  backlog that holds workers back falls, and none of them is trained later;
- a shard damaged or deleted after it was planned: the replay goes on with the rest and says what it lost;
- LATEST pointing at nothing (or at garbage) is not adopted: the trainer publishes after the versions on disk;
- a full disk while publishing or checkpointing (a FUSE file system that answers ENOSPC): no traceback, the error in
  the status record, the staging or incomplete checkpoint directory removed, and work resumes once space is back;
- with samples ready, each step after the first was planned during the previous step's compute.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from buffer import plans, shards
from buffer.heartbeats import read_trainer
from buffer.layout import RunLayout
from buffer.plans import sample_ids_of
from buffer.shards import ShardName
from buffer.status import backlog
from buffer.weights import commit_version, latest_version, staging_dir, verify_version, write_latest
from trainer.checkpoint import latest_complete_checkpoint
from trainer.data import Limits, Planner

from ._trainer_helpers import (
    command,
    kill_tree,
    make_run,
    metrics,
    run,
    run_ok,
    start,
    tail,
    trainer_args,
    wait_for,
    write_groups,
)
from .faultfs import FaultFS, fuse_unavailable, mounted

GROUP = 8
STEP = 2 * GROUP


def _shard(layout: RunLayout, worker: str, version: int = 0, groups: int = 2) -> str:
    return write_groups(layout, worker, version, groups, group=GROUP)


def _run(root: Path, model: Path, **overrides: Any) -> RunLayout:
    return make_run(root, model, **{"trainer__samples_per_step": STEP, **overrides})


def _planned(layout: RunLayout) -> list[str]:
    return [
        s
        for p in plans.valid_plans(layout).values()
        for s in sample_ids_of(layout, p) + sample_ids_of(layout, p, "drops")
    ]


def _status(layout: RunLayout) -> dict[str, Any]:
    return read_trainer(layout) or {}


def _ids(layout: RunLayout) -> list[str]:
    return [i for sh in shards.list_ready(layout) for i in shards.sample_ids(layout, sh.name)]


def _commit_placeholder(layout: RunLayout, version: int) -> None:
    """A committed weight version (a placeholder file): the trainer's weights count as this version."""
    staging = staging_dir(layout, version)
    (staging / "model.safetensors").write_bytes(b"\0" * 16)
    commit_version(layout, version, staging, step=0, dtype="float32")


def _no_traceback(log: Path) -> None:
    assert "Traceback" not in log.read_text(), tail(log)


def test_a_duplicated_shard_is_quarantined_and_nothing_is_trained_twice(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    layout = _run(tmp_path / "run", tiny_model_tied)
    names = [_shard(layout, f"w{i}") for i in range(3)]
    s = ShardName.parse(names[1])
    assert s is not None
    copy = ShardName(s.bucket, s.worker_id, s.incarnation, s.seq + 7, s.rows, s.crc).name
    shutil.copyfile(
        layout.ready_shard(names[1]), layout.ready_shard(copy)
    )  # the same samples, a second valid name
    run_ok(command(1, *trainer_args(layout, "--max-steps", 3)), tmp_path / "t.log")
    ids = _planned(layout)
    assert len(ids) == len(set(ids)) == 3 * STEP
    assert shards.quarantined(layout) == [copy]
    reason = json.loads(layout.quarantine_reason(copy).read_text())["reason"]
    assert "duplicate" in reason and names[1] in reason
    assert [r["samples"] for r in metrics(layout)] == [STEP] * 3
    assert _status(layout)["quarantined"] == 1


def test_stale_samples_are_dropped_while_waiting_and_the_backlog_falls(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    bound = STEP  # rollout.max_backlog_samples: a worker pauses while the backlog is above it
    layout = _run(
        tmp_path / "run",
        tiny_model_tied,
        trainer__max_staleness=1,
        rollout__max_staleness=1,
        rollout__max_backlog_samples=bound,
        algorithm__staleness_mode="drop",
    )
    _commit_placeholder(layout, 3)  # the trainer's weights are v3: samples of v0 are 3 versions behind
    for i in range(3):
        _shard(layout, f"old{i}", version=0)
    stale = set(_ids(layout))
    assert backlog(layout).unconsumed_samples == 3 * STEP > bound  # workers would pause here
    log = tmp_path / "t.log"
    proc = start(command(1, *trainer_args(layout, "--max-steps", 1)), log)
    try:
        wait_for(
            f"the stale samples dropped\n{tail(log)}",
            lambda: backlog(layout).dropped_samples == 3 * STEP,
            120,
        )
        assert backlog(layout).unconsumed_samples == 0 <= bound  # workers resume
        wait_for(
            "the wait in the status", lambda: "of 16 samples" in (_status(layout).get("waiting") or ""), 60
        )
        assert "48 stale dropped" in _status(layout)["waiting"]
        fresh = _shard(layout, "new", version=3)
        assert proc.wait(timeout=120) == 0, tail(log)
    finally:
        kill_tree(proc)
    valid = plans.valid_plans(layout)
    assert sample_ids_of(layout, valid[1]) == [] and set(sample_ids_of(layout, valid[1], "drops")) == stale
    assert set(sample_ids_of(layout, valid[2])) == set(shards.sample_ids(layout, fresh)) and not stale & set(
        sample_ids_of(layout, valid[2])
    )
    recs = metrics(layout)
    assert [(r["step"], r["samples"], r["dropped_stale"]) for r in recs] == [(1, 0, 3 * STEP), (2, STEP, 0)]
    assert (
        latest_version(layout) == 4
    )  # one version for the one trained step; the drop-only step publishes none


def test_replay_goes_on_after_a_planned_shard_is_damaged_or_deleted(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    layout = _run(tmp_path / "run", tiny_model_tied, trainer__samples_per_step=3 * STEP)
    names = [_shard(layout, f"w{i}") for i in range(3)]
    # An incarnation that planned step 1 and died before training it.
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert planner.try_plan(1, 3 * STEP, 0, 1000, True) is not None
    # the samples of the two shards, as a plan names them (shard and row): their ids are in the shards only
    lost = {f"{n}#{r}" for n in names[:2] for r in range(len(shards.sample_ids(layout, n)))}
    layout.ready_shard(names[0]).unlink()
    data = bytearray(layout.ready_shard(names[1]).read_bytes())
    data[100] ^= 0xFF
    layout.ready_shard(names[1]).write_bytes(bytes(data))
    log = tmp_path / "t.log"
    run_ok(command(1, *trainer_args(layout, "--max-steps", 1)), log)
    _no_traceback(log)
    (rec,) = metrics(layout)
    assert rec["replayed"] == 1 and rec["samples"] == STEP and rec["replay_missing"] == 2 * STEP
    assert set(rec["replay_missing_ids"]) == lost
    assert names[1] in shards.quarantined(layout)
    assert latest_complete_checkpoint(layout) == 1


def test_latest_pointing_at_nothing_is_not_adopted_and_steps_are_planned_ahead(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    layout = _run(tmp_path / "run", tiny_model_tied)
    for i in range(4):
        _shard(layout, f"w{i}")
    layout.latest_pointer.write_text("{not json")
    run_ok(command(1, *trainer_args(layout, "--max-steps", 3)), tmp_path / "a.log")
    assert latest_version(layout) == 3 and verify_version(layout, 3).step == 3
    recs = metrics(layout)
    # Samples were ready: every step after the first was planned while the one before it computed, and every
    # version but the last was written while the next step computed.
    assert [r["prefetched"] for r in recs] == [0, 1, 1]
    assert all("publish_write_s" in r for r in recs[1:])
    phases = ("wait", "plan", "load", "compute", "publish", "checkpoint")
    assert all(abs(sum(r[f"{p}_frac"] for p in phases) - 1) < 1e-6 for r in recs)
    assert "LATEST" in (_status(layout)["last_error"] or "")

    write_latest(layout, 99, step=0)  # names a version that does not exist
    run_ok(command(1, *trainer_args(layout, "--max-steps", 1)), tmp_path / "b.log")
    assert latest_version(layout) == 4  # not 100
    assert "v000099" in _status(layout)["last_error"]


# ------------------------------------------------------------------------------------------------- a full disk

needs_fuse = pytest.mark.skipif(fuse_unavailable() is not None, reason=f"FUSE: {fuse_unavailable()}")


@pytest.fixture
def ffs(tmp_path: Path) -> Iterator[FaultFS]:
    with mounted(tmp_path / "faultfs") as fs:
        yield fs


@needs_fuse
def test_enospc_while_publishing_is_reported_cleaned_and_retried(
    ffs: FaultFS, tmp_path: Path, tiny_model_tied: Path
) -> None:
    layout = _run(ffs.mount / "run", tiny_model_tied)
    for i in range(2):
        _shard(layout, f"w{i}")
    ffs.set({"op": "write", "errno": "ENOSPC", "path": "run/weights/.staging-*"})
    log = tmp_path / "t.log"
    proc = start(command(1, *trainer_args(layout, "--max-steps", 2)), log)
    try:

        def reported_and_clean() -> bool:
            st = _status(layout)
            staging = [p for p in layout.weights.iterdir() if p.name.startswith(".staging")]
            return (
                "publish of v1 failed" in (st.get("waiting") or "")
                and "No space left on device" in (st.get("last_error") or "")
                and not staging
            )

        wait_for(f"the failed publish in the status\n{tail(log)}", reported_and_clean, 180)
        assert latest_version(layout) == 0
        ffs.clear()  # space is back
        assert proc.wait(timeout=180) == 0, tail(log)
    finally:
        kill_tree(proc)
    _no_traceback(log)
    assert latest_version(layout) == 2 and verify_version(layout, 2).step == 2
    assert verify_version(layout, 1).step == 2  # v1, published again after the retry, holds the newer weights


@needs_fuse
def test_enospc_while_checkpointing_keeps_training_and_saves_once_space_is_back(
    ffs: FaultFS, tmp_path: Path, tiny_model_tied: Path
) -> None:
    layout = _run(ffs.mount / "run", tiny_model_tied, trainer__save_every=1)
    for i in range(2):
        _shard(layout, f"w{i}")
    ffs.set({"op": "write", "errno": "ENOSPC", "path": "run/checkpoints/*"})
    log = tmp_path / "t.log"
    proc = start(command(1, *trainer_args(layout, "--max-steps", 3)), log)
    try:
        wait_for(f"two steps trained\n{tail(log)}", lambda: len(metrics(layout)) == 2, 180)
        wait_for(
            "the failed checkpoint of step 2 reported",
            lambda: "checkpoint of step 2 failed" in (_status(layout).get("last_error") or ""),
            60,
        )
        wait_for("the wait for step 3", lambda: _status(layout).get("state") == "waiting", 60)
        status = _status(layout)
        assert "No space left" in status["last_error"] and status["waiting"] is not None
        assert latest_complete_checkpoint(layout) is None
        assert not [
            p for p in layout.checkpoints.iterdir() if p.name.startswith("step-")
        ]  # no partial save left
        ffs.clear()
        _shard(layout, "w2")
        assert proc.wait(timeout=180) == 0, tail(log)
    finally:
        kill_tree(proc)
    _no_traceback(log)
    assert latest_complete_checkpoint(layout) == 3 and latest_version(layout) == 3


def test_a_step_whose_data_fails_the_trainer_is_replayed_without_it(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    """Out of memory in step 2: the trainer exits 5 after marking the step poisoned; the restart replays step 2's
    plan without its samples (they stay consumed: never trained) instead of failing on them again, then goes on."""
    layout = _run(tmp_path / "run", tiny_model_tied, trainer__save_every="1")
    for i in range(4):
        _shard(layout, f"w{i}")
    log = tmp_path / "t.log"
    wrapper = Path(__file__).parent / "_oom_trainer.py"
    rc = run([sys.executable, str(wrapper), "--run-dir", str(layout.root), "--max-steps", "3"], log)
    assert rc == 5, tail(log)
    assert "step 2: out of memory" in log.read_text() and "marked poisoned" in log.read_text()
    poisoned = plans.read_poisoned(layout, 2)
    assert poisoned is not None and "out of memory" in poisoned.reason
    step2 = plans.valid_plans(layout)[2]
    run_ok(command(1, *trainer_args(layout, "--max-steps", 2)), tmp_path / "again.log")
    recs = {r["step"]: r for r in metrics(layout)}
    assert recs[2]["replayed"] == 1 and recs[2]["samples"] == 0 and recs[2]["replay_missing"] == step2.samples
    assert recs[3]["samples"] == STEP  # and the run goes on with fresh samples
    planned_again = [p for s, p in plans.valid_plans(layout).items() if s > 2]
    assert not {r for p in planned_again for r in p.rows(p.takes)} & set(step2.rows(step2.takes))
