"""control.json parsing, exactly-once application, a damaged control generation, and slot leases."""

from __future__ import annotations

import os

import pytest

from buffer import control
from buffer.fsio import write_json_atomic

from .buffer_helpers import make_layout


class _Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _echo(layout, text: str) -> None:
    # like `echo TEXT > control.json`: truncate and rewrite in place (not atomic), new mtime
    with open(layout.control_file, "w") as f:
        f.write(text + "\n")
    st = os.stat(layout.control_file)
    os.utime(layout.control_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


BAD = [
    ('{"action":"add","count":-1}', "not allowed"),
    ('{"action":"add","count":0}', "not allowed"),
    ('{"action":"remove","count":0}', "not allowed"),
    ('{"action":"add","count":1.5}', "not an integer"),
    ('{"action":"add","count":"2"}', "not an integer"),
    ('{"action":"add","count":true}', "not an integer"),
    ('{"action":"grow","count":1}', "not one of add, remove, set"),
    ('{"count":1}', "not one of add, remove, set"),
    ('{"action":"set","count":100}', "above run.max_workers"),
    ('{"action":"remove","count":9}', "only 2 workers are desired"),
    ('["add", 1]', "expected a JSON object"),
]


@pytest.mark.parametrize(("text", "reason"), BAD)
def test_bad_commands_are_rejected_with_a_reason(text, reason):
    with pytest.raises(control.ControlError, match=reason):
        control.parse_command(text.encode(), current=2, max_workers=8)


def test_good_commands():
    assert control.parse_command(b'{"action":"add","count":2}', 1, 8)[1] == 3
    assert control.parse_command(b'{"action":"remove","count":1}', 1, 8)[1] == 0
    assert control.parse_command(b'{"action":"set","count":0}', 3, 8)[1] == 0


def test_each_command_applies_once_and_an_identical_echo_later_is_new(tmp_path):
    layout = make_layout(tmp_path)
    control.init_state(layout, 1)
    a = control.ControlWatcher(layout, 8, settle_s=0.0, who="a")
    b = control.ControlWatcher(layout, 8, settle_s=0.0, who="b")
    _echo(layout, '{"action":"add","count":2}')
    assert a.poll().desired == 3
    assert b.poll().desired == 3  # b sees it applied already
    assert a.poll().desired == 3
    _echo(layout, '{"action":"add","count":2}')  # the same text echoed again is a new command
    assert b.poll().desired == 5
    assert a.poll().desired == 5
    st = control.read_state(layout)
    assert st.generation == 2 and st.last_applied["by"] == "b"


def test_a_command_finished_while_a_supervisor_reads_it_is_applied_once(tmp_path, monkeypatch):
    """An echo whose second half lands between a supervisor's open and its read: that supervisor reads the whole
    command, and must key it as the others will, by the finished file's time and size (keyed by the half-written
    file's, it was applied twice: the racing-supervisors test in tests/integration/test_buffer_crash.py)."""
    layout = make_layout(tmp_path)
    control.init_state(layout, 1)
    a = control.ControlWatcher(layout, 8, settle_s=0.0, who="a")
    b = control.ControlWatcher(layout, 8, settle_s=0.0, who="b")
    text = '{"action":"add","count":2}\n'
    with open(layout.control_file, "w") as f:
        f.write(text[:10])
    real_read = os.read
    finished: list[bool] = []

    def read_after_the_echo_finishes(fd: int, n: int) -> bytes:
        if not finished:  # the rest of the echo lands, a tick later, after a's open and fstat
            finished.append(True)
            st = os.stat(layout.control_file)
            with open(layout.control_file, "a") as f:
                f.write(text[10:])
            os.utime(layout.control_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", read_after_the_echo_finishes)
    assert a.poll().desired == 3 and finished
    monkeypatch.setattr(os, "read", real_read)
    assert b.poll().desired == 3
    st = control.read_state(layout)
    assert st.generation == 1 and st.last_applied["by"] == "a"


def test_a_file_that_changes_size_while_read_is_read_again_next_poll(tmp_path, monkeypatch):
    """Bytes that do not match the size of the file after the read (truncated or rewritten meanwhile) are no
    command yet: the poll decides nothing, and the next one reads the file whole."""
    layout = make_layout(tmp_path)
    control.init_state(layout, 1)
    w = control.ControlWatcher(layout, 8, settle_s=0.0, who="a")
    _echo(layout, '{"action":"set","count":4}')
    real_fstat = os.fstat
    calls: list[int] = []

    def fstat_seeing_a_truncation(fd: int) -> os.stat_result:
        calls.append(fd)
        st = real_fstat(fd)
        if len(calls) == 2:  # the stat after the read: the file was cut meanwhile
            fields = list(st)
            fields[6] = 0  # st_size
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "fstat", fstat_seeing_a_truncation)
    assert w.poll().generation == 0
    monkeypatch.setattr(os, "fstat", real_fstat)
    st = w.poll()
    assert st.generation == 1 and st.desired == 4


def test_half_written_file_waits_then_is_rejected_and_desired_stays(tmp_path):
    layout = make_layout(tmp_path)
    control.init_state(layout, 2)
    clock = _Clock()
    w = control.ControlWatcher(layout, 8, settle_s=0.3, who="a", clock=clock)
    _echo(layout, '{"action":"ad')
    assert w.poll().last_rejection is None  # maybe an echo in progress
    clock.now += 0.35
    st = w.poll()
    assert st.desired == 2
    assert "not valid JSON" in st.last_rejection["reason"]
    _echo(layout, '{"action":"set","count":4}')
    st = w.poll()
    assert st.desired == 4 and "not valid JSON" in st.last_rejection["reason"]


def test_a_corrupt_newest_generation_is_reported_not_reverted_and_blocks_commits(tmp_path):
    layout = make_layout(tmp_path)
    control.init_state(layout, 1)
    w = control.ControlWatcher(layout, 8, settle_s=0.0, who="a")
    _echo(layout, '{"action":"add","count":2}')
    assert w.poll().desired == 3
    layout.control_generation(1).write_text('{"desired": 3, "hist')  # the newest generation damaged on disk
    st = control.read_state(layout)
    assert st.generation == 1 and st.problem is not None
    assert "gen-00000001.json" in st.problem and "move it away" in st.problem
    # a new command waits; each poll returns at once, committing nothing on top of the damaged generation
    _echo(layout, '{"action":"add","count":1}')
    for _ in range(3):
        assert w.poll().problem == st.problem
    assert sorted(os.listdir(layout.control_dir)) == ["gen-00000000.json", "gen-00000001.json"]
    # a record that parses but is not a generation is a problem too
    write_json_atomic(layout.control_generation(1), {"desired": "3", "history": []})
    assert "field desired" in control.read_state(layout).problem
    # repaired by moving the file away: the pending command applies on the last valid generation
    layout.control_generation(1).rename(tmp_path / "gen-1.damaged")
    st = w.poll()
    assert st.problem is None and st.generation == 1 and st.desired == 2


def test_lease_acquire_renew_release_and_stale_takeover(tmp_path):
    layout = make_layout(tmp_path)
    clock = _Clock()
    a = control.Leases(layout, "sup-a", timeout_s=0.3, clock=clock)
    b = control.Leases(layout, "sup-b", timeout_s=0.3, clock=clock)
    assert a.try_acquire(0)
    assert not b.try_acquire(0)
    assert a.renew(0)
    assert not b.try_acquire(0)  # counter moved: b starts its observation again
    clock.now += 0.35
    assert b.try_acquire(0)  # a stopped heart-beating for >= timeout on b's clock
    assert control.read_lease(layout, 0)["generation"] == 2
    assert not a.renew(0)  # a learns it lost the slot
    assert b.held() == [0] and a.held() == []
    assert control.all_leases(layout)[0]["holder"] == "sup-b"
    b.release(0)
    assert control.all_leases(layout) == {}
    assert a.try_acquire(0)  # a released slot is taken at once, as the next generation
    assert control.read_lease(layout, 0)["generation"] == 3
    assert control.lease_generations(layout, 0) == [2, 3]  # older generations are cleared away


def test_a_live_lease_is_never_taken_however_old_its_wall_clock(tmp_path):
    layout = make_layout(tmp_path)
    clock = _Clock()
    a = control.Leases(layout, "sup-a", timeout_s=0.2, clock=clock)
    b = control.Leases(layout, "sup-b", timeout_s=0.2, clock=clock)
    assert a.try_acquire(3)
    for _ in range(6):
        clock.now += 0.1
        assert a.renew(3)
        assert not b.try_acquire(3)


def test_a_worker_watch_stops_on_takeover_release_and_a_stalled_holder(tmp_path):
    clock = _Clock()
    layout = make_layout(tmp_path)
    sup = control.Leases(layout, "sup-a", timeout_s=8.0, clock=clock)
    assert sup.try_acquire(0) and sup.try_acquire(1) and sup.try_acquire(2)
    watches = {k: control.LeaseWatch(layout, k, "sup-a", timeout_s=8.0, clock=clock) for k in range(3)}
    assert (watches[0].poll_s, watches[0].stall_s, watches[0].exit_s) == (1.0, 4.0, 1.0)
    for _ in range(10):  # renewed every 3.9s: the stall threshold (4s) is never reached
        assert all(w.check() is None for w in watches.values())
        assert sup.renew(0) and sup.renew(1) and sup.renew(2)
        clock.now += 3.9
    # slot 0: another supervisor's generation appears; slot 1: given back; slot 2: renewals stop
    other = control.Leases(layout, "sup-b", timeout_s=8.0, clock=clock)
    assert other._claim(0, control.read_lease(layout, 0)["generation"] + 1)
    sup.release(1)
    assert "now held by sup-b" in watches[0].check()
    assert "given back" in watches[1].check()
    assert watches[2].check() is None
    clock.now += 3.9
    assert watches[2].check() is None
    clock.now += 0.2
    assert "not renewed for 4s" in watches[2].check()


def test_renew_interval_is_at_most_an_eighth_of_the_lease_timeout():
    assert control.renew_interval_s(30.0, 2.0) == 2.0
    assert control.renew_interval_s(6.0, 2.0) == 0.75
