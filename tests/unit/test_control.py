"""control.json parsing, exactly-once application, and slot leases."""

from __future__ import annotations

import os
import time

import pytest

from buffer import control

from .buffer_helpers import make_layout


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


def test_half_written_file_waits_then_is_rejected_and_desired_stays(tmp_path):
    layout = make_layout(tmp_path)
    control.init_state(layout, 2)
    w = control.ControlWatcher(layout, 8, settle_s=0.3, who="a")
    _echo(layout, '{"action":"ad')
    assert w.poll().last_rejection is None  # maybe an echo in progress
    time.sleep(0.35)
    st = w.poll()
    assert st.desired == 2
    assert "not valid JSON" in st.last_rejection["reason"]
    _echo(layout, '{"action":"set","count":4}')
    st = w.poll()
    assert st.desired == 4 and "not valid JSON" in st.last_rejection["reason"]


def test_lease_acquire_renew_release_and_stale_takeover(tmp_path):
    layout = make_layout(tmp_path)
    a = control.Leases(layout, "sup-a", timeout_s=0.3)
    b = control.Leases(layout, "sup-b", timeout_s=0.3)
    assert a.try_acquire(0)
    assert not b.try_acquire(0)
    assert a.renew(0)
    assert not b.try_acquire(0)  # counter moved: b starts its observation again
    time.sleep(0.35)
    assert b.try_acquire(0)  # a stopped heart-beating for >= timeout on b's clock
    assert not a.renew(0)  # a learns it lost the slot
    assert b.held() == [0] and a.held() == []
    b.release(0)
    assert control.all_leases(layout) == {}
    assert a.try_acquire(0)


def test_a_live_lease_is_never_taken_however_old_its_wall_clock(tmp_path):
    layout = make_layout(tmp_path)
    a = control.Leases(layout, "sup-a", timeout_s=0.2)
    b = control.Leases(layout, "sup-b", timeout_s=0.2)
    assert a.try_acquire(3)
    for _ in range(6):
        time.sleep(0.1)
        assert a.renew(3)
        assert not b.try_acquire(3)
