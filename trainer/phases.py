"""Where a training step's time goes: wall time per named phase, for ``bench/trainer.py --profile``.

The step marks its phases with ``phase(name)`` (batches, prepare, forward, decoder, head, backward, optimizer,
metrics).  Nothing is timed unless a ``PhaseTimer`` is active: ``phase`` is then a no-op of a few microseconds, a
handful a micro-batch.
While one is active, each phase boundary waits for the device (``sync``), so a phase's time is its kernels' time,
not the time to queue them; that also removes the overlap between phases, which is why the bench reports the
step's unprofiled time beside the table.

Times are exclusive and keyed by path: the decoder inside the forward is ``forward/decoder``, the forward's own rest
(the losses) is ``forward``; inside ``prepare`` the reference's decoder is ``prepare/decoder``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Exclusive wall seconds per phase path, summed over every step run while it is active."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self._stack: list[str] = []
        self._mark = 0.0

    def _charge(self) -> None:
        self.sync()
        now = time.perf_counter()
        if self._stack:
            key = "/".join(self._stack)
            self.seconds[key] = self.seconds.get(key, 0.0) + now - self._mark
        self._mark = now

    def enter(self, name: str) -> None:
        self._charge()
        self._stack.append(name)

    def exit(self) -> None:
        self._charge()
        self._stack.pop()


_active: PhaseTimer | None = None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Charge the time inside to ``name`` (nested under the enclosing phase) when a timer is active."""
    timer = _active
    if timer is None:
        yield
        return
    timer.enter(name)
    try:
        yield
    finally:
        timer.exit()


@contextmanager
def timing(sync: Callable[[], None]) -> Iterator[PhaseTimer]:
    """Activate a new timer for the enclosed steps (one at a time)."""
    global _active
    if _active is not None:
        raise RuntimeError("trainer.phases: a timer is already active")
    _active = PhaseTimer(sync)
    try:
        yield _active
    finally:
        _active = None
