"""`shardrl fsck`: check every shard, plan, weight version, lease and status record of a run; optionally repair.

Repair only does what cannot lose data: quarantine shards that fail validation (never delete them) and remove
abandoned temporaries (whose writer is gone) and abandoned weight staging directories, anywhere in the run.
A temporary is abandoned when its writer (on this host) is dead, when it is older than ``tmp_age_s``, or when it
is still empty a minute after it was created: writers write right after creating, so an empty one is what a failed
write (a full disk) leaves behind.  A staging directory is abandoned when its version is published or older than
LATEST, or when nothing in it changed for ``tmp_age_s``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import heartbeats, plans, shards, weights
from .config import ShardRLConfig
from .control import all_leases, read_state
from .fsio import tmp_is_abandoned
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
    layout: RunLayout,
    cfg: ShardRLConfig,
    repair: bool = False,
    tmp_age_s: float = 3600.0,
    run_id: str | None = None,
) -> FsckReport:
    """Check the run (shards of run ``run_id``: run.json's when not given); ``repair`` as the module says."""
    rep = FsckReport()
    _check_shards(layout, cfg, rep, repair, run_id or shards.run_id_of(layout))
    _check_plans(layout, rep)
    _check_weights(layout, rep, repair, tmp_age_s)
    _check_leases(layout, rep)
    _check_status(layout, rep)
    _check_temporaries(layout, rep, repair, tmp_age_s)
    return rep


def _check_shards(
    layout: RunLayout, cfg: ShardRLConfig, rep: FsckReport, repair: bool, run_id: str | None
) -> None:
    for s in shards.list_ready(layout):
        rep.checked["shards"] += 1
        try:
            shards.read_shard(layout.ready_shard(s.name), cfg.model.vocab_size, run_id)
        except OSError as e:  # the storage, not the shard: reported, never quarantined
            rep.problems.append(f"shard {s.name}: unreadable: {e}")
        except shards.ShardError as e:
            rep.problems.append(f"shard {s.name}: {e.reason}")
            if repair:
                shards.quarantine(layout, s.name, e.reason)
                rep.repaired.append(f"quarantined {s.name}")
    known = {s.name for s in shards.list_ready(layout)}
    buckets = {layout.ready_bucket(b).name for b in shards.ready_buckets(layout)}
    top = list(layout.shards_ready.iterdir()) if layout.shards_ready.is_dir() else []
    inside = [p for d in top if d.name in buckets and d.is_dir() for p in d.iterdir()]
    for p in [*(p for p in top if p.name not in buckets), *inside]:
        if not p.name.startswith(".") and p.name not in known:
            rep.problems.append(f"shard {p.name}: not a shard name (or in another bucket than its name says)")


def _check_plans(layout: RunLayout, rep: FsckReport) -> None:
    seen: dict[tuple[str, int], int] = {}
    try:
        valid = plans.valid_plans(layout, problems=rep.problems)
    except RecordError as e:  # an epoch claim: which plans are valid cannot be decided
        rep.problems.append(str(e))
        return
    for step, plan in sorted(valid.items()):
        rep.checked["plans"] += 1
        for row in [*plan.rows(plan.takes), *plan.rows(plan.drops)]:
            if row in seen:
                rep.problems.append(
                    f"plan step {step}: row {row[1]} of {row[0]} already consumed by step {seen[row]}"
                )
            seen[row] = step
        for name in plan.shards:
            if not layout.ready_shard(name).exists():
                rep.problems.append(f"plan step {step}: shard {name} is not in shards/ready")


def _check_weights(layout: RunLayout, rep: FsckReport, repair: bool, tmp_age_s: float) -> None:
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
            weights.verify_version(layout, latest, checksums=False)  # hashed above
        except weights.WeightsError as e:
            rep.problems.append(f"LATEST -> v{latest}: {e}")
    _check_staging(layout, rep, repair, latest, tmp_age_s)


def _check_staging(layout: RunLayout, rep: FsckReport, repair: bool, latest: int, tmp_age_s: float) -> None:
    published = set(weights.abandoned_staging(layout))
    for d in sorted(layout.weights.glob(".staging-v*")) if layout.weights.is_dir() else []:
        if d in published:
            why = f"version published or older than LATEST (v{latest})"
        elif (idle := time.time() - _newest_mtime(d)) > tmp_age_s:
            why = f"nothing written for {idle:.0f} s (its publisher is gone)"
        else:
            continue  # a publisher at work
        rel = d.relative_to(layout.root)
        rep.problems.append(f"abandoned staging directory {rel}: {why}")
        if repair:
            shutil.rmtree(d, ignore_errors=True)
            rep.repaired.append(f"removed {rel}")


def _newest_mtime(directory: Path) -> float:
    newest = directory.stat().st_mtime
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
    return newest


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


EMPTY_GRACE_S = (
    60.0  # a writer writes right after creating its temporary: still empty after this, the write failed
)


def _check_temporaries(layout: RunLayout, rep: FsckReport, repair: bool, tmp_age_s: float) -> None:
    for p in _temporaries(layout.root):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue  # its writer renamed or removed it meanwhile
        empty = stat.S_ISREG(st.st_mode) and st.st_size == 0
        if not (tmp_is_abandoned(p, tmp_age_s) or (empty and time.time() - st.st_mtime > EMPTY_GRACE_S)):
            continue
        rel = p.relative_to(layout.root)
        rep.problems.append(
            f"abandoned temporary {rel}" + (" (0 bytes: a write that failed)" if empty else "")
        )
        if repair:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            rep.repaired.append(f"removed {rel}")


def _temporaries(root: Path) -> list[Path]:
    """Every ``.tmp.*`` file or directory under ``root`` (not what lies inside a temporary directory)."""
    out = []
    for here, dirs, files in os.walk(root):
        out += [Path(here, n) for n in files if n.startswith(".tmp.")]
        out += [Path(here, n) for n in dirs if n.startswith(".tmp.")]
        dirs[:] = [n for n in dirs if not n.startswith(".tmp.")]
    return sorted(out)
