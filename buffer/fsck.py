"""`shardrl fsck`: check every shard, plan, weight version, lease and status record of a run; optionally repair.

Repair only does what cannot lose data: quarantine shards that fail validation (never delete them) and remove
abandoned temporaries (whose writer is gone).
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, field

from . import heartbeats, plans, shards, weights
from .config import ShardRLConfig
from .control import all_leases, read_state
from .fsio import iter_tmp_files, tmp_is_abandoned
from .layout import RunLayout
from .records import RecordError


@dataclass
class FsckReport:
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    checked: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.problems


def fsck(
    layout: RunLayout, cfg: ShardRLConfig, repair: bool = False, tmp_age_s: float = 3600.0
) -> FsckReport:
    rep = FsckReport()
    _check_shards(layout, cfg, rep, repair)
    _check_plans(layout, rep)
    _check_weights(layout, rep, repair)
    _check_leases(layout, rep)
    _check_status(layout, rep)
    _check_temporaries(layout, rep, repair, tmp_age_s)
    return rep


def _check_shards(layout: RunLayout, cfg: ShardRLConfig, rep: FsckReport, repair: bool) -> None:
    for s in shards.list_ready(layout):
        rep.checked["shards"] += 1
        try:
            shards.read_shard(layout.ready_shard(s.name), cfg.model.vocab_size)
        except shards.ShardError as e:
            rep.problems.append(f"shard {s.name}: {e.reason}")
            if repair:
                shards.quarantine(layout, s.name, e.reason)
                rep.repaired.append(f"quarantined {s.name}")
    known = {s.name for s in shards.list_ready(layout)}
    for p in layout.shards_ready.iterdir() if layout.shards_ready.is_dir() else []:
        if not p.name.startswith(".") and p.name not in known:
            rep.problems.append(f"shard {p.name}: not a shard name")


def _check_plans(layout: RunLayout, rep: FsckReport) -> None:
    seen: dict[str, int] = {}
    try:
        valid = plans.valid_plans(layout, problems=rep.problems)
    except RecordError as e:  # an epoch claim: which plans are valid cannot be decided
        rep.problems.append(str(e))
        return
    for step, plan in sorted(valid.items()):
        rep.checked["plans"] += 1
        for sid in [*plan.sample_ids, *plan.dropped_ids]:
            if sid in seen:
                rep.problems.append(f"plan step {step}: sample {sid} already consumed by step {seen[sid]}")
            seen[sid] = step
        for name in plan.shards:
            if not layout.ready_shard(name).exists():
                rep.problems.append(f"plan step {step}: shard {name} is not in shards/ready")


def _check_weights(layout: RunLayout, rep: FsckReport, repair: bool) -> None:
    for v in weights.published_versions(layout):
        rep.checked["weight_versions"] += 1
        try:
            weights.verify_version(layout, v, checksums=True)
        except weights.WeightsError as e:
            rep.problems.append(f"weights v{v}: {e}")
    try:
        latest = weights.latest_version(layout)
    except RecordError as e:
        rep.problems.append(str(e))
        return  # which staging directories are abandoned depends on LATEST
    if latest > 0:
        try:
            weights.verify_version(layout, latest)
        except weights.WeightsError as e:
            rep.problems.append(f"LATEST -> v{latest}: {e}")
    for d in weights.abandoned_staging(layout):
        rep.problems.append(f"weights: abandoned staging directory {d.name}")
        if repair:
            shutil.rmtree(d, ignore_errors=True)
            rep.repaired.append(f"removed {d.name}")


def _check_leases(layout: RunLayout, rep: FsckReport) -> None:
    desired = read_state(layout).desired
    for slot, rec in all_leases(layout).items():
        rep.checked["leases"] += 1
        if not rec.get("holder"):
            rep.problems.append(f"lease slot {slot}: no holder")
        elif slot >= desired:
            # a supervisor that scaled down releases it within a heartbeat; one that died leaves it behind
            rep.problems.append(
                f"lease slot {slot}: held by {rec['holder']} but only {desired} workers desired"
            )


def _check_status(layout: RunLayout, rep: FsckReport) -> None:
    for listing in (heartbeats.load_workers(layout), heartbeats.load_supervisors(layout)):
        rep.checked["status_records"] += len(listing.records) + len(listing.problems)
        rep.problems.extend(listing.problems)
    try:
        if heartbeats.load_trainer(layout) is not None:
            rep.checked["status_records"] += 1
    except RecordError as e:
        rep.checked["status_records"] += 1
        rep.problems.append(str(e))


def _check_temporaries(layout: RunLayout, rep: FsckReport, repair: bool, tmp_age_s: float) -> None:
    for d in [layout.shards_tmp, *layout.directories(), layout.root]:
        for p in iter_tmp_files(d):
            if tmp_is_abandoned(p, tmp_age_s):
                rep.problems.append(f"abandoned temporary {p.relative_to(layout.root)}")
                if repair:
                    p.unlink(missing_ok=True)
                    rep.repaired.append(f"removed {p.relative_to(layout.root)}")
