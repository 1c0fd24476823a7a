"""The worker's staleness admission counts the versions not yet in LATEST: the one a training step is about to
publish, and one whose files are still being written in the background.

With ``max_staleness = 0`` (the synchronous mode) a worker must not start a batch while the trainer computes a step
that will publish a newer version: the trainer would drop every sample of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from buffer import heartbeats
from buffer.layout import RunLayout
from rollout_worker.following import WeightFollower


def _follower(layout: RunLayout, max_staleness: int, publish_every: int = 1) -> WeightFollower:
    f = WeightFollower(
        layout,
        load=lambda path, version: None,  # admission never loads weights
        name="w0",
        poll_s=1.0,
        max_staleness=max_staleness,
        report=lambda **_: None,
        on_error=lambda _: None,
        publish_every=publish_every,
    )
    f.version = f.latest = 3
    return f


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    return layout


def _trainer(layout: RunLayout, **fields: Any) -> None:
    heartbeats.trainer_status(layout).update(**fields)


def test_sync_worker_waits_while_a_step_computes(layout: RunLayout) -> None:
    f = _follower(layout, max_staleness=0)
    assert not f.too_stale()  # no trainer yet
    _trainer(layout, state="waiting", step=3)
    assert not f.too_stale()  # the trainer waits for exactly this batch
    _trainer(layout, state="training", step=3)
    assert f.too_stale()  # the step in flight publishes v4: a batch on v3 would be dropped


def test_staleness_one_may_generate_during_a_step(layout: RunLayout) -> None:
    f = _follower(layout, max_staleness=1)
    _trainer(layout, state="training", step=3)
    assert not f.too_stale()
    f.version = 2
    assert f.too_stale()


def test_a_step_that_may_not_publish_is_not_counted(layout: RunLayout) -> None:
    f = _follower(layout, max_staleness=0, publish_every=4)
    _trainer(layout, state="training", step=3)
    assert not f.too_stale()


def test_a_version_being_written_counts_until_latest_names_it(layout: RunLayout) -> None:
    """Publishing is asynchronous: after step 4 the trainer may wait for samples while v4's files are written.
    A synchronous worker must not start on v3 then, nor (one step later) while step 5 computes on top of it."""
    f = _follower(layout, max_staleness=0)
    _trainer(layout, state="waiting", step=4, published_version=4, publishing=4)
    assert f.too_stale()
    _trainer(layout, state="training", step=4, published_version=4, publishing=4)
    f1 = _follower(layout, max_staleness=1)
    assert f1.too_stale()  # v3 samples would be consumed at step 6, with v5: two behind
    f.latest = 4  # the commit landed; the record may still name it for a while
    _trainer(layout, state="waiting", step=4, published_version=4, publishing=4)
    assert f.too_stale()  # ...but the worker still serves v3
    f.version = 4
    assert not f.too_stale()


def test_a_step_that_may_not_publish_still_counts_a_version_being_written(layout: RunLayout) -> None:
    f = _follower(layout, max_staleness=0, publish_every=4)
    _trainer(layout, state="training", step=5, published_version=4, publishing=4)
    assert f.too_stale()


def test_a_whole_step_waiting_counts_before_the_trainer_notices_it(layout: RunLayout) -> None:
    """The trainer has not yet picked up the step's samples (still `waiting`, or not started at all): the step they
    make will publish v4 before a batch started now is consumed."""
    f = _follower(layout, max_staleness=0)
    assert f.too_stale(waiting_steps=1)  # no trainer record yet
    _trainer(layout, state="waiting", step=3)
    assert not f.too_stale() and f.too_stale(waiting_steps=1)
    assert not _follower(layout, max_staleness=1).too_stale(waiting_steps=1)
    assert not _follower(layout, max_staleness=0, publish_every=2).too_stale(waiting_steps=1)


def test_steps_planned_ahead_and_steps_queued_add_up(layout: RunLayout) -> None:
    """While step 4 computes, the trainer has planned step 5 from the backlog (prefetch): those samples left the
    backlog, yet their step publishes before a batch started now is used; and a whole step still queued behind
    them publishes one more."""
    _trainer(layout, state="training", step=3)
    f1 = _follower(layout, max_staleness=1)
    assert not f1.too_stale(planned_step=4)  # only the step that computes: consumed one version behind
    assert f1.too_stale(planned_step=5)  # and the one planned meanwhile: two behind
    assert f1.too_stale(waiting_steps=1, planned_step=4)  # or a whole step queued before ours
    f2 = _follower(layout, max_staleness=2)
    assert not f2.too_stale(waiting_steps=1, planned_step=4)
    assert f2.too_stale(waiting_steps=1, planned_step=5)
    # a trainer that has just finished step 3 with step 4 already planned starts it at once
    _trainer(layout, state="waiting", step=3)
    assert _follower(layout, max_staleness=0).too_stale(planned_step=4)
    assert not _follower(layout, max_staleness=0).too_stale(planned_step=3)
    # a restarted trainer replaying old plans: at most two planned steps count
    assert not _follower(layout, max_staleness=2).too_stale(planned_step=40)
    # every other step publishes: four steps ahead make two versions
    assert _follower(layout, max_staleness=1, publish_every=2).too_stale(waiting_steps=2, planned_step=5)
    assert not _follower(layout, max_staleness=2, publish_every=2).too_stale(waiting_steps=2, planned_step=5)


def test_an_unreadable_trainer_record_counts_as_no_step_in_flight(layout: RunLayout) -> None:
    f = _follower(layout, max_staleness=0)
    layout.trainer_status.parent.mkdir(parents=True, exist_ok=True)
    layout.trainer_status.write_text("{garbage")
    assert not f.too_stale()


def test_a_latest_that_cannot_be_loaded_does_not_pause_the_worker(layout: RunLayout) -> None:
    """LATEST names v9, which is missing: waiting for it would deadlock with a trainer waiting for samples."""
    f = _follower(layout, max_staleness=1)
    f.latest = 9
    assert f.too_stale()  # not yet known to be bad: poll will try to load it
    f.bad[9] = "weights/v000009/manifest.json: missing"
    assert not f.too_stale()
