"""The node supervisor's rules as pure functions: what to do given the desired count, the leases, this node's slots
and the time.  No process, no file, no clock of its own: ``rollout_worker/supervisor.py`` gathers the inputs, passes
``now`` and carries the actions out, and tests/unit/test_supervisor_core.py moves the clock by hand.

The rules:
  * acquire: wanted slots (``0 .. desired-1``) this node does not hold and has not given up on, lowest first; the
    supervisor tries them in order while it has capacity (a slot another node holds is simply not acquired);
  * takeover: acquiring a slot whose lease was held, not released, by another supervisor takes it over;
  * give back: a lease of an unwanted slot (``>= desired``) that nobody here holds and that is not released was left
    by a dead supervisor; taking it over (possible only once it stood still for ``lease_timeout_s``) and releasing
    it at once returns it;
  * drain: slots this node holds that are no longer wanted, highest first;
  * exit: a worker that exited while draining is dropped; one that stopped over its lease is restarted after one
    backoff without counting as a crash; one that crashed is restarted after ``restart_backoff_s`` doubling per
    restart within ``restart_window_s``, unless it exited with a configuration error or crashed ``max_restarts``
    times in the window (a crash loop): then it has failed and its slot cools down for ``restart_window_s``;
  * deadlines: a draining worker is killed at its ``kill_at``; a shutdown kills a little before its deadline so that
    cleanup still fits in it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from buffer.config import ShardRLConfig

from .lifecycle import EXIT_LEASE, EXIT_USER


@dataclass(frozen=True)
class Policy:
    """The settings the rules read (``rollout.*``)."""

    capacity: int
    restart_backoff_s: float
    max_restarts: int
    restart_window_s: float
    drain_deadline_s: float

    @classmethod
    def of(cls, cfg: ShardRLConfig, capacity: int) -> Policy:
        r = cfg.rollout
        return cls(capacity, r.restart_backoff_s, r.max_restarts, r.restart_window_s, r.drain_deadline_s)


@dataclass
class SlotState:
    """What the rules know of one slot this node holds (its process lives in the supervisor)."""

    slot: int
    restarts: collections.deque[float] = field(
        default_factory=collections.deque
    )  # restart times in the window
    restart_at: float | None = None  # a dead worker waits for its backoff
    kill_at: float | None = None  # set while draining: SIGKILL at this time
    killed: bool = False  # SIGKILL sent, exit not reaped yet
    lease_lost: bool = False

    @property
    def draining(self) -> bool:
        return self.kill_at is not None


# ---------------------------------------------------------------------------------------------- control ticks


class Acquire(NamedTuple):
    slot: int


class GiveBack(NamedTuple):
    slot: int
    holder: Any  # the supervisor that left the lease, for the log


class Drain(NamedTuple):
    slot: int


Action = Acquire | GiveBack | Drain


def reconcile(
    desired: int,
    leases: Mapping[int, Mapping[str, Any]],
    slots: Mapping[int, SlotState],
    now: float,
    *,
    cooldown: Mapping[int, float],
    capacity: int,
) -> list[Action]:
    """The actions of one control tick, in the order to carry them out: drains, acquisitions, give-backs.

    ``leases`` are every lease record of the run by slot, ``slots`` the slots this node holds, ``cooldown`` the
    slots this node gave up on and until when.  Acquisitions are candidates in order of preference: the caller
    takes them while it holds fewer than ``capacity`` slots (an acquisition can fail; the next slot is then tried).
    """
    drains: list[Action] = [
        Drain(s.slot)
        for s in sorted(slots.values(), key=lambda s: -s.slot)
        if s.slot >= desired and not s.draining
    ]
    acquire: list[Action] = []
    if len(slots) < capacity:
        acquire = [Acquire(k) for k in range(desired) if k not in slots and cooldown.get(k, 0.0) <= now]
    give_back: list[Action] = [
        GiveBack(k, rec.get("holder"))
        for k, rec in sorted(leases.items())
        if k >= desired and k not in slots and not rec.get("released")
    ]
    return drains + acquire + give_back


def taken_over_from(before: Mapping[str, Any] | None, me: str) -> Any:
    """The supervisor an acquired slot was taken over from (its lease neither released nor ours), or None."""
    if before is None or before.get("released") or before.get("holder") == me:
        return None
    return before.get("holder")


def free_device(slots: Iterable[int], capacity: int) -> int:
    """The lowest local device group no held slot uses."""
    used = set(slots)
    return min(i for i in range(capacity) if i not in used)


# ---------------------------------------------------------------------------------------------- exits


class Drop(NamedTuple):
    """The worker exited while draining: the slot goes (its lease released unless lost)."""


class Restart(NamedTuple):
    """Start the worker again at ``at``; ``delay`` is the backoff, ``crash`` whether it counts as a restart."""

    at: float
    delay: float
    crash: bool


class Fail(NamedTuple):
    """Give up on the worker (``why``); its slot cools down until ``cooldown_until``."""

    why: str
    cooldown_until: float


Exit = Drop | Restart | Fail


def on_exit(s: SlotState, rc: int | None, now: float, policy: Policy) -> Exit:
    """What a worker's exit with ``rc`` means; a crash restart is recorded in ``s.restarts`` and ``s.restart_at``
    (the only state the rules keep)."""
    if s.draining:
        return Drop()
    if rc == EXIT_LEASE:
        # it judged the slot lost (or us stalled): restarted only if the slot is still ours then
        s.restart_at = now + policy.restart_backoff_s
        return Restart(s.restart_at, policy.restart_backoff_s, crash=False)
    window = policy.restart_window_s
    while s.restarts and now - s.restarts[0] > window:
        s.restarts.popleft()
    if rc == EXIT_USER:
        return Fail("a configuration error", now + window)
    if len(s.restarts) >= policy.max_restarts:
        return Fail(f"{len(s.restarts)} restarts within {window:g}s", now + window)
    delay = policy.restart_backoff_s * 2 ** len(s.restarts)
    s.restarts.append(now + delay)
    s.restart_at = now + delay
    return Restart(s.restart_at, delay, crash=True)


def restart_due(s: SlotState, now: float, stopping: bool) -> bool:
    """A dead worker's backoff is over (and the node is not shutting down)."""
    return not s.draining and s.restart_at is not None and now >= s.restart_at and not stopping


def kill_due(s: SlotState, now: float) -> bool:
    """A draining worker still running past its deadline, not yet killed."""
    return s.kill_at is not None and now >= s.kill_at and not s.killed


def drain_until(s: SlotState, now: float, policy: Policy, deadline: float | None = None) -> bool:
    """Start (or tighten) a slot's drain: ``kill_at`` is ``deadline``, or ``drain_deadline_s`` from now.  True when
    the worker has to be told (SIGTERM): a second one would tell it to stop at once, not to drain."""
    if s.draining and deadline is None:
        return False
    asked = s.draining
    s.kill_at = deadline if deadline is not None else now + policy.drain_deadline_s
    return not asked


def shutdown_times(now: float, budget: float) -> tuple[float, float]:
    """``(deadline, kill_at)`` of a node shutdown: everything is killed a little before the deadline (2 s, or a
    quarter of a short budget), so that cleanup still fits in it."""
    deadline = now + budget
    return deadline, deadline - min(2.0, 0.25 * budget)
