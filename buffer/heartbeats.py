"""Status records of workers, supervisors and the trainer (small JSON files, replaced atomically).

Each record carries ``updated_at`` (wall clock, for people) and a ``beat`` counter that increases with every write
(for machines: staleness is judged by a counter that stops changing on the observer's own monotonic clock).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .fsio import HOST, read_json_or_none, write_json_atomic
from .layout import RunLayout

LIVE_STATES = frozenset(
    {"starting", "loading", "running", "reloading", "paused", "draining", "waiting", "training"}
)


class StatusWriter:
    """Keeps one status record fresh; ``update`` merges fields and rewrites the file."""

    def __init__(self, path: Path, **fields: Any):
        self.path = path
        self.record: dict[str, Any] = {"host": HOST, "pid": os.getpid(), "beat": 0, **fields}

    def update(self, **fields: Any) -> None:
        self.record.update(fields)
        self.record["beat"] += 1
        self.record["updated_at"] = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.record)


def worker_status(layout: RunLayout, worker_id: str, **fields: Any) -> StatusWriter:
    return StatusWriter(layout.worker_status(worker_id), id=worker_id, **fields)


def supervisor_status(layout: RunLayout, supervisor_id: str, **fields: Any) -> StatusWriter:
    return StatusWriter(layout.supervisor_status(supervisor_id), id=supervisor_id, **fields)


def trainer_status(layout: RunLayout, **fields: Any) -> StatusWriter:
    return StatusWriter(layout.trainer_status, **fields)


def _read_dir(directory: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    for n in names:
        if n.endswith(".json") and not n.startswith("."):
            rec = read_json_or_none(directory / n)
            if isinstance(rec, dict):
                out.append(rec)
    return out


def read_workers(layout: RunLayout) -> list[dict[str, Any]]:
    return _read_dir(layout.worker_status_dir)


def read_supervisors(layout: RunLayout) -> list[dict[str, Any]]:
    return _read_dir(layout.supervisor_status_dir)


def read_trainer(layout: RunLayout) -> dict[str, Any] | None:
    rec = read_json_or_none(layout.trainer_status)
    return rec if isinstance(rec, dict) else None


def age_s(rec: dict[str, Any]) -> float | None:
    """Seconds since the record was written, by the wall clock (for display only)."""
    at = rec.get("updated_at")
    return None if at is None else max(0.0, time.time() - float(at))


def versions_in_use(layout: RunLayout, max_age_s: float = 600.0) -> set[int]:
    """Weight versions that workers which may still be alive report as loaded (protected from GC)."""
    out = set()
    for rec in read_workers(layout):
        age = age_s(rec)
        if rec.get("state") in LIVE_STATES and (age is None or age < max_age_s):
            v = rec.get("weights_version")
            if isinstance(v, int):
                out.add(v)
    return out
