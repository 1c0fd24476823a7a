"""Experience shards: validated reading (read_shard / load_or_quarantine / quarantine), and the one import for the
rest of the contract: shard names and buckets (``buffer/buckets.py``) and publishing (``buffer/shard_writer.py``).

A shard is an Arrow IPC *file* (its footer makes every truncation detectable).  Arrow has no checksum of its own, so
the CRC-32 of the whole file is part of the shard's name: a flipped byte anywhere fails validation.  (CRC-32 detects
every error burst up to 32 bits with certainty and runs at several GB/s, which keeps validation off the trainer's
critical path; the threat is storage corruption, not an adversary.)  Nothing is ever moved between buckets, so no
process (not even a fenced-out trainer) can hide samples from another.

Reading tells storage from content.  A shard is read into memory with ``read()`` (never memory-mapped: a failed
page-in of a mapped file is SIGBUS, which kills the reader instead of raising), so an I/O error is an OSError naming
the file, raised after the transient retries; the shard stays in ready/ for the next attempt.  Only bad content
(checksum, Arrow footer, schema, values, another run's id) is a ShardError, which quarantines it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from .buckets import (
    SCAN_LIMIT,
    SEAL_GRACE_S,
    SUFFIX,
    BucketLister,
    ShardError,
    ShardName,
    bucket_at,
    first_bucket,
    list_bucket,
    list_ready,
    new_incarnation,
    ready_buckets,
    ready_sample_count,
    sealed,
)
from .fsio import (
    fsync_dir,
    named,
    read_json_or_none,
    retry_transient,
    write_json_atomic,
)
from .layout import RunLayout
from .schema import (
    LOGPROB_TOLERANCE,
    META_RUN_ID,
    multiturn_problem,
    schema_problem,
    token_versions_problem,
)
from .shard_writer import ShardWriter, build_table, publish_shard

# Reads of this size keep the CRC-32 of each piece in the CPU cache, so checking costs about the copy alone.
__all__ = [
    "SCAN_LIMIT",
    "SEAL_GRACE_S",
    "SUFFIX",
    "BucketLister",
    "ShardError",
    "ShardName",
    "ShardWriter",
    "bucket_at",
    "build_table",
    "first_bucket",
    "list_bucket",
    "list_ready",
    "load_or_quarantine",
    "new_incarnation",
    "publish_shard",
    "quarantine",
    "quarantined",
    "read_shard",
    "ready_buckets",
    "ready_sample_count",
    "run_id_of",
    "sample_ids",
    "sealed",
    "validate_bytes",
]

READ_CHUNK = 16 << 20


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
