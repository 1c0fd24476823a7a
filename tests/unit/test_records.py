"""Typed records of the run directory: round trips, one-line errors naming file and field, validated status writes,
listings that report bad records, the backlog count, the retry and claim helpers."""

from __future__ import annotations

import errno
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from buffer import fsio, heartbeats, plans, records, shards
from buffer.records import RecordError, read_record, write_record
from buffer.status import Backlog, BacklogCounter, backlog, snapshot

from .buffer_helpers import make_layout, sample

NOW = 1.7e9
STATUS = {"host": "node1", "pid": 42, "beat": 3, "updated_at": NOW}

EXAMPLES: list[records.Record] = [
    records.WorkerStatus(
        **STATUS, id="w0", slot=0, state="paused", paused_reason="backlog", backlog=70, published_samples=64
    ),
    records.SupervisorStatus(
        **STATUS,
        id="node1-42-abc",
        capacity=2,
        state="running",
        slots=[0, 1],
        workers={
            "0": records.SupervisedWorker(worker_id="w0", pid=7, state="running", restarts=1, device="cpu")
        },
        failed_slots={"3": "EngineError: died"},
    ),
    records.TrainerStatus(
        **STATUS,
        state="waiting",
        epoch=2,
        resumed_from=4,
        step=4,
        consumed_samples=64,
        planned_step=5,
        open_from=28333333,
        window_consumed=12,
        fleet={"w0": records.FleetEntry(incarnation="abc", in_flight=8, published_samples=64)},
        feed_at=NOW,
    ),
    records.LatestPointer(version=3, path="v000003", step=30),
    records.WeightsManifest(
        version=3,
        step=30,
        dtype="bfloat16",
        created_at=NOW,
        files={"model.safetensors": records.ManifestFile(size=10, sha256="ab" * 32)},
    ),
    records.ControlGeneration(
        generation=4,
        desired=2,
        last_applied={"command": {"action": "add", "count": 1}},
        last_rejection=None,
        history=["k"],
    ),
    records.Lease(
        slot=1, generation=3, holder="node1-42-abc", counter=9, host="node1", pid=42, written_at=NOW
    ),
    records.Plan(
        step=2,
        epoch=1,
        shards=["a.arrow"],
        takes=[[0, 1, 2]],
        drops=[[0, 0, 1]],
        samples=1,
        dropped=1,
        extra={"x": 1},
    ),
    records.EpochClaim(epoch=2, max_step=7, host="node1", pid=42, at=NOW),
    records.LogSummary(
        step=50,
        epoch=1,
        open_from=28333333,
        consumed_samples=100,
        dropped_samples=4,
        trained_steps=50,
        consumed={"a.arrow": [[0, 4]]},
        at=NOW,
    ),
    records.PoisonedStep(step=3, epoch=1, reason="loss is nan", at=NOW),
]
# per record type: a field to remove, and a value of the wrong type for it
BREAK = {
    records.WorkerStatus: ("slot", "0"),
    records.SupervisorStatus: ("capacity", 2.5),
    records.TrainerStatus: ("step", None),
    records.LatestPointer: ("version", "3"),
    records.WeightsManifest: ("files", ["model.safetensors"]),
    records.ControlGeneration: ("history", "k"),
    records.Lease: ("holder", 7),
    records.Plan: ("takes", "s1"),
    records.EpochClaim: ("max_step", True),
    records.LogSummary: ("consumed", ["a.arrow"]),
    records.PoisonedStep: ("reason", 7),
}


def _name(rec: records.Record) -> str:
    return type(rec).__name__


@pytest.mark.parametrize("rec", EXAMPLES, ids=_name)
def test_every_record_round_trips(tmp_path: Path, rec: records.Record) -> None:
    path = tmp_path / "rec.json"
    write_record(path, rec)
    assert read_record(type(rec), path) == rec
    assert json.loads(path.read_text())["schema_version"] == type(rec).expected_version()
    assert set(BREAK) == {type(r) for r in EXAMPLES}


def _broken(tmp_path: Path, rec: records.Record, change: Any) -> Path:
    data = rec.to_json()
    change(data)
    path = tmp_path / "status" / "rec.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _one_line_error(kind: type[records.Record], path: Path, field: str) -> str:
    with pytest.raises(RecordError) as e:
        read_record(kind, path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: field {field}: ") and "\n" not in msg, msg
    assert e.value.field == field
    return msg


@pytest.mark.parametrize("rec", EXAMPLES, ids=_name)
def test_a_missing_field_is_one_line_naming_file_and_field(tmp_path: Path, rec: records.Record) -> None:
    field, _ = BREAK[type(rec)]
    path = _broken(tmp_path, rec, lambda d: d.pop(field))
    assert _one_line_error(type(rec), path, field).endswith("missing from this " + _name(rec) + " record")


@pytest.mark.parametrize("rec", EXAMPLES, ids=_name)
def test_a_wrong_type_is_one_line_naming_file_and_field(tmp_path: Path, rec: records.Record) -> None:
    field, wrong = BREAK[type(rec)]
    path = _broken(tmp_path, rec, lambda d: d.update({field: wrong}))
    assert repr(wrong) in _one_line_error(type(rec), path, field)


def test_optional_fields_are_read_strictly_too(tmp_path: Path) -> None:
    """A default helps the writer only: a reader never fills one in."""
    rec = records.WorkerStatus(**STATUS, id="w0", slot=0)
    path = _broken(tmp_path, rec, lambda d: d.pop("last_error"))
    _one_line_error(records.WorkerStatus, path, "last_error")
    path = _broken(tmp_path, rec, lambda d: d.update(state="sleeping"))
    assert "'sleeping'" in _one_line_error(records.WorkerStatus, path, "state")
    version = records.WorkerStatus.expected_version()
    path = _broken(tmp_path, rec, lambda d: d.update(schema_version=version + 1))
    assert f"this shardrl reads {version}" in _one_line_error(records.WorkerStatus, path, "schema_version")
    path = _broken(tmp_path, rec, lambda d: d.update(workers_version=1))
    _one_line_error(records.WorkerStatus, path, "workers_version")
    path.write_text('{"schema_version": 1, "id": ')
    with pytest.raises(RecordError, match=r"rec.json: not valid JSON"):
        read_record(records.WorkerStatus, path)


def test_live_states_are_every_state_written_today_but_the_final_ones() -> None:
    expected = {"starting", "loading", "running", "reloading", "paused", "draining", "waiting", "training"}
    assert expected == heartbeats.LIVE_STATES


# ---------------------------------------------------------------------------------------------- status writer


def test_status_writer_validates_every_write_and_keeps_the_call_shape(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    w = heartbeats.worker_status(layout, "w0", slot=0, supervisor="s", incarnation="abc")
    with pytest.raises(RecordError, match=r"w0.json: field tokens_per_sec: not a field"):
        w.update(state="running", tokens_per_sec=12.0)  # misspelt: fails in the writer
    assert not layout.worker_status("w0").exists()
    with pytest.raises(RecordError, match=r"field state: .*'runing'"):
        w.update(state="runing")
    w.update(state="running", tokens_per_s=12.5, samples=8)
    w.update(weights_version=2)
    rec = heartbeats.load_worker(layout, "w0")
    assert rec is not None and (rec.state, rec.samples, rec.weights_version, rec.beat) == ("running", 8, 2, 2)
    assert w.record["weights_version"] == 2 and w.record["beat"] == 2
    with pytest.raises(RecordError, match=r"field capacty: not a field of SupervisorStatus"):
        heartbeats.supervisor_status(layout, "s", capacty=2)


def test_a_supervisor_can_rewrite_a_worker_record_it_read(tmp_path: Path) -> None:
    """The supervisor gives up on a worker by copying its record (all fields, schema_version included)."""
    layout = make_layout(tmp_path)
    heartbeats.worker_status(layout, "w1", slot=1).update(state="running", samples=3)
    prev = heartbeats.load_worker(layout, "w1")
    assert prev is not None
    keep = {k: v for k, v in prev.to_json().items() if k not in ("host", "pid", "beat", "updated_at", "id")}
    heartbeats.worker_status(layout, "w1", **keep).update(
        state="failed", last_error="boom", gave_up="restarts"
    )
    after = heartbeats.load_worker(layout, "w1")
    assert after is not None and (after.state, after.samples, after.gave_up) == ("failed", 3, "restarts")


def test_samples_in_flight_count_the_other_live_workers_with_fresh_records(tmp_path: Path) -> None:
    """What a worker counts as on its way to the trainer: the other workers' ``in_flight``, not its own, not a
    stopped worker's, and not that of a worker whose record stopped being written (it died mid-batch)."""
    layout = make_layout(tmp_path)
    heartbeats.worker_status(layout, "w0", slot=0).update(state="running", in_flight=100)  # the asker
    heartbeats.worker_status(layout, "w1", slot=1).update(state="running", in_flight=32)
    heartbeats.worker_status(layout, "w2", slot=2).update(state="paused", in_flight=8)  # unpublished groups
    heartbeats.worker_status(layout, "w3", slot=3).update(state="stopped", in_flight=16)
    heartbeats.worker_status(layout, "w4", slot=4).update(state="running", in_flight=64)
    dead = json.loads(layout.worker_status("w4").read_text())
    dead["updated_at"] -= 120.0
    layout.worker_status("w4").write_text(json.dumps(dead))

    assert heartbeats.samples_in_flight(layout, besides="w0", max_age_s=60.0) == 32 + 8
    assert heartbeats.samples_in_flight(layout, besides="w1", max_age_s=60.0) == 100 + 8
    assert heartbeats.samples_in_flight(layout, besides="w0", max_age_s=600.0) == 32 + 8 + 64
    with pytest.raises(RecordError, match="in_flight"):
        heartbeats.worker_status(layout, "w5", slot=5).update(in_flight=-1)


def test_status_listing_reports_bad_records_and_keeps_the_good_ones(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    heartbeats.worker_status(layout, "w0", slot=0).update(state="running", weights_version=1)
    good = heartbeats.load_worker(layout, "w0")
    assert good is not None
    broken = good.to_json()
    del broken["slot"]
    layout.worker_status("w1").write_text(json.dumps(broken))
    layout.worker_status("w2").write_text("{not json")
    listing = heartbeats.load_workers(layout)
    assert [w.id for w in listing.records] == ["w0"]
    assert len(listing.problems) == 2
    assert f"{layout.worker_status('w1')}: field slot: missing" in listing.problems[0]
    layout.trainer_status.write_text(json.dumps({"schema_version": 1, "state": "training"}))
    snap = snapshot(layout)  # shows the problems instead of crashing
    assert [w["id"] for w in snap["workers"]] == ["w0"]
    assert snap["trainer"]["state"] == "absent"
    assert len(snap["problems"]) == 3 and any(
        "trainer.json: field host: missing" in p for p in snap["problems"]
    )
    assert heartbeats.versions_in_use(layout) == {1}


# ---------------------------------------------------------------------------------------------- backlog


def _shard(layout: Any, worker: str, n: int) -> list[tuple[str, int]]:
    """A shard of ``n`` samples; its (shard, row) pairs."""
    w = shards.ShardWriter(layout, "run", worker)
    for i in range(n):
        w.add(sample(i, group=f"{worker}-g{i // 2}"))
    path = w.flush()
    assert path is not None
    return [(path.name, r) for r in range(n)]


def test_backlog_counts_ready_consumed_dropped_and_unconsumed(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    a, b = _shard(layout, "wa", 8), _shard(layout, "wb", 6)
    assert backlog(layout) == Backlog(
        ready_samples=14, consumed_samples=0, dropped_samples=0, unconsumed_samples=14
    )
    counter = BacklogCounter(layout)
    log = plans.PlanLog.claim(layout)
    assert counter.read().planned_step == 0
    log.write_plan(1, [a[0][0]], a[:4], drops=a[4:6])
    assert counter.read() == Backlog(14, 6, 2, 8)
    assert counter.read().planned_step == 1
    # a zombie incarnation's plan written after a newer one claimed is not consumption
    new = plans.PlanLog.claim(layout)
    zombie = records.Plan(step=2, epoch=log.epoch, shards=[b[0][0]], takes=[[0, 0, 6]], samples=6)
    assert records.create_record(layout.plan(2, log.epoch), zombie)
    assert counter.read() == Backlog(14, 6, 2, 8) and counter.read().planned_step == 1
    new.write_plan(2, [b[0][0]], b[:4])
    assert counter.read().planned_step == 2
    assert counter.read() == backlog(layout) == Backlog(14, 10, 2, 4)
    # what the trainer writes into its status record: every count is a field of it
    heartbeats.trainer_status(layout, epoch=new.epoch).update(state="training", **counter.read().as_counts())
    tr = heartbeats.load_trainer(layout)
    assert tr is not None and (tr.consumed_samples, tr.unconsumed_samples, tr.dropped_samples) == (10, 4, 2)
    snap = snapshot(layout)
    assert snap["shards"]["unconsumed_samples"] == 4 and snap["plans"] == 2 and snap["problems"] == []


def test_a_bad_plan_stops_the_trainer_but_is_a_problem_for_views(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, ["a"], [("a", 0), ("a", 1)])
    plan = json.loads(layout.plan(1, log.epoch).read_text())
    layout.plan(2, log.epoch).write_text(json.dumps({**plan, "step": 3}))  # the name says step 2
    with pytest.raises(RecordError, match=r"step-00000002.e1.json: field step: is 3, the file name says 2"):
        plans.valid_plans(layout)
    with pytest.raises(RecordError):
        backlog(layout)
    problems: list[str] = []
    assert BacklogCounter(layout).read(problems).consumed_samples == 2 and len(problems) == 1
    assert len(snapshot(layout)["problems"]) == 1


# ---------------------------------------------------------------------------------------------- fsio helpers


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO, errno.ENOENT])
def test_retry_retries_transient_errors_the_configured_number_of_times(code: int) -> None:
    calls = []

    def flaky(fail: int) -> Any:
        def fn() -> str:
            calls.append(1)
            if len(calls) <= fail:
                raise OSError(code, os.strerror(code))
            return "ok"

        return fn

    assert fsio.retry_transient(flaky(2), attempts=3, delay_s=0) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(OSError) as e:
        fsio.retry_transient(flaky(99), attempts=4, delay_s=0)
    assert e.value.errno == code and len(calls) == 4
    calls.clear()
    with pytest.raises(PermissionError):  # not transient: no retry
        fsio.retry_transient(_denied(calls), attempts=4, delay_s=0)
    assert len(calls) == 1


def _denied(calls: list[int]) -> Any:
    def fn() -> None:
        calls.append(1)
        raise PermissionError(errno.EACCES, "denied")

    return fn


def test_retry_reads_a_file_renamed_into_place_during_the_backoff(tmp_path: Path) -> None:
    final, tmp = tmp_path / "LATEST", tmp_path / ".tmp.LATEST"
    tmp.write_text("v2")
    slept: list[float] = []

    def writer_finishes(seconds: float) -> None:  # the other node's rename lands while this reader backs off
        slept.append(seconds)
        if len(slept) == 2:
            os.rename(tmp, final)

    assert fsio.retry_transient(final.read_text, attempts=5, delay_s=0.05, sleep=writer_finishes) == "v2"
    assert slept == [0.05, 0.1]  # two misses, backing off, then the read


def test_claim_next_gives_the_lowest_free_number_and_skips_taken_ones(tmp_path: Path) -> None:
    def path_of(n: int) -> Path:
        return tmp_path / f"gen-{n:08d}.json"

    seen: list[int] = []

    def content(n: int) -> bytes:
        seen.append(n)
        return fsio.json_bytes({"n": n, "at": time.time_ns()})

    assert fsio.claim_next(path_of, content) == 1
    path_of(3).write_text("{}")  # somebody else's
    assert [fsio.claim_next(path_of, content, first=1) for _ in range(3)] == [2, 4, 5]
    assert seen == [1, 1, 2, 1, 2, 3, 4, 1, 2, 3, 4, 5]  # the content is made afresh for every attempt
    assert fsio.numbered(tmp_path, re.compile(r"^gen-(\d{8})\.json$")) == [1, 2, 3, 4, 5]
