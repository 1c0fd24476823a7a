"""Planning under bad storage states (trainer/data.py): a shard copied under a second valid name is quarantined,
never planned twice; stale samples are dropped by a plan of drops only while the trainer waits, and the backlog
stops counting them; a replay goes on without the samples of a shard that vanished or was damaged after planning;
a shard holding a sample the run cannot train (too long for it, out of its vocabulary) is quarantined, naming why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from buffer import plans, shards
from buffer.layout import RunLayout
from buffer.shards import ShardName, ShardWriter
from buffer.status import backlog
from trainer.data import Limits, Planner

from .buffer_helpers import make_layout, plan_sample_ids, sample


def _publish(layout: RunLayout, groups: list[str], version: int = 0, worker: str = "w0") -> str:
    w = ShardWriter(layout, "run", worker)
    for g in groups:
        for i in range(4):
            w.add(sample(i, group=g, version=version) | {"sample_id": f"{g}.{i}"})
    path = w.flush()
    assert path is not None
    return path.name


def _copy_under_new_name(layout: RunLayout, name: str, seq_offset: int = 100) -> str:
    """The same bytes under another valid shard name (another sequence number): a duplicated shard."""
    s = ShardName.parse(name)
    assert s is not None
    copy = ShardName(s.bucket, s.worker_id, s.incarnation, s.seq + seq_offset, s.rows, s.crc).name
    shutil.copyfile(layout.ready_shard(name), layout.ready_shard(copy))
    return copy


def _all_planned(layout: RunLayout) -> list[str]:
    valid = plans.valid_plans(layout).values()
    return [s for p in valid for which in ("takes", "drops") for s in plan_sample_ids(layout, p, which)]


def _reason(layout: RunLayout, name: str) -> str:
    return str(json.loads(layout.quarantine_reason(name).read_text())["reason"])


def test_a_duplicated_shard_is_quarantined_and_the_step_proceeds(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    original = _publish(layout, ["a", "b"])
    copy = _copy_under_new_name(layout, original)
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    got = planner.try_plan(1, 8, current_version=0, max_staleness=4, drop_stale=True)
    assert got is not None
    plan, rows = got
    assert sorted(plan_sample_ids(layout, plan)) == sorted(f"{g}.{i}" for g in "ab" for i in range(4))
    assert len(rows) == 8 and plan.shards == [original]
    assert not layout.ready_shard(copy).exists() and layout.quarantined_shard(copy).exists()
    assert "duplicate" in _reason(layout, copy) and original in _reason(layout, copy)
    assert planner.try_plan(2, 4, 0, 4, True) is None  # the copy's samples are not there to plan again


def test_a_copy_of_a_consumed_shard_is_quarantined_but_the_original_is_not_after_a_restart(
    tmp_path: Path,
) -> None:
    layout = make_layout(tmp_path)
    original = _publish(layout, ["a"])
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert planner.try_plan(1, 4, 0, 4, True) is not None
    copy = _copy_under_new_name(layout, original)
    assert planner.try_plan(2, 4, 0, 4, True) is None
    # the consumed original is still in the open window: the copy's sample ids are found there
    assert layout.quarantined_shard(copy).exists() and not layout.ready_shard(copy).exists()
    assert "duplicate" in _reason(layout, copy) and original in _reason(layout, copy)
    # A restarted trainer sees the consumed original again: it is the shard its plan names, not a duplicate.
    again = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert again.try_plan(2, 4, 0, 4, True) is None
    assert layout.ready_shard(original).exists() and shards.quarantined(layout) == [copy]
    # A copy that appears after the restart, while the original's bucket is open, is caught the same way.
    late_copy = _copy_under_new_name(layout, original, seq_offset=200)
    assert again.try_plan(2, 4, 0, 4, True) is None
    assert layout.ready_shard(original).exists() and shards.quarantined(layout) == sorted([copy, late_copy])
    assert original in _reason(layout, late_copy)
    assert sorted(_all_planned(layout)) == [f"a.{i}" for i in range(4)]


def test_stale_samples_are_dropped_while_waiting_and_leave_the_backlog(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    _publish(layout, ["old0", "old1"], version=0)
    _publish(layout, ["new"], version=5, worker="w1")
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert backlog(layout).unconsumed_samples == 12
    # 4 fresh samples cannot fill a step of 8: without drop_only nothing is written, and the wait says why.
    assert planner.try_plan(1, 8, 5, 2, True) is None
    assert (planner.waiting.fresh, planner.waiting.stale) == (4, 8)
    got = planner.try_plan(1, 8, 5, 2, True, drop_only=True)
    assert got is not None
    plan, rows = got
    assert rows == [] and plan.takes == [] and plan.samples == 0 and plan.dropped == 8
    assert sorted(plan_sample_ids(layout, plan, "drops")) == sorted(
        f"old{g}.{i}" for g in (0, 1) for i in range(4)
    )
    assert backlog(layout).unconsumed_samples == 4 and backlog(layout).dropped_samples == 8
    # Dropped for good: the next step trains the fresh group only, never an old sample.
    _publish(layout, ["new2"], version=5, worker="w2")
    got = planner.try_plan(2, 8, 5, 2, True, drop_only=True)
    assert got is not None and {r.group_id for r in got[1]} == {"new", "new2"}
    ids = _all_planned(layout)
    assert len(ids) == len(set(ids)) == 16
    # Only fresh samples and too few: a drop-only step is never written for nothing.
    assert planner.try_plan(3, 8, 5, 2, True, drop_only=True) is None


def test_replay_goes_on_without_a_shard_damaged_or_gone_after_planning(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    first = _publish(layout, ["a"])
    second = _publish(layout, ["b"], worker="w1")
    third = _publish(layout, ["c"], worker="w2")
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    got = planner.try_plan(1, 12, 0, 4, True)
    assert got is not None and sorted(got[0].shards) == sorted([first, second, third])
    layout.ready_shard(first).unlink()  # gone
    data = bytearray(layout.ready_shard(second).read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged: its checksum no longer matches its name
    layout.ready_shard(second).write_bytes(bytes(data))
    again = Planner(layout, plans.PlanLog.claim(layout), Limits())
    replayed = again.replay(plans.valid_plans(layout)[1])
    assert [r.sample_id for r in replayed.samples] == [f"c.{i}" for i in range(4)]
    # the samples a.* and b.* (rows 0..3 of the first and second shard) are the ones missing
    assert sorted(replayed.missing) == sorted(f"{n}#{i}" for n in (first, second) for i in range(4))
    assert len(replayed.problems) == 2 and layout.quarantined_shard(second).exists()


@pytest.mark.parametrize(
    ("limits", "bad", "reason"),
    [
        (
            Limits(max_response=3),
            {"response_ids": [5] * 4, "response_logprobs": [-0.5] * 4},
            "response of 4 tokens is longer than rollout.sampling.max_response_length 3",
        ),
        (
            Limits(context=8),
            {"prompt_ids": list(range(1, 7))},
            "prompt of 6 + response of 3 tokens is longer than the model's context 8",
        ),
        (Limits(vocab_size=50), {"response_ids": [5, 6, 50]}, "response_ids out of range [0, 50) (min"),
    ],
    ids=["response-too-long", "prompt-past-the-context", "token-out-of-vocabulary"],
)
def test_a_shard_with_a_sample_the_run_cannot_train_is_quarantined_and_never_planned(
    tmp_path: Path, limits: Limits, bad: dict, reason: str
) -> None:
    layout = make_layout(tmp_path)
    good = _publish(layout, ["ok"])
    w = ShardWriter(layout, "run", "w1")
    for i in range(4):  # one bad sample poisons the whole shard: its group must not be trained in part
        w.add(sample(i, group="bad") | {"sample_id": f"bad.{i}"} | (bad if i == 2 else {}))
    path = w.flush()
    assert path is not None
    poisoned = path.name
    planner = Planner(layout, plans.PlanLog.claim(layout), limits)
    got = planner.try_plan(1, 4, 0, 4, True)
    assert got is not None and got[0].shards == [good]
    assert planner.try_plan(2, 4, 0, 4, True) is None
    assert not layout.ready_shard(poisoned).exists() and shards.quarantined(layout) == [poisoned]
    assert reason in _reason(layout, poisoned)
    assert planner.cache.quarantined == 1
    assert all(poisoned not in p.shards for p in plans.valid_plans(layout).values())
    assert sorted(_all_planned(layout)) == [f"ok.{i}" for i in range(4)]


def test_a_copy_listed_before_a_consumed_original_is_not_planned_after_a_restart(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    original = _publish(layout, ["a"])
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert planner.try_plan(1, 4, 0, 4, True) is not None
    s = ShardName.parse(original)
    assert s is not None
    copy = ShardName(s.bucket, "a0", s.incarnation, s.seq, s.rows, s.crc).name  # lists before the original
    shutil.copyfile(layout.ready_shard(original), layout.ready_shard(copy))
    again = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert again.try_plan(2, 4, 0, 4, True) is None
    assert layout.ready_shard(original).exists() and shards.quarantined(layout) == [copy]


def test_a_copy_of_a_consumed_shard_is_caught_at_any_age_in_any_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of a shard whose bucket is sealed, consumed and forgotten (a backup restored, an rsync into a later
    bucket) is quarantined as a duplicate, by a running trainer and by a restarted one reading a summary: the
    consumption log keeps, per writer incarnation, the seqs it consumed from (a few numbers, not the shards)."""
    now = [1_000_000.0]
    monkeypatch.setattr(shards.time, "time", lambda: now[0])  # a hand clock for every reader of time.time
    layout = make_layout(tmp_path)
    w = ShardWriter(layout, "run", "w0")
    for i in range(4):
        w.add(sample(i, group="a"))  # the writer's own sample ids: w0.<incarnation>.<seq>.<row>
    path = w.flush()
    assert path is not None
    original = path.name
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert planner.try_plan(1, 4, 0, 4, True) is not None
    now[0] += 7200  # two hours: the original's bucket is sealed and consumed, the window forgets it
    assert planner.try_plan(2, 4, 0, 4, True) is None
    assert original not in planner.cache.owner.values() and original not in planner.cache.done

    def copy_into_now() -> str:
        s = ShardName.parse(original)
        assert s is not None
        copy = ShardName(shards.bucket_at(now[0]), s.worker_id, s.incarnation, s.seq, s.rows, s.crc).name
        layout.ready_bucket(shards.bucket_at(now[0])).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(layout.ready_shard(original), layout.ready_shard(copy))
        return copy

    copy = copy_into_now()
    assert planner.try_plan(2, 4, 0, 4, True) is None
    assert layout.quarantined_shard(copy).exists() and "consumed already" in _reason(layout, copy)
    planner.log.write_summary(planner.consumption)
    now[0] += 120
    again = Planner(layout, plans.PlanLog.claim(layout), Limits())  # restarted: the summary, no window
    second = copy_into_now()
    assert again.try_plan(2, 4, 0, 4, True) is None
    assert layout.quarantined_shard(second).exists() and "consumed already" in _reason(layout, second)
    assert len(_all_planned(layout)) == 4  # the four samples, trained once
