"""Shard names and the ready buckets: what a directory listing says without opening a file (no pyarrow here).

Shard names ``b<bucket>.<worker>.<incarnation>.<seq>.n<rows>.<crc32>.arrow`` never collide: the incarnation is
random per process start, so a requeued Slurm job cannot reuse a name.  The row count in the name lets the backlog be
counted from a listing.  A shard is published into ``shards/ready/b<bucket>/``, the bucket being the publisher's wall
clock at the rename divided by ``layout.BUCKET_S``.  Once a bucket is ``sealed`` (its time is past by more than
SEAL_GRACE_S, which covers clock skew between nodes and a slow rename) no shard can appear in it any more, so its
listing can be kept; only the last few buckets are listed again at each poll, whatever the run's length.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from .fsio import read_json_or_none
from .layout import BUCKET_S, RunLayout

SUFFIX = ".arrow"

# A bucket whose time is past by this much takes no new shard: more than any clock skew between nodes plus the time
# from a publisher's reading of its clock to its rename.
SEAL_GRACE_S = 300.0


def bucket_at(t: float) -> int:
    return int(t // BUCKET_S)


def first_bucket(layout: RunLayout) -> int:
    """The oldest bucket a shard of this run can be in: its creation time, less the clock skew allowed."""
    meta = read_json_or_none(layout.run_json)
    created = meta.get("created_at") if isinstance(meta, dict) else None
    if not isinstance(created, (int, float)):  # no creation time: the oldest bucket there is
        return min(ready_buckets(layout), default=bucket_at(time.time() - SEAL_GRACE_S))
    return max(0, bucket_at(created - SEAL_GRACE_S))


def sealed(bucket: int, now: float) -> bool:
    """Whether no shard can be published into ``bucket`` any more (``now``: this host's wall clock)."""
    return now > (bucket + 1) * BUCKET_S + SEAL_GRACE_S


class ShardError(ValueError):
    """A shard that failed validation; ``reason`` is the one-line cause recorded in quarantine."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class ShardName:
    bucket: int
    worker_id: str
    incarnation: str
    seq: int
    rows: int
    crc: int

    @property
    def name(self) -> str:
        return (
            f"b{self.bucket:09d}.{self.worker_id}.{self.incarnation}.{self.seq:06d}.n{self.rows}."
            f"{self.crc:08x}{SUFFIX}"
        )

    @classmethod
    def parse(cls, name: str) -> ShardName | None:
        if not name.endswith(SUFFIX) or name.startswith("."):
            return None
        parts = name[: -len(SUFFIX)].split(".")
        if len(parts) != 6 or not parts[0].startswith("b") or not parts[4].startswith("n"):
            return None
        try:
            return cls(
                int(parts[0][1:]), parts[1], parts[2], int(parts[3]), int(parts[4][1:]), int(parts[5], 16)
            )
        except ValueError:
            return None


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


def ready_buckets(layout: RunLayout) -> list[int]:
    """Every bucket of ready/ (a listing of the top level: for checks and tools, not for polls)."""
    try:
        names = os.listdir(layout.shards_ready)
    except FileNotFoundError:
        return []
    return sorted(int(n[1:]) for n in names if n.startswith("b") and n[1:].isdigit())


def list_bucket(layout: RunLayout, bucket: int) -> list[ShardName]:
    """Complete shards of one bucket; foreign files are ignored, and so is a shard whose name says another bucket."""
    try:
        names = os.listdir(layout.ready_bucket(bucket))
    except FileNotFoundError:
        return []
    return [s for n in names if (s := ShardName.parse(n)) is not None and s.bucket == bucket]


def list_ready(layout: RunLayout, buckets: Iterable[int] | None = None) -> list[ShardName]:
    """Complete shards in ready/ (of ``buckets``, or of every bucket), oldest sequence first per worker."""
    chosen = ready_buckets(layout) if buckets is None else buckets
    parsed = [s for b in chosen for s in list_bucket(layout, b)]
    return sorted(parsed, key=lambda s: (s.worker_id, s.incarnation, s.seq))


SCAN_LIMIT = (
    64  # buckets: past this many, ``BucketLister`` lists the top level instead of looking each one up
)


class BucketLister:
    """Lists the ready buckets from ``first`` on, again and again, keeping the listing of every sealed bucket.

    A poll costs one listing per bucket that can still change (the last ``SEAL_GRACE_S / BUCKET_S + 2`` or so),
    whatever the run's length.  ``first`` only moves forward (``advance``): buckets before it hold nothing unconsumed.
    Safe to share between threads.
    """

    def __init__(self, layout: RunLayout, first: int):
        self.layout = layout
        self.first = first
        self._sealed: dict[int, list[ShardName]] = {}
        self._lock = threading.Lock()

    def advance(self, first: int) -> None:
        with self._lock:
            if first > self.first:
                self.first = first
                for b in [b for b in self._sealed if b < first]:
                    del self._sealed[b]

    def forget(self, name: str) -> None:
        """A shard moved out of ready/ (quarantined): drop it from the kept listings."""
        parsed = ShardName.parse(name)
        with self._lock:
            if parsed is not None and parsed.bucket in self._sealed:
                self._sealed[parsed.bucket] = [s for s in self._sealed[parsed.bucket] if s.name != name]

    def list(self, now: float | None = None) -> list[ShardName]:
        now = time.time() if now is None else now
        with self._lock:
            first = self.first
        out: list[ShardName] = []
        last = bucket_at(now) + 1  # +1: a publisher whose clock runs ahead of ours
        if last - first > SCAN_LIMIT:
            # far behind (a trainer catching up on hours of shards): one listing of the top level finds the
            # buckets that exist, instead of a lookup per bucket of every minute since
            chosen = [b for b in ready_buckets(self.layout) if first <= b <= last]
        else:
            chosen = list(range(first, last + 1))
        for b in chosen:
            with self._lock:
                kept = self._sealed.get(b)
            if kept is None:
                kept = list_bucket(self.layout, b)
                if sealed(b, now):
                    with self._lock:
                        self._sealed[b] = kept
            out.extend(kept)
        return sorted(out, key=lambda s: (s.worker_id, s.incarnation, s.seq))


def ready_sample_count(shards: Iterable[ShardName]) -> int:
    return sum(s.rows for s in shards)
