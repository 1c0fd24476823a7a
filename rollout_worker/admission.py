"""What a rollout worker judges by before it starts a batch: the samples the trainer will have without it.

One read of one small file per check, whatever the run's length or the fleet's size: the trainer's record
(``status/trainer.json``), whose feed fields its rank 0 rewrites about once a second (``trainer/feed.py``): the
backlog it counted, the highest step it planned, and each live worker's ``in_flight`` and ``published_samples`` read
just before it counted.  The worker adds what that count cannot cover yet: the samples it published since (its own
``published_samples`` against the trainer's copy of it) and the ones it holds.

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

from buffer.heartbeats import load_trainer
from buffer.layout import RunLayout
from buffer.records import RecordError, TrainerStatus
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
    ):
        self.layout = layout
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
        mine = rec.fleet.get(self.worker_id)
        seen = mine.published_samples if mine is not None and mine.incarnation == self.incarnation else 0
        others = sum(e.in_flight for w, e in rec.fleet.items() if w != self.worker_id)
        unconsumed = rec.unconsumed_samples + max(0, published - seen)
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
