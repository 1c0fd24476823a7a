"""The trainer's consumption log: exactly-once consumption of samples across crashes and restarts.

Before each step, the trainer's rank 0 writes a plan (``plans/step-XXXXXXXX.eE.json``: ``step``, ``epoch``,
``shards``, ``sample_ids``, ``dropped_ids``) durably, then trains on it.  A checkpoint records the last trained step;
after a crash, steps after the checkpoint replay their recorded plans instead of planning anew.  A sample is consumed
when it is in a valid plan (trained, or dropped as too stale); a sample that was never planned stays available.

Plans and epoch claims are ``records.Plan`` / ``records.EpochClaim``; one that is not a valid record is an error
(RecordError), never skipped: exactly-once cannot be decided without it.

Fencing.  Each trainer incarnation claims the next epoch with ``fsio.claim_next`` (``plans/epochs/EEEEEE.json``),
recording the highest plan step it knows of (``max_step``).  A plan of epoch e for step s is valid only if s <=
max_step of every later epoch: a zombie incarnation (an old Slurm job after a requeue) can only have written plans
with higher steps after the newer one claimed, so whatever it writes is ignored, whatever the timing.  ``write_plan``
also refuses outright once a newer epoch exists.

A plan can exist before a claim and still be invisible to the claimer's node (NFS caches lookups and listings for
up to a minute).  So that such a plan is not fenced out (and its samples trained twice), ``max_step`` also covers
what no listing is needed for: each incarnation replaces ``plans/epochs/EEEEEE.progress.json`` with step s before
it checks its fence and creates plan s, and the claimer reads those by name; and the step of the checkpoint the
claimer resumes from (``resumed_step``), whose plans were trained for certain.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from .fsio import HOST, claim_next, make_dirs
from .layout import RunLayout
from .records import EpochClaim, EpochProgress, Plan, RecordError, create_record, read_record, write_record

_PLAN_RE = re.compile(r"^step-(\d{8})\.e(\d+)\.json$")


class FencedError(RuntimeError):
    """This trainer incarnation has been superseded by a newer one and must stop."""


class PlanFile(NamedTuple):
    step: int
    epoch: int
    path: Path


def _epoch_claims(layout: RunLayout) -> dict[int, int]:
    """epoch -> max valid plan step at the time it was claimed.  A claim that is not a valid record raises
    RecordError: fencing cannot be decided without it."""
    out = {}
    try:
        names = os.listdir(layout.epochs)
    except FileNotFoundError:
        return {}
    for n in names:
        if n.endswith(".json") and n[:-5].isdigit():
            epoch = int(n[:-5])
            claim = read_record(EpochClaim, layout.epoch(epoch))
            if claim.epoch != epoch:
                raise RecordError(
                    layout.epoch(epoch), "epoch", f"is {claim.epoch}, the file name says {epoch}"
                )
            out[epoch] = claim.max_step
    return out


def _plan_files(layout: RunLayout) -> list[PlanFile]:
    try:
        names = os.listdir(layout.plans)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        m = _PLAN_RE.match(n)
        if m:
            out.append(PlanFile(int(m.group(1)), int(m.group(2)), layout.plans / n))
    return sorted(out)


def _announced_step(layout: RunLayout, epoch: int) -> int:
    """The highest step any incarnation before ``epoch`` announced (read by name: no listing to be stale)."""
    best = 0
    for e in range(1, epoch):
        try:
            progress = read_record(EpochProgress, layout.epoch_progress(e), attempts=3)
        except FileNotFoundError:
            continue  # an incarnation that never planned a step
        if progress.epoch != e:
            raise RecordError(
                layout.epoch_progress(e), "epoch", f"is {progress.epoch}, the file name says {e}"
            )
        best = max(best, progress.step)
    return best


def valid_plan_files(layout: RunLayout) -> dict[int, PlanFile]:
    """step -> the file of that step's one valid plan (fenced-out zombie plans are left out), without reading it."""
    claims = _epoch_claims(layout)
    out: dict[int, PlanFile] = {}
    for f in _plan_files(layout):
        if not any(e > f.epoch and f.step > max_step for e, max_step in claims.items()):
            out[f.step] = f
    return out


def read_plan(f: PlanFile) -> Plan:
    """The plan in ``f``; RecordError when it is not a valid plan or not the one its name says."""
    plan = read_record(Plan, f.path)
    for name, expected in (("step", f.step), ("epoch", f.epoch)):
        if getattr(plan, name) != expected:
            raise RecordError(f.path, name, f"is {getattr(plan, name)}, the file name says {expected}")
    return plan


def valid_plans(layout: RunLayout, problems: list[str] | None = None) -> dict[int, Plan]:
    """step -> the one valid plan of that step (fenced-out zombie plans are ignored).

    A plan file that is not a valid record raises RecordError, or, when ``problems`` is given (a status view), is
    reported there and left out.
    """
    out: dict[int, Plan] = {}
    for step, f in valid_plan_files(layout).items():
        try:
            out[step] = read_plan(f)
        except RecordError as e:
            if problems is None:
                raise
            problems.append(str(e))
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
    def claim(cls, layout: RunLayout, resumed_step: int = 0) -> PlanLog:
        """Start a new incarnation: claim the next epoch, fencing out every older one.

        ``resumed_step`` is the step of the checkpoint this incarnation resumes from (0 for none): its plans stay
        valid even where this node cannot list them yet.
        """
        make_dirs(layout.epochs)

        def claim_record(epoch: int) -> bytes:
            # what this incarnation knows right before the claim: plans up to here stay valid
            max_step = max(
                max(valid_plan_files(layout), default=0), _announced_step(layout, epoch), resumed_step
            )
            return EpochClaim(
                epoch=epoch, max_step=max_step, host=HOST, pid=os.getpid(), at=time.time()
            ).to_bytes()

        epoch = claim_next(layout.epoch, claim_record, first=max(_epoch_claims(layout), default=0) + 1)
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
        # announced before the fence check: a claim that this check cannot see yet will count this step as known
        write_record(
            self.layout.epoch_progress(self.epoch), EpochProgress(epoch=self.epoch, step=step, at=time.time())
        )
        self.check_not_fenced()
        if step in valid_plan_files(self.layout):
            raise FileExistsError(f"{self.layout.plans}: step {step} already has a plan; replay it instead")
        plan = Plan(
            step=step,
            epoch=self.epoch,
            shards=shards,
            sample_ids=sample_ids,
            dropped_ids=dropped_ids or [],
            extra=extra or {},
        )
        if not create_record(self.layout.plan(step, self.epoch), plan):
            raise FileExistsError(f"{self.layout.plan(step, self.epoch)}: exists with other content")
        return plan

    def replay(self, after_step: int) -> list[Plan]:
        """Plans of steps after the checkpoint, in order: they must be trained again, exactly as recorded."""
        return [p for s, p in sorted(self.plans().items()) if s > after_step]
