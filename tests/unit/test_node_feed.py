"""The fleet view at O(nodes): the trainer's feed reads one record per node supervisor and only the workers no live
supervisor lists; a worker judges by the trainer's per-node sums and its own supervisor's record."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from buffer import heartbeats
from buffer.layout import RunLayout
from rollout_worker.admission import Admission
from trainer.feed import FeedKeeper

from .buffer_helpers import make_layout


def _node(layout: RunLayout, sup: str, workers: dict[str, tuple[int, int]], state: str = "running") -> None:
    """A supervisor record listing ``workers``: id -> (in_flight, published_samples)."""
    heartbeats.supervisor_status(layout, sup, capacity=len(workers)).update(
        state=state,
        slots=list(range(len(workers))),
        workers={
            str(i): {
                "worker_id": w,
                "pid": 1000 + i,
                "state": "running",
                "restarts": 0,
                "device": "cpu",
                "incarnation": f"inc-{w}",
                "in_flight": f,
                "published_samples": p,
            }
            for i, (w, (f, p)) in enumerate(workers.items())
        },
    )


def _worker(layout: RunLayout, w: str, in_flight: int, published: int) -> None:
    heartbeats.worker_status(layout, w, slot=0, incarnation=f"inc-{w}").update(
        state="running", in_flight=in_flight, published_samples=published
    )


def _age(path: Path, seconds: float) -> None:
    rec = json.loads(path.read_text())
    rec["updated_at"] -= seconds
    path.write_text(json.dumps(rec))


def _fleet(layout: RunLayout) -> tuple[dict[str, Any], dict[str, Any]]:
    keeper: Any = SimpleNamespace(run=SimpleNamespace(layout=layout), max_age_s=60.0)
    return FeedKeeper.fleet(keeper)


def test_the_feed_reads_nodes_and_only_the_workers_no_live_supervisor_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = make_layout(tmp_path)
    _node(layout, "nodeA", {"a0": (16, 40), "a1": (8, 24)})
    _node(layout, "nodeB", {"b0": (32, 0)})
    _node(layout, "gone", {"g0": (4, 4)})  # its record stopped being written: its worker is read on its own
    _age(layout.supervisor_status("gone"), 600.0)
    for w in ("a0", "a1", "b0"):  # records the feed must not open: the supervisors' copies are what count
        _worker(layout, w, 999, 999)
    _worker(layout, "g0", 4, 4)
    _worker(layout, "hand", 2, 10)  # started by hand, under no supervisor

    opened: list[str] = []
    real = heartbeats.read_record

    def counting(kind: Any, path: Path, **kw: Any) -> Any:
        opened.append(path.name)
        return real(kind, path, **kw)

    monkeypatch.setattr(heartbeats, "read_record", counting)
    nodes, fleet = _fleet(layout)

    assert nodes == {
        "nodeA": {"in_flight": 24, "published_samples": 64, "workers": 2},
        "nodeB": {"in_flight": 32, "published_samples": 0, "workers": 1},
    }
    assert sorted(fleet) == ["g0", "hand"] and fleet["hand"]["in_flight"] == 2
    assert sorted(opened) == ["g0.json", "gone.json", "hand.json", "nodeA.json", "nodeB.json"]


def test_a_supervisor_copies_only_its_current_processes_records(tmp_path: Path) -> None:
    """What the supervisor relays for a slot: the record of the process it runs now, never one left by the process
    before a restart (that batch died with it)."""
    from rollout_worker.supervisor import Supervisor

    layout = make_layout(tmp_path)
    heartbeats.worker_status(layout, "w0", slot=0, incarnation="now").update(
        state="running", in_flight=16, published_samples=48
    )
    me: Any = SimpleNamespace(layout=layout)
    current = SimpleNamespace(worker_id="w0", proc=SimpleNamespace(pid=os.getpid()))
    before = SimpleNamespace(worker_id="w0", proc=SimpleNamespace(pid=os.getpid() + 1))
    assert Supervisor._feed_of(me, current) == {
        "incarnation": "now",
        "in_flight": 16,
        "published_samples": 48,
    }
    assert Supervisor._feed_of(me, before) == {}
    assert Supervisor._feed_of(me, SimpleNamespace(worker_id="w0", proc=None)) == {}


def _trainer(layout: RunLayout, **fields: Any) -> None:
    heartbeats.trainer_status(layout).update(state="training", feed_at=time.time(), **fields)


def test_a_worker_counts_other_nodes_as_seen_and_its_own_node_as_it_is_now(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    _trainer(
        layout,
        unconsumed_samples=100,
        nodes={
            "nodeA": {"in_flight": 16, "published_samples": 40, "workers": 2},
            "nodeB": {"in_flight": 32, "published_samples": 0, "workers": 1},
        },
        fleet={"hand": {"incarnation": "h", "in_flight": 8, "published_samples": 0}},
    )
    # our node now: our own copy is old (20 published), our mate has published 4 more and runs a batch of 8
    _node(layout, "nodeA", {"a0": (8, 20), "a1": (8, 24)})
    adm = Admission(layout, "a0", "inc-a0", max_age_s=60.0, fallback_every_s=1.0, supervisor="nodeA")

    v = adm.view(published=30, pending=4)
    others = 8 + 32 + 8  # the hand-started worker and node B as the trainer saw them, our mate as it is now
    since = 30 + 24 - 40  # what our node published past the trainer's copy of its sum
    assert v.live and v.coming == 100 + since + 4 + others
    assert v.backlog == 100 + since + 4

    layout.supervisor_status(
        "nodeA"
    ).unlink()  # our supervisor's record unreadable: the node as the trainer saw it
    v = adm.view(published=30, pending=4)
    assert v.coming == 100 + 4 + 8 + 32 + 16


def test_a_worker_under_no_supervisor_keeps_its_own_fleet_entry(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    _trainer(
        layout,
        unconsumed_samples=50,
        nodes={"nodeB": {"in_flight": 32, "published_samples": 0, "workers": 1}},
        fleet={"hand": {"incarnation": "h1", "in_flight": 8, "published_samples": 10}},
    )
    v = Admission(layout, "hand", "h1", max_age_s=60.0, fallback_every_s=1.0).view(published=16, pending=0)
    assert v.coming == 50 + (16 - 10) + 32
