"""The consumption log: plans, replay after crashes, fencing of stale incarnations."""

from __future__ import annotations

import pytest

from buffer import plans
from buffer.layout import RunLayout
from buffer.records import EpochClaim, EpochProgress, read_record

from .buffer_helpers import make_layout, plan_sample_ids, publish_ids


def _ids(n: int, start: int = 0) -> list[str]:
    return [f"s{i}" for i in range(start, start + n)]


def _shard(layout: RunLayout) -> str:
    """One real shard whose row i holds sample ``s{i}`` (so ``_rows`` of sample ids are its rows)."""
    return publish_ids(layout, _ids(12))


def _rows(shard: str, ids: list[str]) -> list[tuple[str, int]]:
    """The (shard, row) pairs of ``ids`` in the shard made by ``_shard``."""
    return [(shard, int(i[1:])) for i in ids]


def _valid(layout: RunLayout) -> dict[int, plans.Plan]:
    return plans.valid_plans(layout)


def _consumed(layout: RunLayout) -> set[str]:
    """The sample ids the valid plans consumed (trained or dropped), read back from their shards; the consumption
    state a trainer loads (``plans.Consumption``) holds exactly those rows."""
    valid = _valid(layout).values()
    ids = [s for p in valid for w in ("takes", "drops") for s in plan_sample_ids(layout, p, w)]
    pairs = [r for p in valid for r in p.rows(p.takes) + p.rows(p.drops)]
    assert len(ids) == len(set(ids)) == len(set(pairs))
    consumption = plans.Consumption.load(layout)
    assert consumption.consumed_samples == len(ids)
    assert all(consumption.is_consumed(name, row) for name, row in pairs)
    assert sum(consumption.consumed_in(name) for name in {n for n, _ in pairs}) == len(pairs)
    return set(ids)


def _write(
    log: plans.PlanLog, shard: str, step: int, ids: list[str], dropped: list[str] | None = None
) -> None:
    log.write_plan(step, [shard], _rows(shard, ids), _rows(shard, dropped or []))


def test_crash_between_plan_and_checkpoint_replays_the_same_samples(tmp_path):
    layout = make_layout(tmp_path)
    a = _shard(layout)
    log = plans.PlanLog.claim(layout)
    _write(log, a, 1, _ids(4))
    _write(log, a, 2, _ids(4, 4))  # checkpoint at step 1, then crash after planning step 2
    log2 = plans.PlanLog.claim(layout)  # the restarted trainer
    assert log2.epoch == log.epoch + 1
    replay = log2.replay(after_step=1)
    assert [p.step for p in replay] == [2] and plan_sample_ids(layout, replay[0]) == _ids(4, 4)
    with pytest.raises(FileExistsError):
        _write(log2, a, 2, _ids(4, 8))  # step 2 must be replayed, not re-planned
    _write(log2, a, 3, _ids(2, 8))
    assert _consumed(layout) == set(_ids(10))


def test_crash_between_checkpoint_and_next_plan_loses_nothing(tmp_path):
    layout = make_layout(tmp_path)
    a = _shard(layout)
    log = plans.PlanLog.claim(layout)
    _write(log, a, 1, _ids(4))  # trained and checkpointed at 1; crash before planning 2
    log2 = plans.PlanLog.claim(layout)
    assert log2.replay(after_step=1) == []
    assert _consumed(layout) == set(_ids(4))  # s4.. stay available
    assert not plans.Consumption.load(layout).is_consumed(a, 4)


def test_fenced_incarnation_cannot_write_and_its_late_plans_are_ignored(tmp_path):
    layout = make_layout(tmp_path)
    a = _shard(layout)
    old = plans.PlanLog.claim(layout)
    _write(old, a, 1, _ids(2))
    new = plans.PlanLog.claim(layout)
    with pytest.raises(plans.FencedError):
        _write(old, a, 2, _ids(2, 2))
    # even if the zombie raced past the check, a plan it writes after the claim is not valid
    from buffer.records import create_record

    zombie = plans.Plan(step=2, epoch=old.epoch, shards=[a], takes=[[0, 2, 4]], samples=2)
    assert create_record(layout.plan(2, old.epoch), zombie)
    assert 2 not in _valid(layout)
    _write(new, a, 2, _ids(2, 4))
    assert plan_sample_ids(layout, _valid(layout)[2]) == _ids(2, 4)
    assert _consumed(layout) == set(_ids(2)) | set(_ids(2, 4))


def test_dropped_samples_count_as_consumed(tmp_path):
    layout = make_layout(tmp_path)
    a = _shard(layout)
    log = plans.PlanLog.claim(layout)
    _write(log, a, 1, ["s1"], dropped=["s0"])
    assert _consumed(layout) == {"s0", "s1"}
    assert plan_sample_ids(layout, _valid(layout)[1], "drops") == ["s0"]
    assert plans.Consumption.load(layout).dropped_samples == 1


def _hiding(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """This node's listings of plans/ miss ``step``'s plan, as an NFS lookup cache does for a minute."""
    listed = plans._files_in  # what every listing of a plan bucket goes through
    monkeypatch.setattr(plans, "_files_in", lambda d: [f for f in listed(d) if f.step != step])


def test_a_plan_this_node_cannot_list_yet_is_not_fenced_out_by_the_claim(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    a = _shard(layout)
    old = plans.PlanLog.claim(layout)
    _write(old, a, 1, _ids(2))
    _write(old, a, 2, _ids(2, 2))  # trained (maybe checkpointed) before the crash
    _hiding(monkeypatch, 2)
    plans.PlanLog.claim(layout)
    assert 2 not in _valid(layout)
    monkeypatch.undo()  # the cache expires: the plan shows up, and it still counts
    assert plan_sample_ids(layout, _valid(layout)[2]) == _ids(2, 2)
    assert _consumed(layout) == set(_ids(4))


def test_the_claim_covers_the_checkpoint_it_resumes_from(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    a = _shard(layout)
    old = plans.PlanLog.claim(layout)
    for step in (1, 2, 3):
        _write(old, a, step, _ids(1, step))
    layout.epoch_progress(old.epoch).unlink()  # nothing announced (a run written before announcements)
    _hiding(monkeypatch, 3)
    plans.PlanLog.claim(layout, resumed_step=3)  # the checkpoint of step 3 holds plan 3's training
    monkeypatch.undo()
    assert sorted(_valid(layout)) == [1, 2, 3]
    _hiding(monkeypatch, 3)
    plans.PlanLog.claim(layout)  # without the checkpoint step: plan 3 is unknown, so fenced out
    monkeypatch.undo()
    assert sorted(_valid(layout)) == [1, 2]


def test_each_plan_is_announced_before_it_is_written(tmp_path):
    layout = make_layout(tmp_path)
    a = _shard(layout)
    log = plans.PlanLog.claim(layout)
    _write(log, a, 1, _ids(1))
    _write(log, a, 2, _ids(1, 1))
    progress = read_record(EpochProgress, layout.epoch_progress(log.epoch))
    assert (progress.epoch, progress.step) == (log.epoch, 2)
    new = plans.PlanLog.claim(layout)
    claim = read_record(EpochClaim, layout.epoch(new.epoch))
    assert claim.max_step == 2
