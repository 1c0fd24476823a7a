"""Shards -> planned steps -> token-balanced micro-batches.

Rank 0 plans each step from the ready shards through the consumption log (``buffer.plans``): whole GRPO groups,
oldest policy version first, too-stale groups dropped (and recorded as consumed) or kept per config.  The plan is
written durably before the step runs; rank 0 then broadcasts the step's rows, every rank computes the same
advantages and takes its token-balanced share (``assign_to_ranks``), cut into micro-batches (``microbatches``,
``collate``).  Used by ``trainer/loop.py`` and ``trainer/step.py``; pure Python apart from ``collate``.

Micro-batches are packed by default (``trainer.packing``): the model sees one row holding every sequence back to back,
with positions restarting at 0 per sequence, so no compute is spent on padding and the token budget counts real
tokens.  ``collate`` still returns the right-padded [B, T] layout as well: the losses, GAE and metrics work on it,
and ``trainer.model.batch_logprobs``/``batch_values`` scatter the packed outputs back into it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from buffer import plans, shards
from buffer.layout import RunLayout

log = logging.getLogger(__name__)

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

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _samples(table: pa.Table) -> list[Sample]:
    cols = {c: table.column(c).to_pylist() for c in COLUMNS}
    return [Sample(*(cols[c][i] for c in COLUMNS)) for i in range(table.num_rows)]


@dataclass
class ShardCache:
    """Validated rows of the ready shards that still hold unconsumed samples.

    Bad shards are quarantined, and so is a duplicate: a shard holding a sample id that a loaded shard holds too, or
    that a plan consumed from another shard (a copy under a second valid name).  So every sample id in ``rows`` is
    unique and either unconsumed or consumed from the shard that holds it, and no step can plan one twice.
    """

    layout: RunLayout
    vocab_size: int | None
    rows: dict[str, list[Sample]] = field(default_factory=dict)  # shard name -> rows
    done: set[str] = field(default_factory=set)  # fully consumed or quarantined shards
    planned: set[str] = field(
        default_factory=set
    )  # shards named by a valid plan: the originals of what it took
    owner: dict[str, str] = field(default_factory=dict)  # sample id -> the shard in ``rows`` holding it
    unreadable: dict[str, str] = field(
        default_factory=dict
    )  # shard -> I/O error of the last attempt (retried)
    quarantined: int = 0

    def refresh(self, consumed: set[str]) -> int:
        """Load the shards that appeared since the last call; returns how many were new."""
        new = 0
        self._drop_consumed(consumed)
        for s in shards.list_ready(self.layout):
            if s.name in self.done or s.name in self.rows:
                continue
            rows = self._load_new(s.name)
            if rows is None:
                continue
            new += 1
            reason = self._duplicate(s.name, rows, consumed)
            if reason is not None:
                self._quarantine(s.name, reason)
                continue
            self.rows[s.name] = rows
            self.owner.update((r.sample_id, s.name) for r in rows)
        self._drop_consumed(consumed)
        return new

    def _drop_consumed(self, consumed: set[str]) -> None:
        for name in list(self.rows):
            if all(r.sample_id in consumed for r in self.rows[name]):
                for r in self.rows.pop(name):
                    self.owner.pop(r.sample_id, None)
                self.done.add(name)

    def _load_new(self, name: str) -> list[Sample] | None:
        """Rows of a shard not seen yet; None when it is bad (quarantined), gone, or unreadable for now."""
        try:
            table = shards.load_or_quarantine(self.layout, name, self.vocab_size)
        except FileNotFoundError:
            return None  # removed since the listing (fsck --repair, a person): nothing to plan from it
        except OSError as e:  # the storage, not the shard: it stays in ready/ and is read again next time
            self.unreadable[name] = str(e)
            return None
        self.unreadable.pop(name, None)
        if table is None:
            self.quarantined += 1
            self.done.add(name)
            log.warning("quarantined shard %s", name)
            return None
        return _samples(table)

    def _duplicate(self, name: str, rows: list[Sample], consumed: set[str]) -> str | None:
        """Why ``name`` is a duplicate of samples the run already has, or None."""
        ids = [r.sample_id for r in rows]
        clash = sorted({self.owner[i] for i in ids if i in self.owner})
        if clash:
            n = sum(1 for i in ids if i in self.owner)
            return f"duplicate: {n} of its {len(ids)} sample_ids are also in shard {clash[0]}"
        if name not in self.planned:
            n = sum(1 for i in ids if i in consumed)
            if n:
                return f"duplicate: {n} of its {len(ids)} sample_ids were already consumed from other shards"
        return None

    def _quarantine(self, name: str, reason: str) -> None:
        self.done.add(name)  # never planned from, also when the move fails (it is tried by no one else)
        self.quarantined += 1
        log.warning("quarantined shard %s: %s", name, reason)
        try:
            shards.quarantine(self.layout, name, reason)
        except OSError as e:
            log.warning("could not move %s to quarantine (%s); it is ignored", name, e)

    def load(self, shard_names: list[str]) -> tuple[dict[str, Sample], list[str]]:
        """Rows of specific shards (for replaying a plan), by sample id, and what could not be read: a shard gone
        or bad since it was planned (a bad one is quarantined).  An I/O error is raised: it may pass."""
        out: dict[str, Sample] = {}
        problems: list[str] = []
        for name in shard_names:
            rows = self.rows.get(name)
            if rows is None:
                try:
                    table = shards.load_or_quarantine(self.layout, name, self.vocab_size)
                except FileNotFoundError:
                    problems.append(f"{name}: missing")
                    continue
                if table is None:
                    problems.append(f"{name}: damaged (quarantined)")
                    continue
                rows = _samples(table)
            out.update((r.sample_id, r) for r in rows)
        return out, problems


def group_candidates(cache: ShardCache, consumed: set[str]) -> list[tuple[str, list[Sample], list[str]]]:
    """Unconsumed whole groups, oldest policy version first: (group id, rows, shard names)."""
    groups: dict[str, tuple[list[Sample], set[str]]] = {}
    for name, rows in cache.rows.items():
        for r in rows:
            if r.sample_id not in consumed:
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


class Planner:
    """Rank 0's view of the consumption log: plans new steps and replays recorded ones.

    ``timings`` holds the seconds the last call spent loading shards (``load``) and choosing and writing the plan
    (``plan``); ``waiting`` says why the last ``try_plan`` planned nothing, ``arrived`` how many shards it saw first.
    """

    def __init__(self, layout: RunLayout, log_: plans.PlanLog, vocab_size: int | None):
        self.log = log_
        self.cache = ShardCache(layout, vocab_size)
        recorded = log_.plans().values()
        self.consumed = plans.consumed_ids(recorded)
        self.cache.planned = {name for p in recorded for name in p.shards}
        self.dropped_total = 0
        self.timings: dict[str, float] = {}
        self.waiting = Waiting()
        self.arrived = 0  # shards the last try_plan saw for the first time

    def replay(self, plan: plans.Plan) -> Replayed:
        """The plan's samples in its order, less those whose shard is gone or damaged since it was planned: the step
        is trained on the rest (an empty step when none is left) instead of failing for ever."""
        t0 = time.monotonic()
        rows, problems = self.cache.load(plan.shards)
        missing = [s for s in plan.sample_ids if s not in rows]
        if missing:
            log.warning(
                "replay of step %d: %d of %d planned samples cannot be read back (%s); training on the rest",
                plan.step,
                len(missing),
                len(plan.sample_ids),
                "; ".join(problems) or "not in their shards",
            )
        self.timings = {"load": time.monotonic() - t0, "plan": 0.0}
        return Replayed([rows[s] for s in plan.sample_ids if s in rows], missing, problems)

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
        self.arrived = self.cache.refresh(self.consumed)
        t1 = time.monotonic()
        candidates = group_candidates(self.cache, self.consumed)
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

    def _write(self, step: int, sel: Selection, current_version: int) -> plans.Plan:
        ids = [s.sample_id for s in sel.samples] + [s.sample_id for s in sel.dropped]
        if len(set(ids)) != len(ids) or any(i in self.consumed for i in ids):
            # the cache keeps every id unique and unconsumed: this is a bug, never a reason to train twice
            raise RuntimeError(f"step {step}: a sample id would be planned twice; no plan written")
        versions = [s.policy_version for s in sel.samples]
        extra: dict[str, Any] = {"trainer_version": current_version}
        if versions:
            extra.update(
                min_version=min(versions),
                max_version=max(versions),
                staleness=[current_version - v for v in versions],
            )
        plan = self.log.write_plan(
            step, sel.shards, [s.sample_id for s in sel.samples], [s.sample_id for s in sel.dropped], extra
        )
        self.consumed.update(plan.sample_ids)
        self.consumed.update(plan.dropped_ids)
        self.cache.planned.update(plan.shards)
        self.dropped_total += len(sel.dropped)
        return plan

    def unconsumed_count(self) -> int:
        return sum(1 for rows in self.cache.rows.values() for r in rows if r.sample_id not in self.consumed)


def split_updates(samples: list[Sample], updates: int) -> list[list[Sample]]:
    """The step's samples as ``updates`` mini-batches (one optimizer update each), interleaved so that each holds a
    slice of every group; the same on every rank.  Never more mini-batches than samples."""
    n = max(1, min(updates, len(samples)))
    return [samples[i::n] for i in range(n)]


def assign_to_ranks(samples: list[Sample], world: int) -> list[list[Sample]]:
    """Deterministic token-balanced split: longest first onto the least-loaded rank."""
    loads = [0] * world
    out: list[list[Sample]] = [[] for _ in range(world)]
    for s in sorted(samples, key=lambda s: (-s.length, s.sample_id)):
        r = loads.index(min(loads))
        out[r].append(s)
        loads[r] += s.length
    return out


def microbatches(samples: list[Sample], max_tokens: int, *, packed: bool = True) -> list[list[Sample]]:
    """Micro-batches within a budget of ``max_tokens``; a longer sample goes alone.

    Packed micro-batches count real tokens (the sum of the lengths) and are filled first-fit in decreasing length
    order, which comes within a micro-batch of the fewest possible; every micro-batch costs a pass over all FSDP
    units, and in the last one the ranks wait for the busiest.  Padded ones count rows x longest row, so they hold
    samples of similar length: consecutive in increasing length order.
    """
    if packed:
        return _first_fit_decreasing(samples, max_tokens)
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    for s in sorted(samples, key=lambda s: s.length):
        if cur and (len(cur) + 1) * s.length > max_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out


def _first_fit_decreasing(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    bins: list[list[Sample]] = []
    loads: list[int] = []
    for s in sorted(samples, key=lambda s: (-s.length, s.sample_id)):
        i = next((i for i, load in enumerate(loads) if load + s.length <= max_tokens), len(bins))
        if i == len(bins):
            bins.append([])
            loads.append(0)
        bins[i].append(s)
        loads[i] += s.length
    return bins


# Batch entries that stay on the host: Python-side sizes the attention splits on (a device copy would cost a sync).
HOST_KEYS = frozenset({"packed_lens"})


def collate(batch: list[Sample], pad_id: int, *, packed: bool = False) -> dict[str, Any]:
    """Right-padded tensors of one micro-batch, plus the packed row when ``packed``.

    ``input_ids`` [B,T]; ``response_mask`` [B,T] marks positions whose token is a response token (the logprob at
    position t is that of ``input_ids[:, t]``); ``behaviour_logp`` and ``advantages`` are aligned with it.

    Packed, it adds the same tokens as one row without padding: ``packed_ids`` and ``packed_positions`` [1,N]
    (N real tokens; positions restart at 0 for each sequence), ``packed_index`` [N] (where each packed token sits in
    the flattened [B*T] layout), ``packed_lens`` [S] (the lengths of the S non-empty sequences, kept on the host) and
    ``packed_cu_seqlens`` [S+1] int32 (where each sequence starts, then N).
    """
    import torch

    width = max((s.length for s in batch), default=1)
    b = len(batch)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    behaviour = torch.zeros((b, width), dtype=torch.float32)
    adv = torch.zeros((b, width), dtype=torch.float32)
    rewards = torch.zeros(b, dtype=torch.float32)
    for i, s in enumerate(batch):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attn[i, : p + r] = 1
        mask[i, p : p + r] = 1.0
        behaviour[i, p : p + r] = torch.tensor(s.response_logprobs)
        adv[i, p : p + r] = s.advantage
        rewards[i] = s.reward
    out = {
        "input_ids": input_ids,
        "attention_mask": attn,
        "response_mask": mask,
        "behaviour_logp": behaviour,
        "advantages": adv,
        "rewards": rewards,
    }
    if packed:
        real = attn.bool()
        lens = attn.sum(1)
        # Right padding: the real tokens in row-major order are the sequences back to back.
        out["packed_ids"] = input_ids[real].unsqueeze(0)
        out["packed_positions"] = (attn.cumsum(1) - 1)[real].unsqueeze(0)
        out["packed_index"] = real.flatten().nonzero().squeeze(1)
        out["packed_lens"] = lens[lens > 0]
        out["packed_cu_seqlens"] = torch.cat([lens.new_zeros(1), out["packed_lens"].cumsum(0)]).int()
    return out


def batch_to(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """A collated micro-batch on ``device``, but for the host-side entries (``HOST_KEYS``)."""
    return {k: v if k in HOST_KEYS else v.to(device) for k, v in batch.items()}
