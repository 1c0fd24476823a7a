"""The trainer's consumption log: exactly-once consumption of samples across crashes and restarts.

Before each step, the trainer's rank 0 writes a plan (``plans/step-XXXXXXXX.eE.json``: ``step``, ``epoch``,
``shards``, ``sample_ids``, ``dropped_ids``) durably, then trains on it.  A checkpoint records the last trained step;
after a crash, steps after the checkpoint replay their recorded plans instead of planning anew.  A sample is consumed
when it is in a valid plan (trained, or dropped as too stale); a sample that was never planned stays available.

Fencing.  Each trainer incarnation claims an epoch by exclusive creation of ``plans/epochs/EEEEEE.json``, recording
the highest valid plan step it saw (``max_step``).  A plan of epoch e for step s is valid only if s <= max_step of
every later epoch: a zombie incarnation (an old Slurm job after a requeue) can only have written plans with higher
steps after the newer one claimed, so whatever it writes is ignored, whatever the timing.  ``write_plan`` also
refuses outright once a newer epoch exists.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .fsio import HOST, create_json_exclusive, read_json_or_none
from .layout import RunLayout

_PLAN_RE = re.compile(r"^step-(\d{8})\.e(\d+)\.json$")


class FencedError(RuntimeError):
    """This trainer incarnation has been superseded by a newer one and must stop."""


@dataclass(frozen=True)
class Plan:
    step: int
    epoch: int
    shards: list[str]
    sample_ids: list[str]
    dropped_ids: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "shards": self.shards,
            "sample_ids": self.sample_ids,
            "dropped_ids": self.dropped_ids,
            "extra": self.extra,
            "created_at": time.time(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(
            int(d["step"]),
            int(d["epoch"]),
            list(d["shards"]),
            list(d["sample_ids"]),
            list(d.get("dropped_ids", [])),
            dict(d.get("extra", {})),
        )


def _epoch_claims(layout: RunLayout) -> dict[int, int]:
    """epoch -> max valid plan step at the time it was claimed."""
    out = {}
    try:
        names = os.listdir(layout.epochs)
    except FileNotFoundError:
        return {}
    for n in names:
        if n.endswith(".json") and n[:-5].isdigit():
            rec = read_json_or_none(layout.epochs / n)
            if isinstance(rec, dict):
                out[int(n[:-5])] = int(rec.get("max_step", 0))
    return out


def _plan_files(layout: RunLayout) -> list[tuple[int, int, str]]:
    try:
        names = os.listdir(layout.plans)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        m = _PLAN_RE.match(n)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), n))
    return sorted(out)


def valid_plans(layout: RunLayout) -> dict[int, Plan]:
    """step -> the one valid plan of that step (fenced-out zombie plans are ignored)."""
    claims = _epoch_claims(layout)
    out: dict[int, Plan] = {}
    for step, epoch, name in _plan_files(layout):
        if any(e > epoch and step > max_step for e, max_step in claims.items()):
            continue
        rec = read_json_or_none(layout.plans / name)
        if isinstance(rec, dict):
            out[step] = Plan.from_json(rec)
    return out


def consumed_ids(plans: Iterable[Plan]) -> set[str]:
    out: set[str] = set()
    for p in plans:
        out.update(p.sample_ids)
        out.update(p.dropped_ids)
    return out


class PlanLog:
    """One trainer incarnation's handle on the consumption log (used by rank 0 only)."""

    def __init__(self, layout: RunLayout, epoch: int):
        self.layout = layout
        self.epoch = epoch

    @classmethod
    def claim(cls, layout: RunLayout) -> PlanLog:
        """Start a new incarnation: claim the next epoch, fencing out every older one."""
        layout.epochs.mkdir(parents=True, exist_ok=True)
        while True:
            claims = _epoch_claims(layout)
            epoch = max(claims, default=0) + 1
            max_step = max(valid_plans(layout), default=0)
            rec = {"epoch": epoch, "max_step": max_step, "host": HOST, "pid": os.getpid(), "at": time.time()}
            if create_json_exclusive(layout.epoch(epoch), rec):
                return cls(layout, epoch)

    def check_not_fenced(self) -> None:
        newer = [e for e in _epoch_claims(self.layout) if e > self.epoch]
        if newer:
            raise FencedError(
                f"{self.layout.epoch(max(newer))}: a newer trainer incarnation (epoch {max(newer)}) "
                f"took over from epoch {self.epoch}; this process must stop"
            )

    def plans(self) -> dict[int, Plan]:
        return valid_plans(self.layout)

    def write_plan(
        self,
        step: int,
        shards: list[str],
        sample_ids: list[str],
        dropped_ids: list[str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Plan:
        """Durably record what ``step`` consumes, before training on it."""
        self.check_not_fenced()
        existing = self.plans().get(step)
        if existing is not None:
            raise FileExistsError(f"{self.layout.plans}: step {step} already has a plan; replay it instead")
        plan = Plan(step, self.epoch, shards, sample_ids, dropped_ids or [], extra or {})
        if not create_json_exclusive(self.layout.plan(step, self.epoch), plan.to_json()):
            raise FileExistsError(f"{self.layout.plan(step, self.epoch)}: exists with other content")
        return plan

    def replay(self, after_step: int) -> list[Plan]:
        """Plans of steps after the checkpoint, in order: they must be trained again, exactly as recorded."""
        return [p for s, p in sorted(self.plans().items()) if s > after_step]
