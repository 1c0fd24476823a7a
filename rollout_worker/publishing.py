"""Writing whole groups into shards: the worker's only way of publishing experience.

Scored groups wait here until there are ``rollout.shard_samples`` samples of them, or the oldest has waited
``rollout.flush_interval_s``; then they go out as shards (``ShardWriter``: tmp, fsync, rename), each shard holding
whole groups only, so the trainer never sees part of a group.  Every publication happens under the worker's I/O lock,
so a process that must end at once can wait for the shard in flight instead of abandoning its temporary; and none
happens once ``may_publish`` says no (the worker's slot is no longer its own): the groups are dropped instead,
unconsumed, never published twice under one worker id.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from buffer.shards import ShardWriter

Group = list[dict]


class GroupPublisher:
    def __init__(
        self,
        writer: ShardWriter,
        *,
        shard_samples: int,
        flush_interval_s: float,
        io_lock: threading.RLock,
        may_publish: Callable[[], bool],
    ):
        self.writer = writer
        self.shard_samples = shard_samples
        self.flush_interval_s = flush_interval_s
        self.io_lock = io_lock
        self.may_publish = may_publish
        self.groups: list[Group] = []  # complete, scored groups not yet published
        self.oldest_since: float | None = None  # when the oldest waiting group arrived
        self.shards = 0
        self.published_samples = 0  # of this incarnation: what the trainer's feed record copies

    @property
    def pending_samples(self) -> int:
        return sum(len(g) for g in self.groups)

    def add(self, groups: list[Group]) -> None:
        if groups and not self.groups:
            self.oldest_since = time.monotonic()
        self.groups.extend(groups)

    def publish(self, *, everything: bool = False) -> int:
        """Publish what is due (``everything``: all of it); returns the number of shards written."""
        due = everything or (
            self.oldest_since is not None and time.monotonic() - self.oldest_since >= self.flush_interval_s
        )
        written = 0
        while self.groups and (due or self.pending_samples >= self.shard_samples):
            if not self._publish_one():
                break
            written += 1
        if written:
            self.oldest_since = time.monotonic() if self.groups else None
        return written

    def _publish_one(self) -> bool:
        """One shard of whole groups, at most ``shard_samples`` samples unless a single group is larger."""
        with self.io_lock:
            if not self.may_publish():
                self.discard()
                return False
            taken = 0
            while self.groups and (taken == 0 or taken + len(self.groups[0]) <= self.shard_samples):
                group = self.groups.pop(0)
                for row in group:
                    self.writer.add(row)
                taken += len(group)
            self.writer.flush()
            self.shards += 1
            self.published_samples += taken
        return True

    def discard(self) -> int:
        """Drop every waiting group (nothing partial is ever published); returns the samples dropped."""
        n = self.pending_samples + self.writer.discard()
        self.groups = []
        self.oldest_since = None
        return n
