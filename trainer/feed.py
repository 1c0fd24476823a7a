"""Feeding the trainer: rank 0 plans (or replays) each step from the shards; every rank gets the step's samples.

- Prefetch.  While step N computes, a thread on rank 0 plans step N+1 and reads its shards, so a step with samples
  ready starts at once.  Plans stay in step order (N+1's is written after N's, by the same rank 0) and
  ``PlanLog.write_plan`` checks the fence as ever; a prefetched plan that is never trained (the trainer stopped) is
  replayed by the next incarnation, like any plan after its checkpoint.
- Waiting.  When a step cannot be planned yet, rank 0 looks again after 20 ms, doubling up to
  ``trainer.poll_interval_s`` while nothing new arrives.  An inotify watch of shards/ready (watchdog) only cuts a
  sleep short: writes of other nodes never reach it, so the polls are the authority.  The wait is reported in the
  trainer status (``waiting: 40 of 256 samples; 120 stale dropped``).
- Stale samples (``algorithm.staleness_mode = "drop"``) found while waiting are dropped at once, by a plan of
  drops only (a step that trains nothing): they stop counting as backlog, so rollout workers paused on it resume, and
  being consumed they are never trained later.
- Replay of a recorded plan goes on without the samples whose shard is gone or damaged since it was planned (they
  are counted in the step's metrics); a shard that cannot be read for now (an I/O error) is waited for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from buffer.plans import Plan, PlanLog
from buffer.run import Run
from buffer.status import BacklogCounter
from trainer import dist as tdist
from trainer.data import Planner, Sample

log = logging.getLogger("trainer")

FIRST_POLL_S = 0.02
ROUND_S = 1.0  # rank 0 polls alone this long between the collective checks (stop request, status record)
DROP_EVERY_S = 10.0  # drop-only steps while one wait lasts: at most one per this many seconds after the first
TIMEOUT = "timeout"


@dataclass
class StepBatch:
    samples: list[Sample]
    dropped: int  # samples the step's plan dropped as too stale
    replayed: bool  # the plan was recorded by an earlier incarnation
    missing: list[str] = field(default_factory=list)  # replayed samples that could not be read back
    timings: dict[str, float] = field(default_factory=dict)  # rank 0: wait, plan, load (s) before the step
    prefetched: bool = False


class ShardHint:
    """An inotify watch of a directory through watchdog, as a hint: a local write there ends a sleep early."""

    def __init__(self, path: Any):
        self.event = threading.Event()
        self._observer: Any = None
        try:
            from watchdog.events import FileSystemEvent, FileSystemEventHandler
            from watchdog.observers import Observer

            event = self.event

            class Hint(FileSystemEventHandler):
                def on_any_event(self, e: FileSystemEvent) -> None:
                    event.set()

            observer = Observer()
            observer.schedule(Hint(), str(path), recursive=False)
            observer.daemon = True
            observer.start()
            self._observer = observer
        except Exception as e:  # no watchdog, no inotify (limits, platform): the polls alone are enough
            log.info("no inotify hint on %s (%s); polling only", path, e)

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when a hint ended it early."""
        hinted = self.event.wait(max(seconds, 0.0))
        self.event.clear()
        return hinted

    def close(self) -> None:
        if self._observer is not None:
            self._observer.stop()


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on rank 0, its result on every rank.  An exception there is raised on every rank: rank 0
    raises its own, the others a FencedError alike or a RuntimeError naming it (not every exception unpickles)."""
    from buffer.plans import FencedError

    result: Any = None
    error: Exception | None = None
    if tdist.is_main():
        try:
            result = fn()
        except Exception as e:
            error = e
    shared: Exception | None = None
    if isinstance(error, FencedError):
        shared = FencedError(str(error))
    elif error is not None:
        shared = RuntimeError(f"rank 0 failed: {type(error).__name__}: {error}")
    result, shared = tdist.broadcast_object((result, shared))
    if error is not None:
        raise error
    if shared is not None:
        raise shared
    return result


class Feeder:
    """Rank 0 plans or replays each step (ahead of time when it can); every rank gets the step's samples."""

    def __init__(self, run: Run, after_step: int, plan_log: PlanLog | None, stop: Any):
        self.run, self.stop = run, stop
        self.timed_out = False
        self.planner: Planner | None = None
        self.backlog: BacklogCounter | None = None
        self.replay: dict[int, Plan] = {}
        self.ahead: tuple[int, Future[StepBatch | None]] | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.hint: ShardHint | None = None
        self.delay = FIRST_POLL_S
        self.last_drop = -float("inf")
        self.dropped_waiting = 0  # stale samples dropped while waiting for the current step
        if plan_log is not None:
            self.planner = Planner(run.layout, plan_log, run.config.model.vocab_size)
            self.backlog = BacklogCounter(run.layout)
            self.replay = {p.step: p for p in plan_log.replay(after_step=after_step)}
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
            self.hint = ShardHint(run.layout.shards_ready)
            if self.replay:
                log.info("replaying recorded plans of steps %s", sorted(self.replay))

    # ------------------------------------------------------------------------------------------ rank 0 only

    def _try(self, step: int, version: int, drop_only: bool = False) -> StepBatch | None:
        assert self.planner is not None
        if step in self.replay:
            plan = self.replay[step]
            back = self.planner.replay(plan)  # an I/O error leaves the plan to be tried again
            del self.replay[step]
            timings = dict(self.planner.timings)
            return StepBatch(back.samples, len(plan.dropped_ids), True, back.missing, timings)
        t, a = self.run.config.trainer, self.run.config.algorithm
        drop = a.staleness_mode == "drop"
        got = self.planner.try_plan(step, t.samples_per_step, version, t.max_staleness, drop, drop_only)
        if got is None:
            return None
        return StepBatch(got[1], len(got[0].dropped_ids), False, timings=dict(self.planner.timings))

    def _prefetch(self, step: int, version: int) -> StepBatch | None:
        try:
            return self._try(step, version)
        except OSError as e:  # the foreground tries again, and waits while it lasts
            log.info("prefetch of step %d: %s", step, e)
            return None

    def _take_prefetched(self, step: int) -> StepBatch | None:
        if self.ahead is None:
            return None
        ahead_step, future = self.ahead
        self.ahead = None
        t0 = time.monotonic()
        batch = future.result()  # its errors (a fence) are raised here, as the foreground's would be
        if batch is None or ahead_step != step:
            return None
        # On the step's critical path: only the wait for the thread (reading shards the compute did not cover).
        batch.timings = {"load": time.monotonic() - t0, "plan": 0.0, "prefetch": sum(batch.timings.values())}
        batch.prefetched = True
        return batch

    def _waiting_text(self, step: int, io_error: str | None) -> str:
        assert self.planner is not None
        if io_error is not None:
            return f"replay of step {step}: {io_error}; retrying"
        w, n = self.planner.waiting, self.run.config.trainer.samples_per_step
        parts = [f"{w.fresh} of {n} samples"]
        if self.dropped_waiting:
            parts.append(f"{self.dropped_waiting} stale dropped")
        if w.stale:
            parts.append(f"{w.stale} stale to drop")
        unreadable = self.planner.cache.unreadable
        if unreadable:
            name, err = next(iter(unreadable.items()))
            parts.append(f"{len(unreadable)} shards unreadable ({name}: {err})")
        return "; ".join(parts)

    def _round(self, step: int, version: int, since: float) -> StepBatch | str:
        """Poll for ``step`` for up to ROUND_S: its batch, TIMEOUT, or what it waits for."""
        assert self.planner is not None and self.hint is not None
        batch = self._take_prefetched(step)
        if batch is not None:
            return batch
        self.planner.log.check_not_fenced()  # also while waiting: a fenced trainer must not linger
        end = time.monotonic() + ROUND_S
        t = self.run.config.trainer
        while True:
            io_error = None
            drop_only = time.monotonic() - self.last_drop >= DROP_EVERY_S
            try:
                batch = self._try(step, version, drop_only)
            except OSError as e:
                io_error = str(e)
            if batch is not None:
                return self._taken(batch)
            if t.step_wait_timeout_s is not None and time.monotonic() - since > t.step_wait_timeout_s:
                return TIMEOUT
            now = time.monotonic()
            if now >= end:
                return self._waiting_text(step, io_error)
            arrived = self.planner.arrived > 0
            hinted = self.hint.sleep(min(self.delay, end - now))
            self.delay = FIRST_POLL_S if arrived or hinted else min(2 * self.delay, t.poll_interval_s)

    def _taken(self, batch: StepBatch) -> StepBatch:
        self.delay = FIRST_POLL_S
        if not batch.samples and not batch.replayed:  # a plan of drops only
            self.last_drop = time.monotonic()
            self.dropped_waiting += batch.dropped
            log.info("dropped %d stale samples while waiting (a step of drops only)", batch.dropped)
        else:
            self.dropped_waiting = 0
        return batch

    # ---------------------------------------------------------------------------------------- collective

    def next(
        self, step: int, version: int, waiting: Callable[[str], None], idle: Callable[[], object]
    ) -> StepBatch | None:
        """The samples of ``step`` (None when stopping or giving up).  While it waits, ``waiting(what)`` reports what
        it waits for, and ``idle()`` runs once (the loop settles its publish in flight there)."""
        t0 = time.monotonic()
        idled = False
        while not self.stop.agreed():
            got = on_rank0(lambda: self._round(step, version, t0))
            if isinstance(got, StepBatch):
                spent = sum(v for k, v in got.timings.items() if k in ("plan", "load"))
                got.timings["wait"] = max(0.0, time.monotonic() - t0 - spent)
                return got
            if got == TIMEOUT:
                self.timed_out = True
                break
            waiting(got)
            if not idled:
                idle()
                idled = True
        return None

    def prefetch(self, step: int, version: int) -> None:
        """Rank 0 starts planning ``step`` (judged against weight ``version``) in its thread; not collective."""
        if self.pool is None or self.ahead is not None or self.stop.set:
            return
        self.ahead = (step, self.pool.submit(self._prefetch, step, version))

    def counts(self) -> dict[str, int]:
        """The run's backlog (``buffer.status.Backlog``) and the shards this trainer quarantined (rank 0)."""
        if self.planner is None or self.backlog is None:
            return {}
        return {**self.backlog.read().as_counts(), "quarantined": self.planner.cache.quarantined}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)  # a plan being written is finished, never cut
        if self.hint is not None:
            self.hint.close()
