"""Publishing experience shards: ``ShardWriter`` buffers one worker incarnation's rows and ``publish_shard`` writes
them as tmp -> fsync -> rename into ``shards/ready/b<bucket>/`` -> fsync dir, so a reader never sees a partial shard.
The CRC-32 of the whole file, computed beside the writes, is part of the shard's name (``buffer/buckets.py``)."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import zlib
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from .buckets import SUFFIX, ShardName, bucket_at, new_incarnation
from .fsio import create_file, fsync_dir, make_dirs, named, retry_transient, tmp_name
from .layout import RunLayout
from .schema import OPTIONAL_NAMES, REQUIRED_NAMES, schema_with_metadata


def build_table(rows: Sequence[dict[str, Any]], run_id: str, worker_id: str, seq: int) -> pa.Table:
    """Rows (dicts with the required fields; optional ones may be absent) -> a table with the shard schema."""
    now = datetime.now(UTC)
    columns: dict[str, list[Any]] = {name: [] for name in REQUIRED_NAMES + OPTIONAL_NAMES}
    for r in rows:
        for name in REQUIRED_NAMES:
            if name == "created_at":
                columns[name].append(r.get("created_at", now))
            elif name == "worker_id":
                columns[name].append(r.get("worker_id", worker_id))
            else:
                columns[name].append(r[name])
        for name in OPTIONAL_NAMES:
            columns[name].append(r.get(name))
    return pa.table(columns, schema=schema_with_metadata(run_id, worker_id, seq))


class ShardWriter:
    """Buffers samples of one worker incarnation and publishes them as shards.

    ``add`` samples, then ``flush`` publishes everything buffered as one shard (never an empty one).
    Sample ids are filled in (``<worker>.<incarnation>.<seq>.<row>``) when a row has none.
    """

    def __init__(self, layout: RunLayout, run_id: str, worker_id: str, incarnation: str | None = None):
        if "." in worker_id or "/" in worker_id:
            raise ValueError(f"worker id {worker_id!r} must not contain '.' or '/'")
        self.layout = layout
        self.run_id = run_id
        self.worker_id = worker_id
        self.incarnation = incarnation or new_incarnation()
        self.seq = 0
        self.rows: list[dict[str, Any]] = []

    @property
    def pending(self) -> int:
        return len(self.rows)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def discard(self) -> int:
        """Drop buffered samples (a drain that abandons a batch publishes nothing partial)."""
        n, self.rows = len(self.rows), []
        return n

    def flush(self) -> Path | None:
        if not self.rows:
            return None
        for i, r in enumerate(self.rows):
            r.setdefault("sample_id", f"{self.worker_id}.{self.incarnation}.{self.seq}.{i}")
        path = publish_shard(
            self.layout,
            build_table(self.rows, self.run_id, self.worker_id, self.seq),
            self.worker_id,
            self.incarnation,
            self.seq,
        )
        self.seq += 1
        self.rows = []
        return path


class _CrcSink:
    """A write-only file that computes the CRC-32 of what passes through, on a second thread.

    The CRC runs beside the writes (zlib releases the GIL on large buffers), so publishing costs about the write
    alone; Arrow hands large body buffers over as ``pyarrow.Buffer`` objects, which the queue keeps alive.
    """

    def __init__(self, f: Any):
        self.f = f
        self.closed = False
        self.crc = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self.crc = zlib.crc32(data, self.crc)

    def write(self, data: Any) -> int:
        self._queue.put(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def finish(self) -> int:
        self._queue.put(None)
        self._thread.join()
        return self.crc

    def close(self) -> None:
        self.closed = True


def publish_shard(layout: RunLayout, table: pa.Table, worker_id: str, incarnation: str, seq: int) -> Path:
    """Write ``table`` as a shard: tmp file, fsync, rename into ready/ (named by its CRC-32), fsync ready/.

    A transient error (an EIO from a flaky target) writes the whole shard again under a new temporary; a
    persistent one, and ENOSPC, is raised naming the temporary, which is removed first.  A rename retried after a
    retransmitted RENAME succeeded only replaces the shard with the same bytes under the same name.
    """
    final = retry_transient(lambda: _publish_once(layout, table, worker_id, incarnation, seq))
    fsync_dir(final.parent)
    return final


def _publish_once(layout: RunLayout, table: pa.Table, worker_id: str, incarnation: str, seq: int) -> Path:
    tmp = tmp_name(layout.shards_tmp / f"{worker_id}.{incarnation}.{seq:06d}{SUFFIX}")
    try:
        with open(create_file(tmp), "wb") as f:
            sink = _CrcSink(f)
            try:
                with ipc.new_file(pa.PythonFile(sink, mode="w"), table.schema) as writer:
                    writer.write_table(table)
            finally:
                crc = sink.finish()  # also when a write failed: its thread must not wait forever
            f.flush()
            os.fsync(f.fileno())
        # the clock is read right before the rename: the bucket stays open far longer than that takes
        name = ShardName(bucket_at(time.time()), worker_id, incarnation, seq, table.num_rows, crc).name
        final = layout.ready_shard(name)
        _ensure_bucket(final.parent)
        try:
            os.rename(tmp, final)
        except FileNotFoundError:  # the bucket removed since this process made it (an empty one, by a person)
            _made_buckets.discard(final.parent)
            _ensure_bucket(final.parent)
            os.rename(tmp, final)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise named(e, tmp) from None
        raise
    return final


_made_buckets: set[Path] = set()


def _ensure_bucket(path: Path) -> None:
    """The bucket directory, made once per process (a publisher writes many shards into each)."""
    if path not in _made_buckets:
        make_dirs(path)
        _made_buckets.add(path)
