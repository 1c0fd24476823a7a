"""Whether another trainer is alive on the run, checked before this one claims it (``python -m trainer``).

A new trainer incarnation fences out the current one: safe (nothing is consumed twice), but a trainer started by
mistake beside a live one would replay its unsaved steps and stop it.  So a trainer whose status record is fresh
makes a new one refuse to start, unless it is given ``--takeover``.  Alive means: on this host, its process exists;
on another host, its record changes within the staleness bound `shardrl status` uses (``run.lease_timeout_s``, at
least five ``trainer.poll_interval_s``).  A record that stays still that long (a crashed node, a requeued job) is not
alive, so a requeue waits at most that long and then resumes without the flag.  Imports nothing heavy.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from buffer.fsio import HOST
from buffer.heartbeats import load_trainer
from buffer.records import RecordError, TrainerStatus
from buffer.run import Run

STALE_POLLS = (
    5  # as buffer.status: a record older than this many poll intervals (and the lease timeout) is stale
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")  # a zombie only awaits its parent


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # every rank checks alike; one of them speaks
        print(line, file=sys.stderr, flush=True)


def _current(run: Run) -> TrainerStatus | None:
    try:
        rec = load_trainer(run.layout)
    except (RecordError, OSError):
        return None  # a damaged record names no trainer to protect; status shows the problem
    return None if rec is None or rec.state == "stopped" else rec


def live_trainer(
    run: Run, sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic
) -> str | None:
    """One line describing the trainer that is alive on ``run``, or None when there is none."""
    rec = _current(run)
    if rec is None or rec.pid == os.getpid():
        return None
    stale_after = max(run.config.run.lease_timeout_s, STALE_POLLS * run.config.trainer.poll_interval_s)
    what = (
        f"{run.layout.trainer_status}: a trainer (host {rec.host}, pid {rec.pid}, epoch {rec.epoch}) is "
        f"{rec.state} at step {rec.step}"
    )
    if rec.host == HOST:
        return f"{what}, its process is alive" if _alive(rec.pid) else None
    if rec.age_s() > stale_after:
        return None
    _say(
        f"trainer: {what} on another host, status written {rec.age_s():.0f}s ago; watching it for up to "
        f"{stale_after:.0f}s to see whether it is alive"
    )
    deadline = clock() + stale_after
    while clock() < deadline:
        sleep(min(1.0, stale_after / 10))
        now = _current(run)
        if now is None:
            return None
        if (now.host, now.pid, now.beat) != (rec.host, rec.pid, rec.beat):
            return f"{what}, its status record keeps changing"
    return None


def refuse_live_trainer(run: Run, takeover: bool) -> str | None:
    """The one-line refusal when a live trainer holds ``run`` and ``takeover`` is not given; else None."""
    live = live_trainer(run)
    if live is None:
        return None
    if takeover:
        _say(f"trainer: --takeover: {live}; it stops once this trainer has claimed the run")
        return None
    return (
        f"{live}; a second trainer would fence it out and replay its unsaved steps: stop it first, or pass "
        "--takeover to take over the run on purpose"
    )
