"""`shardrl status`: the snapshot of a synthetic run (finished record, pending command, paused workers, a stale
trainer) and the text the rich view draws from a built snapshot."""

from __future__ import annotations

import io
import json
import time

from rich.console import Console

from buffer import heartbeats, status
from buffer.control import ControlWatcher, init_state
from buffer.records import TrainerStatus, write_record
from shardrl.status_view import render

from .buffer_helpers import make_layout


def _synthetic_run(tmp_path):
    layout = make_layout(tmp_path)
    layout.config_json.write_text(
        json.dumps(
            {
                "run": {"lease_timeout_s": 10.0},
                "trainer": {"poll_interval_s": 0.5, "total_steps": 3},
                "rollout": {"max_backlog_samples": 64, "max_staleness": 1},
            }
        )
    )
    init_state(layout, 2)
    layout.control_file.write_text('{"action": "add",\n "count": 1}\n')  # no supervisor polled it yet
    heartbeats.worker_status(layout, "w0", slot=0).update(
        state="paused", paused_reason="backlog", backlog=96, weights_version=0
    )
    heartbeats.worker_status(layout, "w1", slot=1).update(
        state="paused", paused_reason="stale", weights_version=1, latest_version=3
    )
    heartbeats.worker_status(layout, "w2", slot=2).update(state="starting")
    heartbeats.supervisor_status(layout, "sup-a", capacity=4).update(
        state="running", slots=[0, 1], workers={}
    )
    old = time.time() - 120  # written two minutes ago: past the 10 s lease timeout
    write_record(
        layout.trainer_status,
        TrainerStatus(
            host="h", pid=1, beat=7, updated_at=old, state="waiting", step=2, waiting="8 of 32 samples"
        ),
    )
    return layout


def test_snapshot_explains_a_synthetic_run(tmp_path):
    layout = _synthetic_run(tmp_path)
    snap = status.snapshot(layout)
    assert snap["finished"] is None
    assert snap["control"]["pending"]["text"] == '{"action": "add", "count": 1}'
    tr = snap["trainer"]
    assert (tr["state"], tr["waiting"], tr["total_steps"], tr["stale_after_s"]) == (
        "waiting",
        "8 of 32 samples",
        3,
        10.0,
    )
    assert tr["heartbeat_stale"] and tr["heartbeat_age_s"] >= 120
    why = {w["id"]: w["paused_why"] for w in snap["workers"]}
    assert why["w0"] == "backlog: 96 unconsumed samples > rollout.max_backlog_samples 64"
    assert why["w1"].startswith("stale: serving v1 (latest v3); counting the versions still to be trained")
    assert why["w1"].endswith("more than rollout.max_staleness 1 behind")
    assert why["w2"] is None
    (sup,) = snap["supervisors"]
    assert (sup["capacity"], sup["slots"]) == (4, [0, 1]) and sup["heartbeat_age_s"] < 60
    assert snap["latest_weights_version"] == 0 and snap["problems"] == []

    assert status.mark_finished(layout, 3, 3, published_version=3, epoch=2)
    assert not status.mark_finished(
        layout, 4, 3, published_version=4, epoch=3
    )  # written once: the first stays
    snap = status.snapshot(layout)
    assert (snap["finished"]["step"], snap["finished"]["epoch"]) == (3, 2)


def test_snapshot_applied_command_is_not_pending_and_a_damaged_finished_record_is_a_problem(tmp_path):
    layout = _synthetic_run(tmp_path)
    ControlWatcher(layout, max_workers=8, settle_s=0.0, who="test").poll()
    snap = status.snapshot(layout)
    assert snap["control"]["pending"] is None and snap["desired_workers"] == 3
    layout.finished.write_text("{not json")
    snap = status.snapshot(layout)
    assert snap["finished"] is None
    assert any("finished.json" in p and "not valid JSON" in p for p in snap["problems"])


def _text(snap) -> str:
    con = Console(file=io.StringIO(), record=True, width=200, color_system=None)
    render(snap, con)
    return con.export_text()


def _built_snapshot(**changes):
    snap = {
        "run": "/runs/r1",
        "finished": None,
        "desired_workers": 2,
        "control": {
            "generation": 4,
            "last_applied": None,
            "last_rejection": None,
            "pending": {"text": '{"action": "set", "count": 5}', "age_s": 12.0},
        },
        "workers": [
            {
                "id": "w0",
                "state": "paused",
                "weights_version": 0,
                "latest_version": 0,
                "heartbeat_age_s": 1.0,
                "slot": 0,
                "host": "n1",
                "samples": 64,
                "tokens_per_s": None,
                "paused_reason": "backlog",
                "paused_why": "backlog: 96 unconsumed samples > rollout.max_backlog_samples 64",
                "last_error": None,
            },
            {
                "id": "w1",
                "state": "starting",
                "weights_version": None,
                "latest_version": None,
                "heartbeat_age_s": 0.5,
                "slot": 1,
                "host": "n1",
                "samples": 0,
                "tokens_per_s": None,
                "paused_reason": None,
                "paused_why": None,
                "last_error": None,
            },
        ],
        "supervisors": [
            {
                "id": "sup-a",
                "host": "n1",
                "state": "running",
                "slots": [0, 1],
                "capacity": 4,
                "workers": 2,
                "heartbeat_age_s": 2.5,
                "last_error": None,
            }
        ],
        "leases": {},
        "latest_weights_version": 0,
        "latest_weights_path": None,
        "trainer": {
            "step": 2,
            "total_steps": 3,
            "state": "waiting",
            "published_version": 0,
            "heartbeat_age_s": 95.0,
            "stale_after_s": 30.0,
            "heartbeat_stale": True,
            "waiting": "8 of 32 samples",
            "last_error": None,
        },
        "shards": {
            "ready": 1,
            "ready_samples": 64,
            "consumed_samples": 0,
            "dropped_samples": 0,
            "unconsumed_samples": 64,
            "quarantined": 0,
        },
        "plans": 0,
        "problems": [],
    }
    snap.update(changes)
    return snap


def test_view_explains_pending_command_waits_pauses_and_stale_trainer():
    text = _text(_built_snapshot())
    assert 'pending command: control.json holds {"action": "set", "count": 5}, written 12s ago' in text
    assert "latest weights base" in text and "vNone" not in text and "v0" not in text
    assert "trainer step 2 of 3 (waiting, status written 95.0s ago)" in text
    assert "warning: the trainer's status has not changed for 95s (more than 30s)" in text
    assert "trainer waits for: 8 of 32 samples" in text
    assert "backlog: 96 unconsumed samples > rollout.max_backlog_samples 64" in text
    rows = {line.split()[1]: line for line in text.splitlines() if line.strip().startswith("│ w")}
    assert rows["w0"].split("│")[3].strip() == "base" and rows["w1"].split("│")[3].strip() == "-"
    (sup,) = [line for line in text.splitlines() if "sup-a" in line]
    assert [c.strip() for c in sup.split("│")[4:7]] == ["2 / 4", "0,1", "2.5s"]
    assert "finished" not in text


def test_view_of_a_finished_run():
    tr = {
        **_built_snapshot()["trainer"],
        "state": "stopped",
        "step": 3,
        "heartbeat_stale": False,
        "waiting": None,
    }
    snap = _built_snapshot(
        finished={"step": 3, "total_steps": 3, "published_version": 3, "epoch": 2},
        trainer=tr,
        control={"generation": 4, "last_applied": None, "last_rejection": None, "pending": None},
    )
    text = _text(snap)
    assert "finished: trained step 3 of trainer.total_steps 3 (weights v3)" in text
    assert "warning" not in text and "pending" not in text and "waits for" not in text


def test_view_of_a_streaming_worker_shows_its_engine_and_the_samples_it_stopped_as_stale():
    snap = _built_snapshot()
    streaming = {"requests_in_flight": 48, "engine_busy": 0.97, "reloads_in_flight": 3}
    snap["workers"][0] |= streaming
    snap["workers"][1] |= streaming | {"aborted_stale_samples": 16}
    rows = {line.split()[1]: line for line in _text(snap).splitlines() if line.strip().startswith("│ w")}
    assert "48 in flight, busy 97%, 3 reloads" in rows["w0"] and "stale" not in rows["w0"]
    assert "3 reloads, 16 stopped as stale" in rows["w1"]
