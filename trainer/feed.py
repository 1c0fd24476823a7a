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
  are counted in the step's metrics); a shard that cannot be read for now (an I/O error) is waited for.  A step
  marked poisoned (its data failed the trainer: ``PlanLog.mark_poisoned``) replays without its samples.
- The feed.  A thread on rank 0 (``FeedKeeper``) rewrites the trainer record's feed fields about once a second, also
  while a step computes, and at once after each plan: the backlog and each live worker's in-flight samples, so that
  no rollout worker lists the run or reads the other workers' records (one read of one file per check).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from buffer import heartbeats
from buffer.logs import logger
from buffer.plans import Plan, PlanLog, read_poisoned
from buffer.records import LIVE_STATES
from buffer.run import Run
from trainer import dist as tdist
from trainer.data import Limits, Planner, Sample

log = logger("trainer")

FIRST_POLL_S = 0.02
ROUND_S = 1.0  # rank 0 polls alone this long between the collective checks (stop request, status record)
DROP_EVERY_S = 10.0  # drop-only steps while one wait lasts: at most one per this many seconds after the first
FEED_S = 1.0  # the feed's refresh: what a rollout worker's view of the other workers may lag by
# A worker's record counts in the fleet while younger than this many heartbeats plus the clock skew between nodes
# (records carry the writer's wall clock): a worker that died mid-batch stops holding the others back after that.
IN_FLIGHT_BEATS = 5
# Records read at a time by a refresh: on Lustre or NFS each read is a round trip or two, which threads overlap (at
# 1 ms a call, 512 node records one by one take about as long as the refresh's whole second).
READ_THREADS = 16
CLOCK_SKEW_S = 10.0
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


class FeedKeeper:
    """Rank 0's thread that keeps the feed fields of the trainer record fresh (``records.TrainerStatus``).

    Each refresh reads the workers' records first and counts the backlog after: a shard published in between is then
    counted twice (in a worker's ``in_flight`` and in the backlog), never missed, so workers err towards pausing.
    ``write(fields)`` merges the fields into the record; ``last`` is the newest set, for the loop's own writes.
    """

    def __init__(self, run: Run, planner: Planner, write: Callable[[dict[str, Any]], None] | None = None):
        self.run, self.planner, self.write = run, planner, write
        self.max_age_s = IN_FLIGHT_BEATS * run.config.run.heartbeat_interval_s + CLOCK_SKEW_S
        self.last: dict[str, Any] = {}
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, write: Callable[[dict[str, Any]], None]) -> None:
        self.write = write
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.wake.wait(FEED_S)
            self.wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except Exception as e:  # the storage for a moment: the next refresh tries again
                log.warning("feed not refreshed: %s", e)

    def refresh(self) -> dict[str, Any]:
        nodes, fleet = self.fleet()
        c = self.planner.count()
        fields = {
            **c.as_counts(),
            "planned_step": c.planned_step,
            "open_from": c.open_from,
            "window_consumed": c.window_consumed,
            "fleet": fleet,
            "nodes": nodes,
            "feed_at": time.time(),
        }
        self.last = fields
        if self.write is not None:
            self.write(fields)
        return fields

    def fleet(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(per node, per worker): each live supervisor's record gives its node's workers summed; only the workers
        no live supervisor record lists (started by hand, or their supervisor gone) have their own records read.
        Calls per refresh: a listing and a read per node, then one listing of the workers' records."""
        layout, nodes, listed = self.run.layout, {}, set()
        for sup in heartbeats.load_supervisors(layout, threads=READ_THREADS).records:
            if sup.state not in LIVE_STATES or sup.age_s() >= self.max_age_s:
                continue  # its workers, if any still run, are read one by one below
            live = [w for w in sup.workers.values() if w.incarnation is not None]
            nodes[sup.id] = {
                "in_flight": sum(w.in_flight for w in live),
                "published_samples": sum(w.published_samples for w in live),
                "workers": len(live),
            }
            listed |= {w.worker_id for w in sup.workers.values()}
        fleet = {
            w.id: heartbeats.fleet_fields(w)
            for w in heartbeats.load_workers(layout, skip=listed, threads=READ_THREADS).records
            if w.state in LIVE_STATES and w.age_s() < self.max_age_s
        }
        return nodes, fleet

    def close(self) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


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
        self.keeper: FeedKeeper | None = None
        self.replay: dict[int, Plan] = {}
        self.ahead: tuple[int, Future[StepBatch | None]] | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.hint: ShardHint | None = None
        self.delay = FIRST_POLL_S
        self.last_drop = -float("inf")
        self.dropped_waiting = 0  # stale samples dropped while waiting for the current step
        if plan_log is not None:
            cfg = run.config
            limits = Limits(
                cfg.model.vocab_size, cfg.context_length(), cfg.rollout.sampling.max_response_length
            )
            self.planner = Planner(run.layout, plan_log, limits)
            self.keeper = FeedKeeper(run, self.planner)
            self.replay = {p.step: p for p in plan_log.replay(after_step=after_step)}
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
            # a publisher's rename out of shards/tmp is the local sign of a new shard, whatever its bucket
            self.hint = ShardHint(run.layout.shards_tmp)
            if self.replay:
                log.info("replaying recorded plans of steps %s", sorted(self.replay))

    # ------------------------------------------------------------------------------------------ rank 0 only

    def _try(self, step: int, version: int, drop_only: bool = False) -> StepBatch | None:
        assert self.planner is not None
        if step in self.replay:
            plan = self.replay[step]
            poisoned = read_poisoned(self.run.layout, step)
            if poisoned is not None:  # its data failed the trainer once: never again
                del self.replay[step]
                log.warning(
                    "step %d is marked poisoned (%s): replayed without its samples", step, poisoned.reason
                )
                missing = [f"{n}#{r}" for n, r in plan.rows(plan.takes)]
                return StepBatch([], plan.dropped, True, missing, {"load": 0.0, "plan": 0.0})
            back = self.planner.replay(plan)  # an I/O error leaves the plan to be tried again
            del self.replay[step]
            timings = dict(self.planner.timings)
            return StepBatch(back.samples, plan.dropped, True, back.missing, timings)
        t, a = self.run.config.trainer, self.run.config.algorithm
        drop = a.staleness_mode == "drop"
        got = self.planner.try_plan(step, t.samples_per_step, version, t.max_staleness, drop, drop_only)
        if got is None:
            return None
        if self.keeper is not None:
            self.keeper.wake.set()  # workers see the planned step at once
        return StepBatch(got[1], got[0].dropped, False, timings=dict(self.planner.timings))

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

    def start_feed(self, write: Callable[[dict[str, Any]], None]) -> None:
        """Rank 0 starts refreshing the feed fields through ``write`` (the status record's writer)."""
        if self.keeper is not None:
            self.keeper.start(write)

    def counts(self) -> dict[str, Any]:
        """The feed fields as last refreshed and the shards this trainer quarantined (rank 0)."""
        if self.planner is None or self.keeper is None:
            return {}
        return {**self.keeper.last, "quarantined": self.planner.cache.quarantined}

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True)  # a plan being written is finished, never cut
        if self.hint is not None:
            self.hint.close()
