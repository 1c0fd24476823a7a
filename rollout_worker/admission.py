"""What a rollout worker judges by before it starts a batch: the samples the trainer will have without it.

Two reads of small files per check, whatever the run's length or the fleet's size.  The trainer's record
(``status/trainer.json``), whose feed fields its rank 0 rewrites about once a second (``trainer/feed.py``): the
backlog it counted, the highest step it planned, and the live workers' ``in_flight`` and ``published_samples`` read
just before it counted, summed per node from each node supervisor's record (``nodes``; per worker only for workers
no live supervisor lists, ``fleet``), so the record grows with the nodes, not the workers.  And our own supervisor's
record, which lists our node's workers now.  The worker adds what the trainer's count cannot cover yet: what our
node published since (its counts now against the trainer's copy of their sum) and the samples it holds; the other
nodes' batches are counted as the trainer last saw them, our node-mates' as their supervisor lists them now.

Without a live trainer (none started yet, or its feed has not changed for ``max_age_s``) no fleet view exists: the
worker counts the backlog itself from the consumption log (``buffer.status.BacklogCounter``: the newest summary, the
plans after it, the buckets that may hold unconsumed shards; bounded, whatever the run's length), at most once per
``fallback_every_s``; the other workers' batches are then not counted, so a fleet with no trainer overshoots by at
most a batch a worker, into a backlog the trainer takes when it comes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from buffer.heartbeats import load_supervisor, load_trainer
from buffer.layout import RunLayout
from buffer.records import RecordError, SupervisedWorker, TrainerStatus
from buffer.status import BacklogCounter


@dataclass(frozen=True)
class View:
    coming: (
        int  # samples the trainer will have without a batch of ours: backlog, ours waiting, others' batches
    )
    backlog: int  # unconsumed samples of the run plus ours waiting (what the status record shows)
    planned_step: int  # the highest step the trainer has planned
    trainer: TrainerStatus | None  # the record read for this view (None: no trainer record)
    live: bool  # the record's feed is fresh


class Admission:
    """A worker's view of the run's backlog, from the trainer's record (``view``)."""

    def __init__(
        self,
        layout: RunLayout,
        worker_id: str,
        incarnation: str,
        *,
        max_age_s: float,
        fallback_every_s: float,
        supervisor: str | None = None,
    ):
        self.layout = layout
        # our node's supervisor, whose record the trainer's feed reads for our node
        self.supervisor = supervisor
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.max_age_s = max_age_s
        self.fallback_every_s = fallback_every_s
        self._listed_at = -math.inf
        self._listed: tuple[int, int, int] = (
            0,
            0,
            0,
        )  # (unconsumed, planned step, our published_samples then)
        self._counter: BacklogCounter | None = None

    def mates(self) -> list[SupervisedWorker] | None:
        """The other workers of our node as our supervisor's record lists them now (None: no such record)."""
        if self.supervisor is None:
            return None
        try:
            rec = load_supervisor(self.layout, self.supervisor)
        except (RecordError, OSError):
            return None
        if rec is None:
            return None
        return [
            w for w in rec.workers.values() if w.worker_id != self.worker_id and w.incarnation is not None
        ]

    def view(self, published: int, pending: int) -> View:
        """``published``: samples this incarnation has published; ``pending``: samples it holds unpublished."""
        try:
            rec = load_trainer(self.layout)
        except (RecordError, OSError):
            rec = None  # unreadable for a moment: judged as if no trainer ran
        if rec is not None and self._live(rec):
            return self._from_feed(rec, published, pending)
        unconsumed, planned = self._count_ourselves(published)
        if rec is not None:
            planned = max(planned, rec.planned_step)
        return View(unconsumed + pending, unconsumed + pending, planned, rec, False)

    def _live(self, rec: TrainerStatus) -> bool:
        return (
            rec.feed_at is not None and rec.state != "stopped" and time.time() - rec.feed_at < self.max_age_s
        )

    def _from_feed(self, rec: TrainerStatus, published: int, pending: int) -> View:
        others = sum(e.in_flight for w, e in rec.fleet.items() if w != self.worker_id)
        others += sum(n.in_flight for k, n in rec.nodes.items() if k != self.supervisor)
        node = rec.nodes.get(self.supervisor) if self.supervisor is not None else None
        if node is None:  # the trainer read our own record: our published count as it saw it
            mine = rec.fleet.get(self.worker_id)
            seen = mine.published_samples if mine is not None and mine.incarnation == self.incarnation else 0
            since = max(0, published - seen)
        else:  # it read our node's sums: our node's counts now, against them
            mates = self.mates()
            if (
                mates is None
            ):  # unreadable for a moment: the node's batches as the trainer saw them (ours too)
                others, since = others + node.in_flight, 0
            else:
                others += sum(m.in_flight for m in mates)
                since = max(0, published + sum(m.published_samples for m in mates) - node.published_samples)
        unconsumed = rec.unconsumed_samples + since
        return View(unconsumed + pending + others, unconsumed + pending, rec.planned_step, rec, True)

    def _count_ourselves(self, published: int) -> tuple[int, int]:
        """(unconsumed samples, highest planned step), counted from the files at most once per fallback_every_s;
        in between, our own shards published since are added."""
        now = time.monotonic()
        if now - self._listed_at >= self.fallback_every_s:
            if self._counter is None:
                self._counter = BacklogCounter(self.layout)
            try:
                b = self._counter.read([])
                self._listed = (b.unconsumed_samples, b.planned_step, published)
            except (RecordError, OSError):
                pass  # the log unreadable for a moment: the last count stands
            self._listed_at = now
        unconsumed, planned, published_then = self._listed
        return unconsumed + max(0, published - published_then), planned
