"""The node supervisor's rules (``rollout_worker/reconcile.py``) on plain data with a hand-moved clock: takeover,
give-back, backoff, crash loop, drain and the shutdown deadline.  The real processes are in
tests/integration/test_supervisor.py."""

from __future__ import annotations

import pytest

from rollout_worker import reconcile as core
from rollout_worker.lifecycle import EXIT_LEASE, EXIT_USER

POLICY = core.Policy(
    capacity=2, restart_backoff_s=1.0, max_restarts=3, restart_window_s=60.0, drain_deadline_s=30.0
)
ME = "node-a"


def held(*slots: int, draining: tuple[int, ...] = ()) -> dict[int, core.SlotState]:
    out = {k: core.SlotState(k) for k in slots}
    for k in draining:
        out[k].kill_at = 100.0
    return out


def lease(holder: str, released: bool = False) -> dict[str, object]:
    return {"holder": holder, "released": released}


def test_wanted_slots_are_acquired_lowest_first_and_only_with_capacity() -> None:
    acts = core.reconcile(3, {}, {}, 0.0, cooldown={}, capacity=2)
    # every wanted slot is a candidate, in order: one held elsewhere is skipped by its failed acquisition
    assert acts == [core.Acquire(0), core.Acquire(1), core.Acquire(2)]
    assert core.reconcile(3, {}, held(0), 0.0, cooldown={}, capacity=2) == [core.Acquire(1), core.Acquire(2)]
    assert core.reconcile(3, {}, held(0, 1), 0.0, cooldown={}, capacity=2) == []  # full
    assert core.reconcile(0, {}, {}, 0.0, cooldown={}, capacity=2) == []


def test_a_slot_given_up_on_cools_down_until_its_time() -> None:
    cooldown = {0: 60.0}
    assert core.reconcile(2, {}, {}, 59.9, cooldown=cooldown, capacity=2) == [core.Acquire(1)]
    assert core.reconcile(2, {}, {}, 60.0, cooldown=cooldown, capacity=2) == [
        core.Acquire(0),
        core.Acquire(1),
    ]


def test_takeover_is_acquiring_a_lease_another_live_holder_did_not_release() -> None:
    assert core.taken_over_from(lease("node-b"), ME) == "node-b"
    assert core.taken_over_from(lease("node-b", released=True), ME) is None
    assert core.taken_over_from(lease(ME), ME) is None  # our own, e.g. after a restart
    assert core.taken_over_from(None, ME) is None  # never leased


def test_abandoned_leases_of_unwanted_slots_are_given_back() -> None:
    leases = {0: lease("node-b"), 2: lease("dead"), 3: lease("dead", released=True), 4: lease(ME)}
    acts = core.reconcile(1, leases, held(4), 0.0, cooldown={}, capacity=2)
    # slot 4 is ours and unwanted: drained, not given back; 3 is released already; 0 is wanted (its acquisition
    # fails while node-b renews it)
    assert acts == [core.Drain(4), core.Acquire(0), core.GiveBack(2, "dead")]


def test_unwanted_slots_drain_highest_first_and_once() -> None:
    assert core.reconcile(1, {}, held(0, 1, 2), 0.0, cooldown={}, capacity=3) == [
        core.Drain(2),
        core.Drain(1),
    ]
    assert core.reconcile(1, {}, held(0, 1, 2, draining=(2,)), 0.0, cooldown={}, capacity=3) == [
        core.Drain(1)
    ]


def test_drain_sets_the_kill_time_and_signals_the_worker_once() -> None:
    s = core.SlotState(0)
    assert core.drain_until(s, 10.0, POLICY) and s.kill_at == 40.0
    assert not core.drain_until(s, 20.0, POLICY) and s.kill_at == 40.0  # a scale-down again: nothing changes
    # a shutdown tightens the deadline without a second SIGTERM (which would mean "stop now")
    assert not core.drain_until(s, 20.0, POLICY, deadline=25.0) and s.kill_at == 25.0
    assert not core.kill_due(s, 24.9) and core.kill_due(s, 25.0)
    s.killed = True
    assert not core.kill_due(s, 26.0)  # SIGKILL sent: wait for the exit


def test_shutdown_kills_a_little_before_the_deadline() -> None:
    assert core.shutdown_times(100.0, 30.0) == (130.0, 128.0)
    assert core.shutdown_times(100.0, 4.0) == (104.0, 103.0)  # a quarter of a short budget


def test_crash_restarts_back_off_doubling() -> None:
    s, now = core.SlotState(0), 0.0
    delays = []
    for _ in range(3):
        out = core.on_exit(s, 1, now, POLICY)
        assert isinstance(out, core.Restart) and out.crash and out.at == now + out.delay == s.restart_at
        assert not core.restart_due(s, now + out.delay - 0.01, stopping=False)
        assert core.restart_due(s, now + out.delay, stopping=False)
        assert not core.restart_due(s, now + out.delay, stopping=True)  # no restart while shutting down
        delays.append(out.delay)
        now += out.delay + 0.5  # it runs half a second and crashes again
    assert delays == [1.0, 2.0, 4.0]


def test_a_crash_loop_fails_the_worker_and_cools_its_slot_down() -> None:
    s, now = core.SlotState(0), 0.0
    for _ in range(POLICY.max_restarts):
        out = core.on_exit(s, 1, now, POLICY)
        assert isinstance(out, core.Restart)
        now = out.at + 0.5
    out = core.on_exit(s, 1, now, POLICY)
    assert out == core.Fail("3 restarts within 60s", now + POLICY.restart_window_s)


def test_restarts_older_than_the_window_are_forgotten() -> None:
    s = core.SlotState(0)
    for now in (0.0, 2.0, 6.0):
        assert isinstance(core.on_exit(s, 1, now, POLICY), core.Restart)
    # 3 restarts, the last due at 6 + 4 = 10; long after the window they no longer count: backoff starts over
    out = core.on_exit(s, 1, 200.0, POLICY)
    assert out == core.Restart(201.0, 1.0, crash=True) and len(s.restarts) == 1


def test_a_configuration_error_fails_at_once() -> None:
    assert core.on_exit(core.SlotState(0), EXIT_USER, 5.0, POLICY) == core.Fail("a configuration error", 65.0)


def test_a_worker_that_stopped_over_its_lease_restarts_without_counting_a_crash() -> None:
    s = core.SlotState(0)
    assert core.on_exit(s, EXIT_LEASE, 5.0, POLICY) == core.Restart(6.0, 1.0, crash=False)
    assert not s.restarts and core.restart_due(s, 6.0, stopping=False)


@pytest.mark.parametrize("rc", [0, 1, EXIT_LEASE, EXIT_USER, -9])
def test_an_exit_while_draining_drops_the_slot(rc: int) -> None:
    s = core.SlotState(0, kill_at=30.0)
    assert core.on_exit(s, rc, 10.0, POLICY) == core.Drop() and not s.restarts and s.restart_at is None


def test_a_new_slot_takes_the_lowest_free_device() -> None:
    assert core.free_device([], 2) == 0
    assert core.free_device([0], 2) == 1
    assert core.free_device([1], 2) == 0
