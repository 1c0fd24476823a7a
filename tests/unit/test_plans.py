"""The consumption log: plans, replay after crashes, fencing of stale incarnations."""

from __future__ import annotations

import pytest

from buffer import plans
from buffer.records import EpochClaim, EpochProgress, read_record

from .buffer_helpers import make_layout


def _ids(n: int, start: int = 0) -> list[str]:
    return [f"s{i}" for i in range(start, start + n)]


def test_crash_between_plan_and_checkpoint_replays_the_same_samples(tmp_path):
    layout = make_layout(tmp_path)
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, ["a"], _ids(4))
    log.write_plan(2, ["a"], _ids(4, 4))  # checkpoint at step 1, then crash after planning step 2
    log2 = plans.PlanLog.claim(layout)  # the restarted trainer
    assert log2.epoch == log.epoch + 1
    replay = log2.replay(after_step=1)
    assert [p.step for p in replay] == [2] and replay[0].sample_ids == _ids(4, 4)
    with pytest.raises(FileExistsError):
        log2.write_plan(2, ["a"], _ids(4, 8))  # step 2 must be replayed, not re-planned
    log2.write_plan(3, ["a"], _ids(2, 8))
    consumed = plans.consumed_ids(log2.plans().values())
    assert consumed == set(_ids(10))


def test_crash_between_checkpoint_and_next_plan_loses_nothing(tmp_path):
    layout = make_layout(tmp_path)
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, ["a"], _ids(4))  # trained and checkpointed at 1; crash before planning 2
    log2 = plans.PlanLog.claim(layout)
    assert log2.replay(after_step=1) == []
    assert plans.consumed_ids(log2.plans().values()) == set(_ids(4))  # s4.. stay available


def test_fenced_incarnation_cannot_write_and_its_late_plans_are_ignored(tmp_path):
    layout = make_layout(tmp_path)
    old = plans.PlanLog.claim(layout)
    old.write_plan(1, ["a"], _ids(2))
    new = plans.PlanLog.claim(layout)
    with pytest.raises(plans.FencedError):
        old.write_plan(2, ["a"], _ids(2, 2))
    # even if the zombie raced past the check, a plan it writes after the claim is not valid
    from buffer.records import create_record

    zombie = plans.Plan(step=2, epoch=old.epoch, shards=["a"], sample_ids=_ids(2, 2))
    create_record(layout.plan(2, old.epoch), zombie)
    assert 2 not in new.plans()
    new.write_plan(2, ["a"], _ids(2, 4))
    assert new.plans()[2].sample_ids == _ids(2, 4)
    assert plans.consumed_ids(new.plans().values()) == set(_ids(2)) | set(_ids(2, 4))


def test_dropped_samples_count_as_consumed(tmp_path):
    layout = make_layout(tmp_path)
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, ["a"], ["s1"], dropped_ids=["s0"])
    assert plans.consumed_ids(log.plans().values()) == {"s0", "s1"}


def _hiding(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """This node's listing of plans/ misses ``step``'s plan, as an NFS lookup cache does for a minute."""
    listed = plans._plan_files
    monkeypatch.setattr(plans, "_plan_files", lambda layout: [f for f in listed(layout) if f.step != step])


def test_a_plan_this_node_cannot_list_yet_is_not_fenced_out_by_the_claim(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    old = plans.PlanLog.claim(layout)
    old.write_plan(1, ["a"], _ids(2))
    old.write_plan(2, ["a"], _ids(2, 2))  # trained (maybe checkpointed) before the crash
    _hiding(monkeypatch, 2)
    new = plans.PlanLog.claim(layout)
    assert 2 not in new.plans()
    monkeypatch.undo()  # the cache expires: the plan shows up, and it still counts
    assert new.plans()[2].sample_ids == _ids(2, 2)
    assert plans.consumed_ids(new.plans().values()) == set(_ids(4))


def test_the_claim_covers_the_checkpoint_it_resumes_from(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    old = plans.PlanLog.claim(layout)
    for step in (1, 2, 3):
        old.write_plan(step, ["a"], _ids(1, step))
    layout.epoch_progress(old.epoch).unlink()  # nothing announced (a run written before announcements)
    _hiding(monkeypatch, 3)
    new = plans.PlanLog.claim(layout, resumed_step=3)  # the checkpoint of step 3 holds plan 3's training
    monkeypatch.undo()
    assert sorted(new.plans()) == [1, 2, 3]
    _hiding(monkeypatch, 3)
    newer = plans.PlanLog.claim(layout)  # without the checkpoint step: plan 3 is unknown, so fenced out
    monkeypatch.undo()
    assert sorted(newer.plans()) == [1, 2]


def test_each_plan_is_announced_before_it_is_written(tmp_path):
    layout = make_layout(tmp_path)
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, ["a"], _ids(1))
    log.write_plan(2, ["a"], _ids(1, 1))
    progress = read_record(EpochProgress, layout.epoch_progress(log.epoch))
    assert (progress.epoch, progress.step) == (log.epoch, 2)
    new = plans.PlanLog.claim(layout)
    claim = read_record(EpochClaim, layout.epoch(new.epoch))
    assert claim.max_step == 2
