"""Experience shards: publishing (ShardWriter) and validated reading (read_shard / quarantine).

A shard is an Arrow IPC *file* (its footer makes every truncation detectable) published as
tmp -> fsync -> rename into ``shards/ready`` -> fsync dir, so a reader never sees a partial shard.  Arrow has no
checksum of its own, so the CRC-32 of the whole file is part of the shard's name: a flipped byte anywhere fails
validation.  (CRC-32 detects every error burst up to 32 bits with certainty and runs at several GB/s, which keeps
validation off the trainer's critical path; the threat is storage corruption, not an adversary.)

Shard names ``b<bucket>.<worker>.<incarnation>.<seq>.n<rows>.<crc32>.arrow`` never collide: the incarnation is
random per process start, so a requeued Slurm job cannot reuse a name.  The row count in the name lets the backlog be
counted from a directory listing without opening files.

Buckets.  A shard is published into ``shards/ready/b<bucket>/``, the bucket being the publisher's wall clock at the
rename divided by ``layout.BUCKET_S``.  Once a bucket is ``sealed`` (its time is past by more than SEAL_GRACE_S, which
covers clock skew between nodes and a slow rename) no shard can appear in it any more, so its listing can be kept;
only the last few buckets are listed again at each poll, whatever the run's length.  Nothing is ever moved between
buckets, so no process (not even a fenced-out trainer) can hide samples from another.

Reading tells storage from content.  A shard is read into memory with ``read()`` (never memory-mapped: a failed
page-in of a mapped file is SIGBUS, which kills the reader instead of raising), so an I/O error is an OSError naming
the file, raised after the transient retries; the shard stays in ready/ for the next attempt.  Only bad content
(checksum, Arrow footer, schema, values, another run's id) is a ShardError, which quarantines it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import stat
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

from .fsio import (
    create_file,
    fsync_dir,
    make_dirs,
    named,
    read_json_or_none,
    retry_transient,
    tmp_name,
    write_json_atomic,
)
from .layout import BUCKET_S, RunLayout
from .schema import (
    LOGPROB_TOLERANCE,
    META_RUN_ID,
    OPTIONAL_NAMES,
    REQUIRED_NAMES,
    multiturn_problem,
    schema_problem,
    schema_with_metadata,
    token_versions_problem,
)

SUFFIX = ".arrow"
# Reads of this size keep the CRC-32 of each piece in the CPU cache, so checking costs about the copy alone.
READ_CHUNK = 16 << 20
# A bucket whose time is past by this much takes no new shard: more than any clock skew between nodes plus the time
# from a publisher's reading of its clock to its rename.
SEAL_GRACE_S = 300.0


def bucket_at(t: float) -> int:
    return int(t // BUCKET_S)


def first_bucket(layout: RunLayout) -> int:
    """The oldest bucket a shard of this run can be in: its creation time, less the clock skew allowed."""
    meta = read_json_or_none(layout.run_json)
    created = meta.get("created_at") if isinstance(meta, dict) else None
    if not isinstance(created, (int, float)):  # no creation time: the oldest bucket there is
        return min(ready_buckets(layout), default=bucket_at(time.time() - SEAL_GRACE_S))
    return max(0, bucket_at(created - SEAL_GRACE_S))


def sealed(bucket: int, now: float) -> bool:
    """Whether no shard can be published into ``bucket`` any more (``now``: this host's wall clock)."""
    return now > (bucket + 1) * BUCKET_S + SEAL_GRACE_S


class ShardError(ValueError):
    """A shard that failed validation; ``reason`` is the one-line cause recorded in quarantine."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class ShardName:
    bucket: int
    worker_id: str
    incarnation: str
    seq: int
    rows: int
    crc: int

    @property
    def name(self) -> str:
        return (
            f"b{self.bucket:09d}.{self.worker_id}.{self.incarnation}.{self.seq:06d}.n{self.rows}."
            f"{self.crc:08x}{SUFFIX}"
        )

    @classmethod
    def parse(cls, name: str) -> ShardName | None:
        if not name.endswith(SUFFIX) or name.startswith("."):
            return None
        parts = name[: -len(SUFFIX)].split(".")
        if len(parts) != 6 or not parts[0].startswith("b") or not parts[4].startswith("n"):
            return None
        try:
            return cls(
                int(parts[0][1:]), parts[1], parts[2], int(parts[3]), int(parts[4][1:]), int(parts[5], 16)
            )
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


def ready_buckets(layout: RunLayout) -> list[int]:
    """Every bucket of ready/ (a listing of the top level: for checks and tools, not for polls)."""
    try:
        names = os.listdir(layout.shards_ready)
    except FileNotFoundError:
        return []
    return sorted(int(n[1:]) for n in names if n.startswith("b") and n[1:].isdigit())


def list_bucket(layout: RunLayout, bucket: int) -> list[ShardName]:
    """Complete shards of one bucket; foreign files are ignored, and so is a shard whose name says another bucket."""
    try:
        names = os.listdir(layout.ready_bucket(bucket))
    except FileNotFoundError:
        return []
    return [s for n in names if (s := ShardName.parse(n)) is not None and s.bucket == bucket]


def list_ready(layout: RunLayout, buckets: Iterable[int] | None = None) -> list[ShardName]:
    """Complete shards in ready/ (of ``buckets``, or of every bucket), oldest sequence first per worker."""
    chosen = ready_buckets(layout) if buckets is None else buckets
    parsed = [s for b in chosen for s in list_bucket(layout, b)]
    return sorted(parsed, key=lambda s: (s.worker_id, s.incarnation, s.seq))


SCAN_LIMIT = (
    64  # buckets: past this many, ``BucketLister`` lists the top level instead of looking each one up
)


class BucketLister:
    """Lists the ready buckets from ``first`` on, again and again, keeping the listing of every sealed bucket.

    A poll costs one listing per bucket that can still change (the last ``SEAL_GRACE_S / BUCKET_S + 2`` or so),
    whatever the run's length.  ``first`` only moves forward (``advance``): buckets before it hold nothing unconsumed.
    Safe to share between threads.
    """

    def __init__(self, layout: RunLayout, first: int):
        self.layout = layout
        self.first = first
        self._sealed: dict[int, list[ShardName]] = {}
        self._lock = threading.Lock()

    def advance(self, first: int) -> None:
        with self._lock:
            if first > self.first:
                self.first = first
                for b in [b for b in self._sealed if b < first]:
                    del self._sealed[b]

    def forget(self, name: str) -> None:
        """A shard moved out of ready/ (quarantined): drop it from the kept listings."""
        parsed = ShardName.parse(name)
        with self._lock:
            if parsed is not None and parsed.bucket in self._sealed:
                self._sealed[parsed.bucket] = [s for s in self._sealed[parsed.bucket] if s.name != name]

    def list(self, now: float | None = None) -> list[ShardName]:
        now = time.time() if now is None else now
        with self._lock:
            first = self.first
        out: list[ShardName] = []
        last = bucket_at(now) + 1  # +1: a publisher whose clock runs ahead of ours
        if last - first > SCAN_LIMIT:
            # far behind (a trainer catching up on hours of shards): one listing of the top level finds the
            # buckets that exist, instead of a lookup per bucket of every minute since
            chosen = [b for b in ready_buckets(self.layout) if first <= b <= last]
        else:
            chosen = list(range(first, last + 1))
        for b in chosen:
            with self._lock:
                kept = self._sealed.get(b)
            if kept is None:
                kept = list_bucket(self.layout, b)
                if sealed(b, now):
                    with self._lock:
                        self._sealed[b] = kept
            out.extend(kept)
        return sorted(out, key=lambda s: (s.worker_id, s.incarnation, s.seq))


def _read_file(path: Path) -> tuple[pa.Buffer, int]:
    """The file's bytes in an Arrow buffer, and their CRC-32, computed piece by piece as they arrive.

    ``read()``, not a memory map: an I/O error must be an OSError here, not a SIGBUS later wherever a column is
    touched.  Anything but a regular file (a directory with a shard's name) is bad content: ShardError.
    """
    # O_NONBLOCK: a FIFO with a shard's name must be refused, not block the open
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShardError(
                path.name, "not a regular file (a directory, a FIFO or a device with a shard's name)"
            )
        f = open(fd, "rb", buffering=0)  # noqa: SIM115 (closed by the with below; fd's owner from here)
    except BaseException:
        os.close(fd)
        raise
    with f:
        buf = pa.allocate_buffer(st.st_size)
        view, got, crc = memoryview(buf), 0, 0
        while got < st.st_size and (n := f.readinto(view[got : got + READ_CHUNK])):
            crc = zlib.crc32(view[got : got + n], crc)
            got += n
    return (buf if got == st.st_size else buf.slice(0, got)), crc


def _read_named(path: Path) -> tuple[pa.Buffer, int]:
    try:
        return _read_file(path)
    except OSError as e:
        raise named(e, path) from None


def _values(col: pa.ChunkedArray) -> np.ndarray:
    """The flattened child values of a list column as one numpy array (zero-copy per chunk)."""
    flat = pc.list_flatten(col)
    parts = [c.to_numpy(zero_copy_only=False) for c in flat.chunks]
    return np.concatenate(parts) if parts else np.zeros(0)


def _value_problem(t: pa.Table, vocab_size: int | None) -> str | None:
    if (
        t.num_rows == 0
    ):  # the checks below read "all of nothing" as null; a writer never publishes an empty shard
        return "0 rows: an empty shard (a shard writer publishes none)"
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
    return multiturn_problem(t) or token_versions_problem(t)


def validate_bytes(
    name: str,
    data: bytes | pa.Buffer,
    vocab_size: int | None = None,
    run_id: str | None = None,
    *,
    crc: int | None = None,
) -> pa.Table:
    """Parse and fully validate a shard's bytes; raise ShardError with the reason.

    ``run_id`` (run.json's) refuses a shard written by another run; ``crc`` is the CRC-32 of ``data`` when the
    reader computed it already.
    """
    parsed = ShardName.parse(name)
    if parsed is None:
        raise ShardError(name, "not a shard name <worker>.<incarnation>.<seq>.n<rows>.<crc32>.arrow")
    crc = zlib.crc32(data) if crc is None else crc
    if crc != parsed.crc:
        raise ShardError(name, f"checksum mismatch (crc32 {crc:08x}, name says {parsed.crc:08x})")
    try:
        table = ipc.open_file(pa.BufferReader(data)).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ShardError(name, f"not a complete Arrow IPC file: {e}") from None
    problem = schema_problem(table.schema)
    if problem is None and run_id is not None:
        problem = _run_id_problem(table.schema, run_id)
    if problem is None and table.num_rows != parsed.rows:
        problem = f"{table.num_rows} rows, name says {parsed.rows}"
    if problem is None:
        problem = _value_problem(table, vocab_size)
    if problem is not None:
        raise ShardError(name, problem)
    return table


def _run_id_problem(schema: pa.Schema, run_id: str) -> str | None:
    theirs = (schema.metadata or {}).get(META_RUN_ID)
    if theirs == run_id.encode():
        return None
    if theirs is None:
        return f"no shardrl.run_id in its metadata; this run's run_id is {run_id} (run.json)"
    shown = theirs.decode(errors="replace")[:80]
    return f"belongs to run {shown} (its shardrl.run_id), not to this run {run_id} (run.json run_id)"


def read_shard(path: Path, vocab_size: int | None = None, run_id: str | None = None) -> pa.Table:
    """Read and validate one shard file (of run ``run_id``, when given).

    Transient I/O errors are retried; a persistent one is raised as an OSError naming the file (the shard is not
    at fault); bad content is a ShardError.
    """
    data, crc = retry_transient(lambda: _read_named(path))
    return validate_bytes(path.name, data, vocab_size, run_id, crc=crc)


def quarantine(layout: RunLayout, name: str, reason: str) -> Path:
    """Move a bad shard out of ready/ with a reason file (the reason first: the move is the commit)."""
    write_json_atomic(layout.quarantine_reason(name), {"shard": name, "reason": reason, "at": time.time()})
    dest = layout.quarantined_shard(name)
    source = layout.ready_shard(name)
    with contextlib.suppress(FileNotFoundError):
        os.rename(source, dest)
    fsync_dir(source.parent)
    return dest


def load_or_quarantine(
    layout: RunLayout, name: str, vocab_size: int | None = None, run_id: str | None = None
) -> pa.Table | None:
    """The validated table of a ready shard, or None after quarantining it (never half-consumed).

    ``run_id`` defaults to run.json's (``run_id_of``).  An I/O error is raised (OSError), never quarantined.
    """
    if run_id is None:
        run_id = run_id_of(layout)
    try:
        return read_shard(layout.ready_shard(name), vocab_size, run_id)
    except ShardError as e:
        quarantine(layout, name, e.reason)
        return None


_run_ids: dict[Path, str] = {}


def run_id_of(layout: RunLayout) -> str | None:
    """run.json's run_id (read once per run directory), or None where there is no readable run.json."""
    if layout.root not in _run_ids:
        meta = read_json_or_none(layout.run_json)
        if not isinstance(meta, dict) or not isinstance(meta.get("run_id"), str):
            return None  # not remembered: a run.json that appears later is read then
        _run_ids[layout.root] = meta["run_id"]
    return _run_ids[layout.root]


def quarantined(layout: RunLayout) -> list[str]:
    try:
        return sorted(n for n in os.listdir(layout.shards_quarantine) if n.endswith(SUFFIX))
    except FileNotFoundError:
        return []


def sample_ids(layout: RunLayout, name: str) -> list[str]:
    """Just the sample ids of a ready shard (not validated)."""
    data, _ = retry_transient(lambda: _read_named(layout.ready_shard(name)))
    return ipc.open_file(pa.BufferReader(data)).read_all().column("sample_id").to_pylist()


def ready_sample_count(shards: Iterable[ShardName]) -> int:
    return sum(s.rows for s in shards)
