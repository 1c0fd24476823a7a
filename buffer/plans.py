"""The trainer's consumption log: exactly-once consumption of samples across crashes and restarts.

Before each step, the trainer's rank 0 writes a plan (``plans/sSSSSS/step-XXXXXXXX.eE.json``: ``step``, ``epoch``,
``shards`` and the row ranges of them it trains, ``takes``, and drops, ``drops``) durably, then trains on it.  A
checkpoint records the last trained step; after a crash, steps after the checkpoint replay their recorded plans
instead of planning anew.  A sample (a row of a shard) is consumed when it is in a valid plan (trained, or dropped as
too stale); a sample that was never planned stays available.

What costs stay bounded.  Plans live in buckets of PLAN_BUCKET_STEPS steps, so finding the plans after a step lists
only the buckets from there on.  Every SUMMARY_EVERY steps rank 0 writes a summary (``records.LogSummary``: the
consumed rows of the shards that may still hold unconsumed ones, and the totals); a resumed trainer reads the newest
valid summary and the plans after it (``Consumption.load``): a few MB whatever the run's length.  Summaries are valid
by the same rule as plans, so a fenced-out incarnation's summary is ignored like its plans; plans are never deleted,
so a missing or damaged summary only costs reading more of them.

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

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from .buckets import ShardName
from .fsio import HOST, claim_next, make_dirs
from .layout import PLAN_BUCKET_STEPS, RunLayout
from .records import (
    EpochClaim,
    EpochProgress,
    LogSummary,
    Plan,
    PoisonedStep,
    RecordError,
    RowRange,
    create_record,
    read_record,
    write_record,
)

_PLAN_RE = re.compile(r"^step-(\d{8})\.e(\d+)\.json$")
_BUCKET_RE = re.compile(r"^s(\d{5})$")
SUMMARY_EVERY = (
    50  # steps between summaries: a resumed trainer reads at most this many plans past the newest one
)
SUMMARIES_KEPT = 3


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


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def plan_buckets(layout: RunLayout) -> list[int]:
    return sorted(int(m.group(1)) for n in _listdir(layout.plans) if (m := _BUCKET_RE.match(n)))


def _files_in(directory: Path) -> list[PlanFile]:
    return [
        PlanFile(int(m.group(1)), int(m.group(2)), directory / n)
        for n in _listdir(directory)
        if (m := _PLAN_RE.match(n))
    ]


def _plan_files(layout: RunLayout, after_step: int = 0) -> list[PlanFile]:
    """Plan files of steps after ``after_step``, listing only the buckets that can hold them."""
    first = after_step // PLAN_BUCKET_STEPS
    out = [f for b in plan_buckets(layout) if b >= first for f in _files_in(layout.plan_bucket(b))]
    return sorted(f for f in out if f.step > after_step)


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


def _valid(step: int, epoch: int, claims: dict[int, int]) -> bool:
    """The fencing rule, for plans and summaries alike: written by ``epoch`` for ``step``, still valid unless a
    later incarnation claimed when ``step`` was past what it knew."""
    return not any(e > epoch and step > max_step for e, max_step in claims.items())


def valid_plan_files(layout: RunLayout, after_step: int = 0) -> dict[int, PlanFile]:
    """step -> the file of that step's one valid plan (fenced-out zombie plans are left out), without reading it;
    only steps after ``after_step``."""
    claims = _epoch_claims(layout)
    return {f.step: f for f in _plan_files(layout, after_step) if _valid(f.step, f.epoch, claims)}


def newest_plan_step(layout: RunLayout) -> int:
    """The highest step with a valid plan (0 for none): lists the newest plan buckets only."""
    claims = _epoch_claims(layout)
    for b in reversed(plan_buckets(layout)):
        steps = [f.step for f in _files_in(layout.plan_bucket(b)) if _valid(f.step, f.epoch, claims)]
        if steps:
            return max(steps)
    return 0


def read_plan(f: PlanFile) -> Plan:
    """The plan in ``f``; RecordError when it is not a valid plan or not the one its name says."""
    plan = read_record(Plan, f.path)
    for name, expected in (("step", f.step), ("epoch", f.epoch)):
        if getattr(plan, name) != expected:
            raise RecordError(f.path, name, f"is {getattr(plan, name)}, the file name says {expected}")
    return plan


def valid_plans(layout: RunLayout, problems: list[str] | None = None, after_step: int = 0) -> dict[int, Plan]:
    """step -> the one valid plan of that step (fenced-out zombie plans are ignored), for steps after
    ``after_step``.

    A plan file that is not a valid record raises RecordError, or, when ``problems`` is given (a status view), is
    reported there and left out.
    """
    out: dict[int, Plan] = {}
    for step, f in valid_plan_files(layout, after_step).items():
        try:
            out[step] = read_plan(f)
        except RecordError as e:
            if problems is None:
                raise
            problems.append(str(e))
    return out


def valid_plans_in_order(layout: RunLayout, problems: list[str]) -> Iterator[tuple[int, Plan]]:
    """(step, plan) of every valid plan in step order, one plan bucket listed and read at a time, so a reader's
    memory holds one bucket's plans (``PLAN_BUCKET_STEPS``) whatever the run's length.  A plan that is not a valid
    record is reported in ``problems`` and left out."""
    claims = _epoch_claims(layout)
    for b in plan_buckets(layout):
        # of two valid files of one step the later epoch's counts, as in valid_plan_files
        files = {
            f.step: f for f in sorted(_files_in(layout.plan_bucket(b))) if _valid(f.step, f.epoch, claims)
        }
        for _, f in sorted(files.items()):
            try:
                plan = read_plan(f)
            except RecordError as e:
                problems.append(str(e))
                continue
            yield f.step, plan


# ------------------------------------------------------------------------------------------- row ranges


def add_range(ranges: list[list[int]], a: int, b: int) -> bool:
    """Add rows [a, b) to sorted, disjoint ``ranges`` (merged in place); False when some row was there already."""
    i = 0
    while i < len(ranges) and ranges[i][1] < a:
        i += 1
    j = i
    while j < len(ranges) and ranges[j][0] <= b:
        if ranges[j][0] < b and a < ranges[j][1]:
            return False  # overlap: a row consumed twice
        j += 1
    lo = min([a, *(r[0] for r in ranges[i:j])])
    hi = max([b, *(r[1] for r in ranges[i:j])])
    ranges[i:j] = [[lo, hi]]
    return True


def cover(ranges: list[list[int]], n: int) -> None:
    """Add ``n`` to sorted, disjoint ``ranges`` (merged in place); nothing when it is there already."""
    if not covers(ranges, n):
        add_range(ranges, n, n + 1)


def covers(ranges: Iterable[list[int]], n: int) -> bool:
    return any(a <= n < b for a, b in ranges)


def writer_seq(text: str) -> tuple[str, int] | None:
    """``("worker.incarnation", seq)`` of a shard's name (``bBBBBBBBBB.W.I.SSSSSS.nN.CRC.arrow``) or of one of its
    writer's sample ids (``W.I.SEQ.ROW``); None for anything else (sample ids a caller chose, other names)."""
    shard = ShardName.parse(text)
    if shard is not None:
        return f"{shard.worker_id}.{shard.incarnation}", shard.seq
    parts = text.split(".")
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    return f"{parts[0]}.{parts[1]}", int(parts[2])


def count_rows(ranges: Iterable[list[int]]) -> int:
    return sum(b - a for a, b in ranges)


def to_ranges(shards: list[str], rows: Iterable[tuple[str, int]]) -> list[RowRange]:
    """(shard, row) pairs in order -> [shard index, first, after-last] ranges, runs of consecutive rows merged."""
    index = {name: i for i, name in enumerate(shards)}
    out: list[RowRange] = []
    for name, row in rows:
        i = index[name]
        if out and out[-1][0] == i and out[-1][2] == row:
            out[-1][2] += 1
        else:
            out.append([i, row, row + 1])
    return out


class Consumption:
    """Which rows of which shards are consumed, for the shards of bucket ``open_from`` on, and the run's totals.

    Built from the newest valid summary and the valid plans after it (``load``); memory follows the shards that may
    still hold unconsumed samples, not the run's length."""

    def __init__(self, open_from: int = 0):
        self.open_from = open_from
        self.rows: dict[str, list[list[int]]] = {}
        # per writer incarnation ("worker.incarnation"), the seqs of its shards that plans consumed from, as
        # ranges: a few numbers per incarnation, kept for the whole run, so that a copy of a consumed shard is
        # known for one at any age (``consumed_copy``), also once the original's bucket is forgotten
        self.writers: dict[str, list[list[int]]] = {}
        self.consumed_samples = 0
        self.dropped_samples = 0
        self.trained_steps = 0
        self.step = 0  # the highest step counted

    @classmethod
    def load(cls, layout: RunLayout, open_from: int = 0, *, plans_after: bool = True) -> Consumption:
        """The consumption log as of now: the newest valid summary (when there is one) plus the plans after it."""
        summary = newest_summary(layout)
        out = cls(open_from)
        if summary is not None:
            out.open_from = max(open_from, summary.open_from)
            out.rows = {name: [list(r) for r in ranges] for name, ranges in summary.consumed.items()}
            out.consumed_samples = summary.consumed_samples
            out.dropped_samples = summary.dropped_samples
            out.trained_steps = summary.trained_steps
            out.step = summary.step
            out.writers = {k: [list(r) for r in v] for k, v in summary.writers.items()}
        if plans_after:
            out.catch_up(layout)
        return out

    @classmethod
    def load_lenient(cls, layout: RunLayout, open_from: int, problems: list[str] | None) -> Consumption:
        """``load``, but a plan that is not a valid record is reported in ``problems`` (when given) and skipped."""
        out = cls.load(layout, open_from, plans_after=False)
        out.catch_up(layout, problems)
        return out

    def catch_up(self, layout: RunLayout, problems: list[str] | None = None) -> None:
        """Count the valid plans written after ``step`` (plans are immutable: each is read once)."""
        for step, f in sorted(valid_plan_files(layout, after_step=self.step).items()):
            try:
                plan = read_plan(f)
            except RecordError as e:
                if problems is None:
                    raise
                problems.append(str(e))
                self.step = max(self.step, step)
                continue
            self.add(plan)

    def add(self, plan: Plan) -> None:
        """Count ``plan``; a row it names that is consumed already is an error (never a reason to train twice)."""
        for i, a, b in [*plan.takes, *plan.drops]:
            if not add_range(self.rows.setdefault(plan.shards[i], []), a, b):
                raise RecordError(
                    f"plan of step {plan.step}",
                    "takes",
                    f"rows {a}..{b} of {plan.shards[i]} are consumed already",
                )
        for name in plan.shards:
            if (ws := writer_seq(name)) is not None:
                cover(self.writers.setdefault(ws[0], []), ws[1])
        self.consumed_samples += plan.samples + plan.dropped
        self.dropped_samples += plan.dropped
        self.trained_steps += int(plan.samples > 0)
        self.step = max(self.step, plan.step)

    def consumed_in(self, name: str) -> int:
        return count_rows(self.rows.get(name, ()))

    def consumed_copy(self, name: str, sample_ids: Iterable[str]) -> str | None:
        """Why shard ``name`` is a copy of samples consumed from another shard, or None: its samples' writer and
        seq (``W.I.SEQ.ROW``) are a consumed shard's while nothing was consumed under its own name.  Any age, any
        name: the original may be long behind ``open_from``."""
        if self.consumed_in(name) > 0:
            return None  # the original itself
        for ws in {w for i in sample_ids if (w := writer_seq(i)) is not None}:
            if covers(self.writers.get(ws[0], ()), ws[1]):
                return f"duplicate: its samples are shard {ws[1]} of writer {ws[0]}, consumed already"
        return None

    def is_consumed(self, name: str, row: int) -> bool:
        return any(a <= row < b for a, b in self.rows.get(name, ()))

    def advance(self, open_from: int, bucket_of: Callable[[str], int | None]) -> None:
        """Every shard before bucket ``open_from`` is consumed: forget their rows."""
        if open_from <= self.open_from:
            return
        self.open_from = open_from
        for name in [n for n in self.rows if (b := bucket_of(n)) is not None and b < open_from]:
            del self.rows[name]

    def window_consumed(self) -> int:
        return sum(count_rows(r) for r in self.rows.values())

    def summary(self, step: int, epoch: int) -> LogSummary:
        return LogSummary(
            step=step,
            epoch=epoch,
            open_from=self.open_from,
            consumed_samples=self.consumed_samples,
            dropped_samples=self.dropped_samples,
            trained_steps=self.trained_steps,
            consumed={k: [list(r) for r in v] for k, v in self.rows.items()},
            writers={k: [list(r) for r in v] for k, v in self.writers.items()},
        )


def sample_ids_of(layout: RunLayout, plan: Plan, which: str = "takes") -> list[str]:
    """The sample ids of a plan's ``takes`` (or ``drops``), in order, read from its shards (for tools, audits and
    tests: it reads every shard the plan names).  A row whose shard is gone is left out."""
    from . import shards  # plans are read by processes that never read shards: keep that import off them

    ids: dict[str, list[str]] = {}
    out = []
    for name, row in plan.rows(plan.takes if which == "takes" else plan.drops):
        if name not in ids:
            try:
                ids[name] = shards.sample_ids(layout, name)
            except FileNotFoundError:
                ids[name] = []
        if row < len(ids[name]):
            out.append(ids[name][row])
    return out


# -------------------------------------------------------------------------------------------- summaries


_SUMMARY_RE = re.compile(r"^step-(\d{8})\.e(\d+)\.json$")


def _summary_files(layout: RunLayout) -> list[tuple[int, int]]:
    return sorted(
        (int(m.group(1)), int(m.group(2))) for n in _listdir(layout.summaries) if (m := _SUMMARY_RE.match(n))
    )


def newest_summary(layout: RunLayout) -> LogSummary | None:
    """The newest valid summary that can be read (an unreadable one only costs reading the plans it covered)."""
    claims = _epoch_claims(layout)
    for step, epoch in reversed(_summary_files(layout)):
        if not _valid(step, epoch, claims):
            continue
        try:
            summary = read_record(LogSummary, layout.summary(step, epoch), attempts=3)
        except (RecordError, OSError):
            continue
        if summary.step == step and summary.epoch == epoch:
            return summary
    return None


def read_poisoned(layout: RunLayout, step: int) -> PoisonedStep | None:
    """The record that ``step``'s data failed the trainer, or None."""
    try:
        return read_record(PoisonedStep, layout.poisoned_step(step), attempts=3)
    except FileNotFoundError:
        return None


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
            max_step = max(newest_plan_step(layout), _announced_step(layout, epoch), resumed_step)
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

    def write_plan(
        self,
        step: int,
        shards: list[str],
        takes: list[tuple[str, int]],
        drops: list[tuple[str, int]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Plan:
        """Durably record what ``step`` consumes (``takes``: (shard, row) in training order; ``drops``: rows
        dropped as too stale), before training on it."""
        # announced before the fence check: a claim that this check cannot see yet will count this step as known
        write_record(
            self.layout.epoch_progress(self.epoch), EpochProgress(epoch=self.epoch, step=step, at=time.time())
        )
        self.check_not_fenced()
        if step in valid_plan_files(self.layout, after_step=step - 1):
            raise FileExistsError(f"{self.layout.plans}: step {step} already has a plan; replay it instead")
        drops = drops or []
        plan = Plan(
            step=step,
            epoch=self.epoch,
            shards=shards,
            takes=to_ranges(shards, takes),
            drops=to_ranges(shards, drops),
            samples=len(takes),
            dropped=len(drops),
            extra=extra or {},
        )
        make_dirs(self.layout.plan(step, self.epoch).parent)
        if not create_record(self.layout.plan(step, self.epoch), plan):
            raise FileExistsError(f"{self.layout.plan(step, self.epoch)}: exists with other content")
        return plan

    def replay(self, after_step: int) -> list[Plan]:
        """Plans of steps after the checkpoint, in order: they must be trained again, exactly as recorded."""
        return [p for _s, p in sorted(valid_plans(self.layout, after_step=after_step).items())]

    def write_summary(self, consumption: Consumption) -> None:
        """Record ``consumption`` (counted up to its ``step``) as a summary, and keep only the newest few of this
        incarnation's (older ones of earlier incarnations are left: one of them may be the valid one)."""
        make_dirs(self.layout.summaries)
        create_record(
            self.layout.summary(consumption.step, self.epoch),
            consumption.summary(consumption.step, self.epoch),
        )
        mine = [s for s, e in _summary_files(self.layout) if e == self.epoch]
        for step in mine[:-SUMMARIES_KEPT]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.layout.summary(step, self.epoch))


def mark_poisoned(layout: RunLayout, step: int, epoch: int, reason: str) -> None:
    """Durably record that ``step``'s data failed the trainer: its replay trains it without samples (any rank may
    write it; the first record wins)."""
    make_dirs(layout.poisoned)
    create_record(layout.poisoned_step(step), PoisonedStep(step=step, epoch=epoch, reason=reason))
