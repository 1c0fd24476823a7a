"""Slot leases under real concurrency: reclaimers in separate processes race for one expired slot.

Each trial: a dead supervisor's lease, observed as stale by every racer, then all of them try to take it over at
once, each stalling a random while between reading the lease and acting on it (a busy host, a slow mount), which is
where a replace-then-reread takeover lets two of them believe they hold the slot.  Exactly one may win each trial.
"""

from __future__ import annotations

import multiprocessing
import random
import time

from buffer import control
from tests.unit.buffer_helpers import make_layout


class _SlowReclaimer(control.Leases):
    """A reclaimer that may stall between reading the lease and acting on it (a busy host, a slow mount)."""

    def read(self, slot):
        rec = super().read(slot)
        time.sleep(random.uniform(0.0, 0.1))
        return rec


def _race(layout, name, slot, trials, start, done, results):
    random.seed(name)
    leases = _SlowReclaimer(layout, name, timeout_s=0.05)
    for trial in range(trials):
        leases.try_acquire(slot + trial)  # observes the dead holder's lease
        start.wait()
        time.sleep(0.06)
        won = leases.try_acquire(slot + trial)
        results.put((trial, name, won, won and leases.renew(slot + trial)))
        done.wait()


def test_racing_reclaimers_of_one_expired_slot_leave_exactly_one_holder(tmp_path):
    layout = make_layout(tmp_path)
    racers, trials = 5, 30
    dead = control.Leases(layout, "dead", timeout_s=1.0)
    for trial in range(trials):
        assert dead.try_acquire(trial)
    ctx = multiprocessing.get_context("fork")
    start, done, results = ctx.Barrier(racers), ctx.Barrier(racers), ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=(layout, f"r{i}", 0, trials, start, done, results))
        for i in range(racers)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(racers * trials)]
    for p in procs:
        p.join(timeout=60)
    for trial in range(trials):
        winners = [name for t, name, won, still in outcomes if t == trial and won]
        assert len(winners) == 1, (trial, winners)
        assert all(still for t, name, won, still in outcomes if t == trial and won)
        assert control.read_lease(layout, trial)["holder"] == winners[0]
        assert control.read_lease(layout, trial)["generation"] == 2
    assert not dead.renew(0)
