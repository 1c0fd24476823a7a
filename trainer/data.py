"""Shards -> samples -> planned steps (``trainer/batching.py`` cuts a step into token-balanced micro-batches).

Rank 0 plans each step from the ready shards through the consumption log (``buffer.plans``): whole GRPO groups,
oldest policy version first, too-stale groups dropped (and recorded as consumed) or kept per config.  The plan is
written durably before the step runs; rank 0 then broadcasts the step's rows, every rank computes the same
advantages and takes its token-balanced share (``batching.assign_to_ranks``), cut into micro-batches
(``batching.microbatches``, ``batching.collate``).  The planner is used by ``trainer/feed.py``; pure Python.

Two optional columns say more about where a sample came from.  ``episode`` (multi-turn, a JSON object) may carry an
``episode_id``: the samples an agent episode was split into (``rollout_worker/envs/calls.py``) share it, and
``trainer/step.py`` gives them one advantage (``Sample.episode_key``).  ``token_versions`` (sample columns version 3)
is the policy version of each response token of a response generated across a weight update; staleness is still
judged by ``policy_version``, its oldest model token (``Sample.model_versions`` feeds the per-token metrics only).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from buffer import plans, shards
from buffer.layout import RunLayout
from buffer.logs import logger

log = logger("trainer")

COLUMNS = [
    "sample_id",
    "group_id",
    "prompt_ids",
    "response_ids",
    "response_logprobs",
    "reward",
    "policy_version",
]


@dataclass
class Sample:
    sample_id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    reward: float
    policy_version: int
    advantage: float = 0.0
    shard: str = ""  # the shard and row it was read from: what a plan records
    row: int = -1
    # Multi-turn samples: 1 on the response tokens the model sampled, 0 on the environment's (tool results, user
    # turns), which are context only.  None: every response token is the model's.
    loss_mask: list[int] | None = None
    # The episode it is a part of, when an episode was split into several samples that must share one advantage
    # (the ``episode_id`` of its ``episode`` record).  None: the sample is a whole episode of its own.
    episode_key: str | None = None
    # The policy version that sampled each response token (-1 on the environment's), for a response generated
    # across a weight update.  None: every token is ``policy_version``.
    token_versions: list[int] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_tokens(self) -> int:
        """Response tokens the losses are taken over."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)

    def model_versions(self) -> list[int]:
        """The policy version of each token the losses are taken over (``loss_tokens`` of them), in order."""
        if self.token_versions is None:
            return [self.policy_version] * self.loss_tokens
        if self.loss_mask is None:
            return list(self.token_versions)
        return [v for v, m in zip(self.token_versions, self.loss_mask, strict=True) if m]


def _samples(table: pa.Table, shard: str = "") -> list[Sample]:
    cols = {c: table.column(c).to_pylist() for c in COLUMNS}
    masks, episodes, versions = (_optional(table, c) for c in ("loss_mask", "episode", "token_versions"))
    return [
        Sample(
            **{c: cols[c][i] for c in COLUMNS},
            shard=shard,
            row=i,
            loss_mask=masks[i],
            episode_key=_episode_key(episodes[i]),
            token_versions=versions[i],
        )
        for i in range(table.num_rows)
    ]


def _optional(table: pa.Table, name: str) -> list[Any]:
    """An optional column's values; all None when the shard was written before the column existed."""
    return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows


def _episode_key(record: str | None) -> str | None:
    """The ``episode_id`` of an ``episode`` record, or None (no record, or one without an id).

    The record is free-form JSON the trainer does not otherwise read: one that does not parse, or is not an
    object, names no episode, and its sample stays a whole episode of its own.
    """
    if record is None or "episode_id" not in record:
        return None
    try:
        parsed = json.loads(record)
    except ValueError:
        return None
    key = parsed.get("episode_id") if isinstance(parsed, dict) else None
    return None if key is None else str(key)


@dataclass
class Limits:
    """What a sample may be in this run: longer or out-of-vocabulary samples quarantine their shard."""

    vocab_size: int | None = None
    context: int | None = None  # tokens of prompt and response together (the model's context)
    max_response: int | None = None


@dataclass
class ShardCache:
    """Unconsumed rows of the ready shards, read from the buckets that may still hold some (``BucketLister``).

    Bad shards are quarantined, and so is a duplicate: a shard holding a sample id that another shard seen in the
    open window holds too (a copy under a second valid name), or one whose samples a plan consumed from another
    shard at any age (``Consumption.consumed_copy``: a backup restored, an rsync into a later bucket).  So every
    sample id in ``rows`` is unique and unconsumed, and no step can plan one twice.
    """

    layout: RunLayout
    limits: Limits
    lister: shards.BucketLister
    rows: dict[str, list[Sample]] = field(default_factory=dict)  # shard name -> its unconsumed rows
    done: set[str] = field(default_factory=set)  # fully consumed or quarantined shards
    owner: dict[str, str] = field(default_factory=dict)  # sample id -> the shard holding it (open window)
    unreadable: dict[str, str] = field(
        default_factory=dict
    )  # shard -> I/O error of the last attempt (retried)
    quarantined: int = 0

    def refresh(self, consumption: plans.Consumption) -> int:
        """Load the shards that appeared since the last call; returns how many were new."""
        new = 0
        listed = [s for s in self.lister.list() if s.name not in self.done and s.name not in self.rows]
        # A shard some of whose rows are consumed is the original of any copy of it: loaded first, it owns its
        # sample ids, so a copy (listed before it or not) is the one quarantined, never trained again.
        accepted: dict[str, list[Sample]] = {}
        for s in sorted(listed, key=lambda s: consumption.consumed_in(s.name) == 0):
            rows = self._load_new(s.name)
            if rows is None:
                continue
            new += 1
            reason = self._duplicate(s.name, rows) or consumption.consumed_copy(
                s.name, (r.sample_id for r in rows)
            )
            if reason is not None:
                self._quarantine(s.name, reason)
                continue
            self.owner.update((r.sample_id, s.name) for r in rows)
            accepted[s.name] = [r for r in rows if not consumption.is_consumed(s.name, r.row)]
        for s in listed:  # in listing order, whichever loaded first: the order groups are planned in
            if s.name in accepted:
                self.rows[s.name] = accepted[s.name]
        self.drop_consumed()
        return new

    def drop_consumed(self) -> None:
        for name in [n for n, rows in self.rows.items() if not rows]:
            del self.rows[name]
            self.done.add(name)

    def take(self, consumed: list[Sample]) -> None:
        """Forget rows a plan just consumed."""
        by_shard: dict[str, set[int]] = {}
        for s in consumed:
            by_shard.setdefault(s.shard, set()).add(s.row)
        for name, gone in by_shard.items():
            if name in self.rows:
                self.rows[name] = [r for r in self.rows[name] if r.row not in gone]
        self.drop_consumed()

    def open_from(self, now: float | None = None) -> int:
        """The oldest bucket that may still hold unconsumed samples: of a shard with some, of one unreadable for
        now, or the oldest that can still take new shards."""
        now = time.time() if now is None else now
        candidates = [shards.bucket_at(now - shards.SEAL_GRACE_S) - 1]
        for name in [*self.rows, *self.unreadable]:
            parsed = shards.ShardName.parse(name)
            if parsed is not None:
                candidates.append(parsed.bucket)
        return max(self.lister.first, min(candidates))

    def advance(self, open_from: int) -> None:
        """Buckets before ``open_from`` are done with: forget their shards."""
        self.lister.advance(open_from)
        old = [n for n in self.done if (b := _bucket(n)) is not None and b < open_from]
        self.done.difference_update(old)
        for sid in [i for i, n in self.owner.items() if (b := _bucket(n)) is not None and b < open_from]:
            del self.owner[sid]

    def _load_new(self, name: str) -> list[Sample] | None:
        """Rows of a shard not seen yet; None when it is bad (quarantined), gone, or unreadable for now."""
        try:
            table = shards.load_or_quarantine(self.layout, name, self.limits.vocab_size)
        except FileNotFoundError:
            return None  # removed since the listing (fsck --repair, a person): nothing to plan from it
        except OSError as e:  # the storage, not the shard: it stays in ready/ and is read again next time
            self.unreadable[name] = str(e)
            return None
        self.unreadable.pop(name, None)
        if table is None:
            self.quarantined += 1
            self.done.add(name)
            self.lister.forget(name)
            log.warning("quarantined shard %s", name)
            return None
        rows = _samples(table, name)
        poison = _poison(rows, self.limits)
        if poison is not None:
            self._quarantine(name, poison)
            return None
        return rows

    def _duplicate(self, name: str, rows: list[Sample]) -> str | None:
        """Why ``name`` is a duplicate of samples the run already has, or None."""
        ids = [r.sample_id for r in rows]
        clash = sorted({self.owner[i] for i in ids if i in self.owner and self.owner[i] != name})
        if clash:
            n = sum(1 for i in ids if i in self.owner)
            return f"duplicate: {n} of its {len(ids)} sample_ids are also in shard {clash[0]}"
        return None

    def _quarantine(self, name: str, reason: str) -> None:
        self.done.add(name)  # never planned from, also when the move fails (it is tried by no one else)
        self.quarantined += 1
        self.lister.forget(name)
        log.warning("quarantined shard %s: %s", name, reason)
        try:
            shards.quarantine(self.layout, name, reason)
        except OSError as e:
            log.warning("could not move %s to quarantine (%s); it is ignored", name, e)

    def load(self, shard_names: list[str]) -> tuple[dict[str, list[Sample]], list[str]]:
        """Every row of specific shards (for replaying a plan), by shard, and what could not be read: a shard gone
        or bad since it was planned (a bad one is quarantined).  An I/O error is raised: it may pass."""
        out: dict[str, list[Sample]] = {}
        problems: list[str] = []
        for name in shard_names:
            try:
                table = shards.load_or_quarantine(self.layout, name, self.limits.vocab_size)
            except FileNotFoundError:
                problems.append(f"{name}: missing")
                continue
            if table is None:
                problems.append(f"{name}: damaged (quarantined)")
                continue
            out[name] = _samples(table, name)
        return out, problems


def _bucket(name: str) -> int | None:
    parsed = shards.ShardName.parse(name)
    return None if parsed is None else parsed.bucket


def _poison(rows: list[Sample], limits: Limits) -> str | None:
    """Why a shard holds a sample this run must never train (it would run out of memory or fail the step), or
    None."""
    for r in rows:
        if limits.max_response is not None and len(r.response_ids) > limits.max_response:
            return (
                f"sample {r.sample_id}: response of {len(r.response_ids)} tokens is longer than "
                f"rollout.sampling.max_response_length {limits.max_response}"
            )
        if limits.context is not None and r.length > limits.context:
            return (
                f"sample {r.sample_id}: prompt of {len(r.prompt_ids)} + response of {len(r.response_ids)} tokens "
                f"is longer than the model's context {limits.context} (rollout.vllm.max_model_len, or "
                f"data.max_prompt_length + rollout.sampling.max_response_length)"
            )
    return None


def group_candidates(cache: ShardCache) -> list[tuple[str, list[Sample], list[str]]]:
    """Unconsumed whole groups, oldest policy version first: (group id, rows, shard names)."""
    groups: dict[str, tuple[list[Sample], set[str]]] = {}
    for name, rows in cache.rows.items():
        for r in rows:
            g = groups.setdefault(r.group_id, ([], set()))
            g[0].append(r)
            g[1].add(name)
    ordered = sorted(groups.items(), key=lambda kv: (min(r.policy_version for r in kv[1][0]), kv[0]))
    return [(gid, rows, sorted(names)) for gid, (rows, names) in ordered]


@dataclass
class Selection:
    samples: list[Sample]
    dropped: list[Sample]
    shards: list[str]


def _is_stale(rows: list[Sample], current_version: int, max_staleness: int) -> bool:
    return current_version - min(r.policy_version for r in rows) > max_staleness


def select_step(
    candidates: list[tuple[str, list[Sample], list[str]]],
    samples_per_step: int,
    current_version: int,
    max_staleness: int,
    drop_stale: bool,
) -> Selection | None:
    """Whole groups until ``samples_per_step`` is reached; None while not enough fresh samples exist."""
    chosen: list[Sample] = []
    dropped: list[Sample] = []
    names: set[str] = set()
    for _gid, rows, shard_names in candidates:
        if drop_stale and _is_stale(rows, current_version, max_staleness):
            dropped.extend(rows)
            names.update(shard_names)
            continue
        if len(chosen) >= samples_per_step:
            break
        chosen.extend(rows)
        names.update(shard_names)
    if len(chosen) < samples_per_step:
        return None
    return Selection(chosen, dropped, sorted(names))


def stale_only(
    candidates: list[tuple[str, list[Sample], list[str]]], current_version: int, max_staleness: int
) -> Selection:
    """The groups that can no longer be trained (too stale), as a selection that trains nothing."""
    stale = [
        (rows, names) for _gid, rows, names in candidates if _is_stale(rows, current_version, max_staleness)
    ]
    return Selection(
        [], [r for rows, _ in stale for r in rows], sorted({n for _, names in stale for n in names})
    )


@dataclass
class Waiting:
    """Why the last ``try_plan`` planned nothing: the fresh samples there are, and the stale ones not yet dropped."""

    fresh: int = 0
    stale: int = 0


@dataclass
class Replayed:
    samples: list[Sample]
    missing: list[str]  # planned sample ids that could not be read back (their shard gone or damaged)
    problems: list[str]  # one line per such shard


@dataclass(frozen=True)
class FeedCounts:
    """The backlog as rank 0 counted it (``Planner.count``): what the trainer's record tells rollout workers."""

    ready_samples: int
    consumed_samples: int
    dropped_samples: int
    unconsumed_samples: int
    planned_step: int
    open_from: int
    window_consumed: int

    def as_counts(self) -> dict[str, int]:
        return {
            "ready_samples": self.ready_samples,
            "consumed_samples": self.consumed_samples,
            "dropped_samples": self.dropped_samples,
            "unconsumed_samples": self.unconsumed_samples,
        }


class Planner:
    """Rank 0's view of the consumption log: plans new steps and replays recorded ones.

    ``timings`` holds the seconds the last call spent loading shards (``load``) and choosing and writing the plan
    (``plan``); ``waiting`` says why the last ``try_plan`` planned nothing, ``arrived`` how many shards it saw first.
    Memory follows the shards that may still hold unconsumed samples (``plans.Consumption``), not the run's length.
    ``count`` may be called from another thread.
    """

    def __init__(self, layout: RunLayout, log_: plans.PlanLog, limits: Limits):
        self.log = log_
        self.lock = threading.Lock()  # the consumption, between the planning thread and ``count``
        self.consumption = plans.Consumption.load(layout, open_from=shards.first_bucket(layout))
        self.cache = ShardCache(layout, limits, shards.BucketLister(layout, self.consumption.open_from))
        self.planned_step = self.consumption.step
        self.dropped_total = 0
        self.timings: dict[str, float] = {}
        self.waiting = Waiting()
        self.arrived = 0  # shards the last try_plan saw for the first time

    def replay(self, plan: plans.Plan) -> Replayed:
        """The plan's samples in its order, less those whose shard is gone or damaged since it was planned: the step
        is trained on the rest (an empty step when none is left) instead of failing for ever."""
        t0 = time.monotonic()
        rows, problems = self.cache.load(plan.shards)
        wanted = plan.rows(plan.takes)
        found = [rows[name][r] for name, r in wanted if name in rows and r < len(rows[name])]
        missing = [f"{name}#{r}" for name, r in wanted if name not in rows or r >= len(rows[name])]
        if missing:
            log.warning(
                "replay of step %d: %d of %d planned samples cannot be read back (%s); training on the rest",
                plan.step,
                len(missing),
                plan.samples,
                "; ".join(problems) or "not in their shards",
            )
        self.timings = {"load": time.monotonic() - t0, "plan": 0.0}
        self.planned_step = max(self.planned_step, plan.step)
        return Replayed(found, missing, problems)

    def try_plan(
        self,
        step: int,
        samples_per_step: int,
        current_version: int,
        max_staleness: int,
        drop_stale: bool,
        drop_only: bool = False,
    ) -> tuple[plans.Plan, list[Sample]] | None:
        """Plan ``step`` when enough fresh samples exist; else, with ``drop_only``, a step that only drops the stale
        samples there are (durably: they stop counting as backlog, and so stop holding workers back); else None
        (``waiting`` says why)."""
        t0 = time.monotonic()
        self.arrived = self.cache.refresh(self.consumption)
        self._advance()
        t1 = time.monotonic()
        candidates = group_candidates(self.cache)
        sel = select_step(candidates, samples_per_step, current_version, max_staleness, drop_stale)
        if sel is None:
            stale = (
                stale_only(candidates, current_version, max_staleness)
                if drop_stale
                else Selection([], [], [])
            )
            fresh = sum(len(rows) for _g, rows, _n in candidates) - len(stale.dropped)
            self.waiting = Waiting(fresh, len(stale.dropped))
            sel = stale if drop_only and stale.dropped else None
        planned = None if sel is None else (self._write(step, sel, current_version), sel.samples)
        self.timings = {"load": t1 - t0, "plan": time.monotonic() - t1}
        return planned

    def _advance(self) -> None:
        open_from = self.cache.open_from()
        if open_from > self.consumption.open_from:
            with self.lock:
                self.consumption.advance(open_from, _bucket)
            self.cache.advance(open_from)

    def _write(self, step: int, sel: Selection, current_version: int) -> plans.Plan:
        rows = [(s.shard, s.row) for s in [*sel.samples, *sel.dropped]]
        if len(set(rows)) != len(rows) or any(self.consumption.is_consumed(n, r) for n, r in rows):
            # the cache keeps every row unique and unconsumed: this is a bug, never a reason to train twice
            raise RuntimeError(f"step {step}: a sample would be planned twice; no plan written")
        versions = [s.policy_version for s in sel.samples]
        extra: dict[str, Any] = {"trainer_version": current_version}
        if versions:
            extra.update(
                min_version=min(versions),
                max_version=max(versions),
                staleness=[current_version - v for v in versions],
            )
        plan = self.log.write_plan(
            step,
            sel.shards,
            [(s.shard, s.row) for s in sel.samples],
            [(s.shard, s.row) for s in sel.dropped],
            extra,
        )
        with self.lock:
            self.consumption.add(plan)
            self.planned_step = max(self.planned_step, step)
        self.cache.take([*sel.samples, *sel.dropped])
        self.dropped_total += len(sel.dropped)
        if step % plans.SUMMARY_EVERY == 0:
            self._summarise()
        return plan

    def _summarise(self) -> None:
        try:
            with self.lock:
                self.log.write_summary(self.consumption)
        except OSError as e:  # a summary only saves a resumed trainer reading: never a reason to stop
            log.warning("consumption summary not written: %s", e)

    def count(self) -> FeedCounts:
        """The backlog now: the shards listed from the oldest open bucket on, less their consumed rows."""
        listed = self.cache.lister.list()
        with self.lock:
            c = self.consumption
            window = sum(s.rows for s in listed)
            consumed_window = sum(c.consumed_in(s.name) for s in listed)
            unconsumed = max(0, window - consumed_window)
            return FeedCounts(
                ready_samples=c.consumed_samples + unconsumed,
                consumed_samples=c.consumed_samples,
                dropped_samples=c.dropped_samples,
                unconsumed_samples=unconsumed,
                planned_step=self.planned_step,
                open_from=c.open_from,
                window_consumed=c.window_consumed(),
            )

    def unconsumed_count(self) -> int:
        return sum(len(rows) for rows in self.cache.rows.values())
