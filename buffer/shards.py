"""Experience shards: publishing (ShardWriter) and validated reading (read_shard / quarantine).

A shard is an Arrow IPC *file* (its footer makes every truncation detectable) published as
tmp -> fsync -> rename into ``shards/ready`` -> fsync dir, so a reader never sees a partial shard.  Arrow has no
checksum of its own, so the CRC-32 of the whole file is part of the shard's name: a flipped byte anywhere fails
validation.  (CRC-32 detects every error burst up to 32 bits with certainty and runs at several GB/s, which keeps
validation off the trainer's critical path; the threat is storage corruption, not an adversary.)

Shard names ``<worker>.<incarnation>.<seq>.n<rows>.<crc32>.arrow`` never collide: the incarnation is random per
process start, so a requeued Slurm job cannot reuse a name.  The row count in the name lets the backlog be counted
from a directory listing without opening files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from .fsio import fsync_dir, retry_transient, tmp_name, write_json_atomic
from .layout import RunLayout
from .schema import OPTIONAL_NAMES, REQUIRED_NAMES, schema_problem, schema_with_metadata

SUFFIX = ".arrow"
# Logprobs are log-softmax outputs: <= 0 up to float32 rounding.
LOGPROB_TOLERANCE = 1e-4


class ShardError(ValueError):
    """A shard that failed validation; ``reason`` is the one-line cause recorded in quarantine."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class ShardName:
    worker_id: str
    incarnation: str
    seq: int
    rows: int
    crc: int

    @property
    def name(self) -> str:
        return f"{self.worker_id}.{self.incarnation}.{self.seq:06d}.n{self.rows}.{self.crc:08x}{SUFFIX}"

    @classmethod
    def parse(cls, name: str) -> ShardName | None:
        if not name.endswith(SUFFIX) or name.startswith("."):
            return None
        parts = name[: -len(SUFFIX)].split(".")
        if len(parts) != 5 or not parts[3].startswith("n"):
            return None
        try:
            return cls(parts[0], parts[1], int(parts[2]), int(parts[3][1:]), int(parts[4], 16))
        except ValueError:
            return None


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


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
    """Write ``table`` as a shard: tmp file, fsync, rename into ready/ (named by its CRC-32), fsync ready/."""
    tmp = tmp_name(layout.shards_tmp / f"{worker_id}.{incarnation}.{seq:06d}{SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            sink = _CrcSink(f)
            with ipc.new_file(pa.PythonFile(sink, mode="w"), table.schema) as writer:
                writer.write_table(table)
            f.flush()
            os.fsync(f.fileno())
        final = layout.ready_shard(ShardName(worker_id, incarnation, seq, table.num_rows, sink.finish()).name)
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(layout.shards_ready)
    return final


def list_ready(layout: RunLayout) -> list[ShardName]:
    """Complete shards in ready/, oldest sequence first per worker; foreign files are ignored."""
    try:
        names = os.listdir(layout.shards_ready)
    except FileNotFoundError:
        return []
    parsed = [s for n in names if (s := ShardName.parse(n)) is not None]
    return sorted(parsed, key=lambda s: (s.worker_id, s.incarnation, s.seq))


def _read_buffer(path: Path) -> pa.Buffer:
    """The file's bytes, memory-mapped (no copy); transient errors are retried (``fsio.retry_transient``).

    Mapping is safe here because shards are immutable once published and never deleted while a run reads them.
    """

    def read() -> pa.Buffer:
        with pa.memory_map(str(path)) as src:
            return src.read_buffer()

    return retry_transient(read)


def _values(col: pa.ChunkedArray) -> np.ndarray:
    """The flattened child values of a list column as one numpy array (zero-copy per chunk)."""
    flat = pc.list_flatten(col)
    parts = [c.to_numpy(zero_copy_only=False) for c in flat.chunks]
    return np.concatenate(parts) if parts else np.zeros(0)


def _value_problem(t: pa.Table, vocab_size: int | None) -> str | None:
    n_resp = pc.list_value_length(t["response_ids"])
    n_lp = pc.list_value_length(t["response_logprobs"])
    if not pc.all(pc.equal(n_resp, n_lp)).as_py():
        return "response_logprobs and response_ids differ in length"
    if t.num_rows and not pc.all(pc.greater(pc.list_value_length(t["prompt_ids"]), 0)).as_py():
        return "empty prompt_ids"
    lp = _values(t["response_logprobs"])
    if lp.size and not np.isfinite(lp).all():
        return "non-finite response_logprobs"
    if lp.size and lp.max() > LOGPROB_TOLERANCE:
        return f"response_logprobs > 0 (max {lp.max()})"
    for col in ("prompt_ids", "response_ids"):
        ids = _values(t[col])
        if not ids.size:
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            return f"{col} out of range [0, {vocab_size}) (min {lo}, max {hi})"
    rewards = t["reward"]
    if t.num_rows and not pc.all(pc.is_finite(rewards)).as_py():
        return "non-finite reward"
    if pc.count_distinct(t["sample_id"]).as_py() != t.num_rows:
        return "duplicate sample_id"
    return None


def validate_bytes(name: str, data: bytes | pa.Buffer, vocab_size: int | None = None) -> pa.Table:
    """Parse and fully validate a shard's bytes; raise ShardError with the reason."""
    parsed = ShardName.parse(name)
    if parsed is None:
        raise ShardError(name, "not a shard name <worker>.<incarnation>.<seq>.n<rows>.<crc32>.arrow")
    if zlib.crc32(data) != parsed.crc:
        raise ShardError(
            name, f"checksum mismatch (crc32 {zlib.crc32(data):08x}, name says {parsed.crc:08x})"
        )
    try:
        table = ipc.open_file(pa.BufferReader(data)).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ShardError(name, f"not a complete Arrow IPC file: {e}") from None
    problem = schema_problem(table.schema)
    if problem is None and table.num_rows != parsed.rows:
        problem = f"{table.num_rows} rows, name says {parsed.rows}"
    if problem is None:
        problem = _value_problem(table, vocab_size)
    if problem is not None:
        raise ShardError(name, problem)
    return table


def read_shard(path: Path, vocab_size: int | None = None) -> pa.Table:
    """Read and validate one shard file.  Transient I/O errors are retried; a persistent one is a ShardError."""
    try:
        data = _read_buffer(path)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise
        raise ShardError(path.name, f"unreadable after retries: {e}") from None
    return validate_bytes(path.name, data, vocab_size)


def quarantine(layout: RunLayout, name: str, reason: str) -> Path:
    """Move a bad shard out of ready/ with a reason file (the reason first: the move is the commit)."""
    write_json_atomic(layout.quarantine_reason(name), {"shard": name, "reason": reason, "at": time.time()})
    dest = layout.quarantined_shard(name)
    with contextlib.suppress(FileNotFoundError):
        os.rename(layout.ready_shard(name), dest)
    fsync_dir(layout.shards_ready)
    return dest


def load_or_quarantine(layout: RunLayout, name: str, vocab_size: int | None = None) -> pa.Table | None:
    """The validated table of a ready shard, or None after quarantining it (never half-consumed)."""
    try:
        return read_shard(layout.ready_shard(name), vocab_size)
    except ShardError as e:
        quarantine(layout, name, e.reason)
        return None


def quarantined(layout: RunLayout) -> list[str]:
    try:
        return sorted(n for n in os.listdir(layout.shards_quarantine) if n.endswith(SUFFIX))
    except FileNotFoundError:
        return []


def sample_ids(layout: RunLayout, name: str) -> list[str]:
    """Just the sample ids of a ready shard (memory-mapped; one column)."""
    with pa.memory_map(str(layout.ready_shard(name))) as src:
        return ipc.open_file(src).read_all().column("sample_id").to_pylist()


def ready_sample_count(shards: Iterable[ShardName]) -> int:
    return sum(s.rows for s in shards)
