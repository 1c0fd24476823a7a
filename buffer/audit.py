"""``shardrl audit RUN``: the run's sample ledger from its files alone, across every trainer restart and epoch.

For each writer incarnation (``worker.incarnation``): the samples it generated (the rows its shard names say, in
``ready/`` and ``quarantine/``), consumed by the trainer (once each: trained or dropped as stale, from every valid
plan), quarantined (with the reasons), still waiting (rows of ready shards no plan took), and lost: samples a
worker's own status record says it published that are in no shard (zero expected).  A duplicate is a row two plans
consumed, or a writer's shard consumed under two names (a copy trained twice).  ``ok`` is false on a duplicate or a
loss.

It reads every shard name, plan and status record once; it never reads a shard's contents.  Memory does not grow
with the run's length: one plan bucket's plans at a time, a counter and the intervals of wholly consumed shard seqs
per writer incarnation, the row ranges of the shards only partly consumed (about the backlog), and one shard
bucket's names at a time.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from .buckets import ShardName
from .heartbeats import load_workers
from .layout import RunLayout
from .plans import add_range, count_rows, valid_plans_in_order, writer_seq


@dataclass
class WriterLedger:
    generated: int = 0
    consumed: int = 0
    dropped_stale: int = 0
    quarantined: int = 0
    waiting: int = 0
    published: int | None = None  # what the writer's status record says it published (its latest incarnation)
    consumed_gone: int = 0  # consumed from shards no longer in the run directory (deleted since: not lost)
    lost: int = 0


@dataclass
class Ledger:
    writers: dict[str, WriterLedger] = field(default_factory=dict)
    steps: int = 0
    duplicates: list[str] = field(default_factory=list)  # one line each
    quarantine_reasons: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # unreadable plans and the like

    @property
    def lost(self) -> int:
        return sum(w.lost for w in self.writers.values())

    @property
    def ok(self) -> bool:
        return not self.duplicates and self.lost == 0 and not self.problems

    def totals(self) -> dict[str, int]:
        keys = ("generated", "consumed", "dropped_stale", "quarantined", "waiting", "consumed_gone", "lost")
        return {k: sum(getattr(w, k) for w in self.writers.values()) for k in keys}

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "steps": self.steps,
            "totals": self.totals(),
            "writers": {k: asdict(v) for k, v in sorted(self.writers.items())},
            "duplicates": self.duplicates,
            "quarantine_reasons": self.quarantine_reasons,
            "problems": self.problems,
        }


def _rows_of(name: str) -> int | None:
    shard = ShardName.parse(name)
    return None if shard is None else shard.rows


def _names(directory: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if n.endswith(".arrow") and not n.startswith(".")]
    except FileNotFoundError:
        return []


def audit(layout: RunLayout) -> Ledger:
    led = Ledger()
    writers: defaultdict[str, WriterLedger] = defaultdict(WriterLedger)
    done = _consume(layout, led, writers)
    present: defaultdict[str, int] = defaultdict(
        int
    )  # consumed rows of the shards still in the run directory
    for bucket in sorted(_names_or_dirs(str(layout.shards_ready))):  # one bucket's names in memory at a time
        for name in _names(os.path.join(layout.shards_ready, bucket)):
            ws, rows = writer_seq(name), _rows_of(name)
            if ws is None or rows is None:
                continue
            taken = done.rows(name)
            writers[ws[0]].generated += rows
            writers[ws[0]].waiting += max(0, rows - taken)
            present[ws[0]] += taken
    reasons: Counter[str] = Counter()
    for name in _names(str(layout.shards_quarantine)):
        ws, rows = writer_seq(name), _rows_of(name)
        if ws is None or rows is None:
            continue
        writers[ws[0]].generated += rows
        writers[ws[0]].quarantined += rows
        present[ws[0]] += done.rows(name)
        reasons[_reason(layout, name)] += 1
    led.quarantine_reasons = dict(reasons)
    for key, w in writers.items():
        w.consumed_gone = max(0, w.consumed - present[key])
    for rec in load_workers(layout).records:  # each worker's latest incarnation says what it published
        if not rec.incarnation:
            continue
        w = writers[f"{rec.id}.{rec.incarnation}"]
        w.published = rec.published_samples
        w.lost = max(0, rec.published_samples - w.generated - w.consumed_gone)
    led.writers = dict(writers)
    return led


def _names_or_dirs(directory: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if n.startswith("b") and not n.startswith(".")]
    except FileNotFoundError:
        return []


def _reason(layout: RunLayout, name: str) -> str:
    try:
        with open(layout.quarantine_reason(name)) as f:
            reason = str(json.load(f).get("reason", "?"))
    except (OSError, ValueError, AttributeError):
        return "(no reason file)"
    return reason.split(":")[0][:80]


class _Consumed:
    """What the plans consumed so far, in memory that does not grow with the run: the row ranges of each shard some
    of whose rows are still unconsumed, and per writer incarnation the seqs of its shards consumed whole, as
    intervals (a writer's shards are consumed roughly in seq order, so a few intervals each)."""

    def __init__(self) -> None:
        self.partial: dict[str, list[list[int]]] = {}
        self.names: defaultdict[tuple[str, int], set[str]] = defaultdict(set)  # of partially consumed shards
        self.whole: defaultdict[str, list[list[int]]] = defaultdict(list)
        self.copies: list[str] = []  # a writer's shard consumed under two names (a copy trained twice)

    def whole_seq(self, writer: str, seq: int) -> bool:
        ranges = self.whole.get(writer, [])
        i = bisect.bisect_right(ranges, [seq, math.inf]) - 1
        return i >= 0 and ranges[i][0] <= seq < ranges[i][1]

    def take(self, name: str, a: int, b: int) -> str | None:
        """Rows [a, b) of ``name`` consumed; a line naming the duplicate when some were consumed before (then they
        are not counted again)."""
        ws, rows = writer_seq(name), _rows_of(name)
        if ws is not None and self.whole_seq(*ws):
            # its name is gone from memory: a copy (the shard under 2 names) or the same name again, trained twice
            return (
                f"rows {a}..{b} of {name}: shard {ws[1]} of writer {ws[0]} was consumed whole by an earlier plan "
                "(under 2 names, or twice under this one)"
            )
        ranges = self.partial.setdefault(name, [])
        if not add_range(ranges, a, b):
            return f"rows {a}..{b} of {name} were consumed by an earlier plan"
        if ws is None:
            return None
        names = self.names[ws]
        names.add(name)
        if rows is not None and count_rows(ranges) >= rows:  # whole now: kept as its writer's seq alone
            del self.partial[name], self.names[ws]
            add_range(self.whole[ws[0]], ws[1], ws[1] + 1)
            if len(names) > 1:
                self.copies.append(f"shard {ws[1]} of writer {ws[0]} was consumed under {len(names)} names")
        return None

    def rows(self, name: str) -> int:
        """How many rows of ``name`` were consumed."""
        ws = writer_seq(name)
        if ws is not None and self.whole_seq(*ws):
            return _rows_of(name) or 0
        return count_rows(self.partial.get(name, ()))


def _consume(layout: RunLayout, led: Ledger, writers: defaultdict[str, WriterLedger]) -> _Consumed:
    """Every valid plan once, a plan bucket at a time: the rows it consumed, a row consumed twice, a writer's shard
    under two names."""
    done = _Consumed()
    for step, plan in valid_plans_in_order(layout, led.problems):
        led.steps = max(led.steps, step)
        for kind, ranges in (("consumed", plan.takes), ("dropped_stale", plan.drops)):
            for i, a, b in ranges:
                name = plan.shards[i]
                duplicate = done.take(name, a, b)
                if duplicate is not None:
                    led.duplicates.append(f"step {step}: {duplicate}")
                    continue
                ws = writer_seq(name)
                if ws is None:
                    continue
                writers[ws[0]].consumed += b - a
                if kind == "dropped_stale":
                    writers[ws[0]].dropped_stale += b - a
    led.duplicates += done.copies
    for (key, seq), names in sorted(done.names.items()):
        if len(names) > 1:
            led.duplicates.append(f"shard {seq} of writer {key} was consumed under {len(names)} names")
    return done
