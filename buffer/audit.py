"""``shardrl audit RUN``: the run's sample ledger from its files alone, across every trainer restart and epoch.

For each writer incarnation (``worker.incarnation``): the samples it generated (the rows its shard names say, in
``ready/`` and ``quarantine/``), consumed by the trainer (once each: trained or dropped as stale, from every valid
plan), quarantined (with the reasons), still waiting (rows of ready shards no plan took), and lost: samples a
worker's own status record says it published that are in no shard (zero expected).  A duplicate is a row two plans
consumed, or a writer's shard consumed under two names (a copy trained twice).  ``ok`` is false on a duplicate or a
loss.

It reads every shard name, plan and status record once; it never reads a shard's contents.  Memory: a counter per
writer incarnation, and the consumed row ranges of each shard a plan names.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from .buckets import ShardName
from .heartbeats import load_workers
from .layout import RunLayout
from .plans import add_range, count_rows, valid_plans, writer_seq


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
    ready: dict[str, int] = {}
    for bucket in sorted(_names_or_dirs(str(layout.shards_ready))):
        for name in _names(os.path.join(layout.shards_ready, bucket)):
            ws, rows = writer_seq(name), _rows_of(name)
            if ws is not None and rows is not None:
                ready[name] = rows
                writers[ws[0]].generated += rows
    reasons: Counter[str] = Counter()
    for name in _names(str(layout.shards_quarantine)):
        ws, rows = writer_seq(name), _rows_of(name)
        if ws is None or rows is None:
            continue
        writers[ws[0]].generated += rows
        writers[ws[0]].quarantined += rows
        reasons[_reason(layout, name)] += 1
    led.quarantine_reasons = dict(reasons)
    _consume(layout, led, writers, ready)
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


def _consume(
    layout: RunLayout, led: Ledger, writers: defaultdict[str, WriterLedger], ready: dict[str, int]
) -> None:
    """Every valid plan once: the rows it consumed, a row consumed twice, a writer's shard under two names."""
    consumed: dict[str, list[list[int]]] = {}
    names_of: dict[tuple[str, int], set[str]] = defaultdict(set)
    plans = valid_plans(layout, led.problems)
    led.steps = max(plans, default=0)
    for step, plan in sorted(plans.items()):
        for kind, ranges in (("consumed", plan.takes), ("dropped_stale", plan.drops)):
            for i, a, b in ranges:
                name = plan.shards[i]
                if not add_range(consumed.setdefault(name, []), a, b):
                    led.duplicates.append(
                        f"step {step}: rows {a}..{b} of {name} were consumed by an earlier plan"
                    )
                    continue
                ws = writer_seq(name)
                if ws is None:
                    continue
                names_of[ws].add(name)
                writers[ws[0]].consumed += b - a
                if kind == "dropped_stale":
                    writers[ws[0]].dropped_stale += b - a
    for (key, seq), names in sorted(names_of.items()):
        if len(names) > 1:
            led.duplicates.append(f"shard {seq} of writer {key} was consumed under {len(names)} names")
    for name, rows in ready.items():
        ws = writer_seq(name)
        if ws is not None:
            writers[ws[0]].waiting += rows - count_rows(consumed.get(name, ()))
    present = set(ready) | set(_names(str(layout.shards_quarantine)))
    for name, ranges in consumed.items():
        ws = writer_seq(name)
        if ws is not None and name not in present:
            writers[ws[0]].consumed_gone += count_rows(ranges)
