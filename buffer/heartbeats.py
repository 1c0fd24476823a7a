"""Status records of workers, supervisors and the trainer (``records.WorkerStatus`` ... replaced atomically).

Each record carries ``updated_at`` (wall clock, for people) and a ``beat`` counter that increases with every write
(for machines: staleness is judged by a counter that stops changing on the observer's own monotonic clock).
``StatusWriter.update(**fields)`` validates every write against the record type, so a misspelt or mistyped field
fails in the process that writes it.  Readers of a status directory (``load_workers``) return the bad records as
problems next to the good ones, so one damaged file never hides the others.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from .fsio import HOST, write_json_atomic
from .layout import RunLayout
from .records import (
    LIVE_STATES,
    RecordError,
    StatusRecord,
    SupervisorStatus,
    TrainerStatus,
    WorkerStatus,
    read_record,
)

S = TypeVar("S", bound=StatusRecord)


class StatusWriter(Generic[S]):
    """Keeps one status record fresh; ``update`` merges fields, validates the whole record and rewrites the file.

    ``record`` is the last record written, as JSON (what a reader of the file sees).
    """

    def __init__(self, path: Path, kind: type[S], **fields: Any):
        unknown = sorted(set(fields) - set(kind.model_fields))
        if unknown:
            raise RecordError(path, unknown[0], f"not a field of {kind.__name__} (misspelt?)")
        self.path = path
        self.kind = kind
        self._lock = threading.Lock()  # the trainer's feed thread writes the same record as its loop
        self.record: dict[str, Any] = {
            "schema_version": kind.expected_version(),
            "host": HOST,
            "pid": os.getpid(),
            "beat": 0,
            **fields,
        }

    def update(self, **fields: Any) -> S:
        with self._lock:
            merged = {
                **self.record,
                **fields,
                "beat": int(self.record["beat"]) + 1,
                "updated_at": time.time(),
            }
            rec = self.kind.validated(merged, self.path)
            self.record = rec.to_json()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, self.record)
            return rec


def worker_status(layout: RunLayout, worker_id: str, **fields: Any) -> StatusWriter[WorkerStatus]:
    return StatusWriter(layout.worker_status(worker_id), WorkerStatus, id=worker_id, **fields)


def supervisor_status(layout: RunLayout, supervisor_id: str, **fields: Any) -> StatusWriter[SupervisorStatus]:
    return StatusWriter(layout.supervisor_status(supervisor_id), SupervisorStatus, id=supervisor_id, **fields)


def trainer_status(layout: RunLayout, **fields: Any) -> StatusWriter[TrainerStatus]:
    return StatusWriter(layout.trainer_status, TrainerStatus, **fields)


# ---------------------------------------------------------------------------------------------- typed readers


@dataclass
class Listing(Generic[S]):
    """The valid records of a status directory, and one line per file that is not a valid record."""

    records: list[S] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _load_dir(
    directory: Path, kind: type[S], skip: frozenset[str] | set[str] = frozenset(), threads: int = 1
) -> Listing[S]:
    """The records of ``directory``; ``threads`` > 1 reads them that many at a time (on a network file system each
    read is a round trip or two, which threads overlap)."""
    out: Listing[S] = Listing()
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    paths = [
        directory / n
        for n in names
        if n.endswith(".json") and not n.startswith(".") and n.removesuffix(".json") not in skip
    ]

    def one(path: Path) -> S | str | None:
        try:
            return read_record(kind, path, attempts=2)
        except FileNotFoundError:
            return None  # removed since the listing
        except (RecordError, OSError) as e:
            return str(e)

    if threads > 1 and len(paths) > 1:
        with ThreadPoolExecutor(min(threads, len(paths))) as pool:
            results = list(pool.map(one, paths))
    else:
        results = [one(p) for p in paths]
    for r in results:
        if isinstance(r, str):
            out.problems.append(r)
        elif r is not None:
            out.records.append(r)
    return out


def load_workers(
    layout: RunLayout, skip: frozenset[str] | set[str] = frozenset(), threads: int = 1
) -> Listing[WorkerStatus]:
    """Every worker record, but those of the workers in ``skip`` (their ids), which are not opened."""
    return _load_dir(layout.worker_status_dir, WorkerStatus, skip, threads)


def load_supervisors(layout: RunLayout, threads: int = 1) -> Listing[SupervisorStatus]:
    return _load_dir(layout.supervisor_status_dir, SupervisorStatus, threads=threads)


def _load_one(kind: type[S], path: Path) -> S | None:
    """The record at ``path``; None when there is none (yet); RecordError when the file is not a valid record."""
    try:
        return read_record(kind, path, attempts=2)
    except FileNotFoundError:
        return None


def load_supervisor(layout: RunLayout, supervisor_id: str) -> SupervisorStatus | None:
    return _load_one(SupervisorStatus, layout.supervisor_status(supervisor_id))


def load_worker(layout: RunLayout, worker_id: str) -> WorkerStatus | None:
    return _load_one(WorkerStatus, layout.worker_status(worker_id))


def fleet_fields(w: WorkerStatus) -> dict[str, Any]:
    """What the trainer's feed keeps of a live worker (``FleetEntry``; copied by its supervisor into its record)."""
    return {"incarnation": w.incarnation, "in_flight": w.in_flight, "published_samples": w.published_samples}


def samples_in_flight(layout: RunLayout, *, besides: str, max_age_s: float) -> int:
    """Samples the other live workers are generating or hold unpublished (their ``in_flight``): with the backlog,
    what the trainer will have without a batch ``besides`` would start now.  A record older than ``max_age_s`` (a
    worker that died mid-batch: its heartbeat stopped) no longer counts, so a dead worker's claim cannot hold the
    others back for longer than that."""
    return sum(
        w.in_flight
        for w in load_workers(layout).records
        if w.id != besides and w.state in LIVE_STATES and w.age_s() < max_age_s
    )


def load_trainer(layout: RunLayout) -> TrainerStatus | None:
    """The trainer's record; None before a trainer has written one; RecordError when it is not a valid record."""
    return _load_one(TrainerStatus, layout.trainer_status)


# ------------------------------------------------------------------- key-indexed views (callers not yet typed)


def read_workers(layout: RunLayout) -> list[dict[str, Any]]:
    """The valid worker records as JSON objects; new code uses ``load_workers``."""
    return [r.to_json() for r in load_workers(layout).records]


def read_supervisors(layout: RunLayout) -> list[dict[str, Any]]:
    """The valid supervisor records as JSON objects; new code uses ``load_supervisors``."""
    return [r.to_json() for r in load_supervisors(layout).records]


def read_trainer(layout: RunLayout) -> dict[str, Any] | None:
    """The trainer record as a JSON object, None when absent or invalid; new code uses ``load_trainer``."""
    try:
        rec = load_trainer(layout)
    except (RecordError, OSError):
        return None
    return None if rec is None else rec.to_json()


def versions_in_use(layout: RunLayout, max_age_s: float = 600.0) -> set[int]:
    """Weight versions that workers which may still be alive report as loaded (protected from GC)."""
    return {
        w.weights_version
        for w in load_workers(layout).records
        if w.state in LIVE_STATES and w.age_s() < max_age_s and w.weights_version is not None
    }
