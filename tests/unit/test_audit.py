"""``shardrl audit``: the ledger of a run from its files, and the two things it exists to catch, a row trained twice
and samples a worker published that are in no shard."""

from __future__ import annotations

import shutil
from pathlib import Path

from buffer import heartbeats, plans
from buffer.audit import audit
from buffer.shards import ShardName, ShardWriter
from trainer.data import Limits, Planner

from .buffer_helpers import make_layout, sample


def _publish(layout, worker: str, groups: int) -> tuple[ShardWriter, list[str]]:  # type: ignore[no-untyped-def]
    w = ShardWriter(layout, "run", worker)
    names = []
    for g in range(groups):
        for i in range(4):
            w.add(sample(i, group=f"{worker}-{g}"))
        path = w.flush()
        assert path is not None
        names.append(path.name)
    return w, names


def test_the_ledger_adds_up_and_catches_a_copy_trained_twice_and_a_loss(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    w0, names = _publish(layout, "w0", 3)
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert planner.try_plan(1, 8, current_version=0, max_staleness=4, drop_stale=True) is not None
    led = audit(layout)
    key = f"w0.{w0.incarnation}"
    assert led.ok and led.steps == 1
    assert led.totals() == {
        "generated": 12, "consumed": 8, "dropped_stale": 0, "quarantined": 0, "waiting": 4, "consumed_gone": 0,
        "lost": 0,
    }  # fmt: skip
    assert set(led.writers) == {key}

    # The worker's record says it published 16 samples: 4 are in no shard.
    heartbeats.worker_status(layout, "w0", slot=0, incarnation=w0.incarnation).update(
        state="running", published_samples=16
    )
    led = audit(layout)
    assert not led.ok and led.lost == 4 and led.writers[key].published == 16

    # A plan that consumes a copy of a consumed shard (what the planner refuses, written by hand here): the same
    # writer's shard under two names is reported as trained twice.
    heartbeats.worker_status(layout, "w0", slot=0, incarnation=w0.incarnation).update(published_samples=12)
    s = ShardName.parse(names[0])
    assert s is not None
    copy = ShardName(s.bucket + 1, s.worker_id, s.incarnation, s.seq, s.rows, s.crc).name
    layout.ready_bucket(s.bucket + 1).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(layout.ready_shard(names[0]), layout.ready_shard(copy))
    log = plans.PlanLog.claim(layout)
    log.write_plan(2, [copy], [(copy, r) for r in range(4)])
    led = audit(layout)
    assert not led.ok and any("under 2 names" in d for d in led.duplicates), led.duplicates


def test_shardrl_audit_exits_1_on_a_loss(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from shardrl.cli import main

    layout = make_layout(tmp_path)
    w0, _ = _publish(layout, "w0", 1)
    assert main(["audit", str(layout.root)]) == 0
    assert "generated 4, consumed 0" in capsys.readouterr().out
    heartbeats.worker_status(layout, "w0", slot=0, incarnation=w0.incarnation).update(published_samples=8)
    assert main(["audit", str(layout.root), "--json"]) == 1
    assert '"lost": 4' in capsys.readouterr().out


def test_a_shard_consumed_whole_is_remembered_by_its_seq_and_caught_when_consumed_again(
    tmp_path: Path,
) -> None:
    """A wholly consumed shard is kept as its writer's seq alone (the audit's memory does not grow with the run), and
    rows of it consumed again, under its own name, are still a duplicate that is not counted twice."""
    from buffer.audit import _Consumed

    layout = make_layout(tmp_path)
    w0, names = _publish(layout, "w0", 3)
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, names[:2], [(n, r) for n in names[:2] for r in range(4)])
    log.write_plan(2, [names[0]], [(names[0], r) for r in range(2)])
    led = audit(layout)
    key = f"w0.{w0.incarnation}"
    assert not led.ok and len(led.duplicates) == 1 and "consumed whole" in led.duplicates[0], led.duplicates
    assert led.writers[key].consumed == 8 and led.writers[key].waiting == 4

    done = _Consumed()
    for n in names:
        for r in range(4):
            assert done.take(n, r, r + 1) is None
    assert done.partial == {} and dict(done.whole) == {key: [[0, 3]]}  # three shards: one interval, no names
