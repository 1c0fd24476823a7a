"""Experience shards: schema, crash-safe publish, validation and quarantine."""

from __future__ import annotations

import errno
import json
import math
import os
import threading
import time
import zlib

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from buffer import SCHEMA_VERSION, shards
from buffer.schema import REQUIRED_FIELDS

from .buffer_helpers import make_layout, sample


def _write(layout, rows, worker="w0", incarnation=None):
    w = shards.ShardWriter(layout, "run-1", worker, incarnation)
    for r in rows:
        w.add(r)
    return w.flush()


def test_shard_opens_with_plain_pyarrow_and_has_the_columns(tmp_path):
    layout = make_layout(tmp_path)
    path = _write(layout, [sample(i) for i in range(4)])
    table = ipc.open_file(str(path)).read_all()
    assert table.num_rows == 4
    for f in REQUIRED_FIELDS:
        assert table.schema.field(f.name).type == f.type, f.name
    assert table.schema.field("created_at").type == pa.timestamp("ms", tz="UTC")
    meta = table.schema.metadata
    assert meta[b"shardrl.run_id"] == b"run-1"
    assert meta[b"shardrl.worker_id"] == b"w0"
    assert meta[b"shardrl.seq"] == b"0"
    assert meta[b"shardrl.schema_version"] == str(SCHEMA_VERSION).encode()
    assert len(set(table.column("sample_id").to_pylist())) == 4


def test_never_an_empty_shard_and_names_do_not_collide_across_incarnations(tmp_path):
    layout = make_layout(tmp_path)
    assert shards.ShardWriter(layout, "r", "w0").flush() is None
    # a requeued worker starts a new incarnation at seq 0 again: names and sample ids must still differ
    a = _write(layout, [sample(0)])
    b = _write(layout, [sample(0)])
    assert a != b and a.exists() and b.exists()
    ids = [shards.sample_ids(layout, p.name)[0] for p in (a, b)]
    assert ids[0] != ids[1]


def test_every_truncation_is_detected_and_quarantined(tmp_path):
    layout = make_layout(tmp_path)
    path = _write(layout, [sample(i) for i in range(2)])
    data = path.read_bytes()
    for cut in range(len(data)):
        with pytest.raises(shards.ShardError):
            shards.validate_bytes(path.name, data[:cut])
    path.write_bytes(data[: len(data) // 2])
    assert shards.load_or_quarantine(layout, path.name) is None
    assert not path.exists()
    reason = json.loads(layout.quarantine_reason(path.name).read_text())
    assert "checksum" in reason["reason"]
    assert shards.quarantined(layout) == [path.name]


def test_every_single_flipped_byte_is_detected(tmp_path):
    layout = make_layout(tmp_path)
    path = _write(layout, [sample(i) for i in range(2)])
    data = bytearray(path.read_bytes())
    for i in range(len(data)):
        data[i] ^= 0x01
        with pytest.raises(shards.ShardError, match="checksum"):
            shards.validate_bytes(path.name, bytes(data))
        data[i] ^= 0x01
    assert shards.validate_bytes(path.name, bytes(data)).num_rows == 2


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"response_logprobs": [-0.5, -0.5]}, "differ in length"),
        ({"response_logprobs": [-0.5, 0.3, -0.1]}, "> 0"),
        ({"response_logprobs": [-0.5, math.nan, -0.1]}, "non-finite response_logprobs"),
        ({"reward": math.inf}, "non-finite reward"),
        ({"response_ids": [1, 2, 999]}, "out of range"),
        ({"prompt_ids": [-1, 2]}, "out of range"),
    ],
)
def test_value_checks_quarantine_with_reason(tmp_path, change, reason):
    layout = make_layout(tmp_path)
    path = _write(layout, [sample(0), {**sample(1), **change}])
    assert shards.load_or_quarantine(layout, path.name, vocab_size=100) is None
    rec = json.loads(layout.quarantine_reason(path.name).read_text())
    assert reason in rec["reason"]
    assert path.name in shards.quarantined(layout)


def test_schema_mismatch_is_rejected(tmp_path):
    layout = make_layout(tmp_path)
    table = shards.build_table([{**sample(0), "sample_id": "s0"}], "r", "w0", 0)
    bad = table.replace_schema_metadata({b"shardrl.schema_version": b"999"})
    path = shards.publish_shard(layout, bad, "w0", "abc", 0)
    with pytest.raises(shards.ShardError, match="schema version"):
        shards.read_shard(path)


def test_transient_enoent_is_retried(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    path = _write(layout, [sample(0)])
    real = shards._read_file
    calls = {"n": 0}

    def flaky(p):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FileNotFoundError(2, "No such file (just renamed)")
        return real(p)

    monkeypatch.setattr(shards, "_read_file", flaky)
    assert shards.read_shard(path).num_rows == 1
    assert calls["n"] == 2


def test_a_persistent_read_error_is_raised_naming_the_shard_and_never_quarantines(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    path = _write(layout, [sample(0)])

    def failing(p):
        raise OSError(errno.EIO, "Input/output error")  # as read() reports it: no file name

    monkeypatch.setattr(shards, "_read_file", failing)
    monkeypatch.setattr(shards.time, "sleep", lambda s: None)
    with pytest.raises(OSError) as e:
        shards.load_or_quarantine(layout, path.name)
    assert e.value.errno == errno.EIO and path.name in str(e.value)
    assert path.exists() and shards.quarantined(layout) == []
    monkeypatch.undo()
    assert shards.load_or_quarantine(layout, path.name).num_rows == 1


def test_read_checksum_matches_a_whole_file_checksum_across_read_chunks(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    path = _write(layout, [sample(i, n_resp=50) for i in range(40)])
    monkeypatch.setattr(shards, "READ_CHUNK", 1000)  # many pieces, the last one short
    data, crc = shards._read_file(path)
    assert data.to_pybytes() == path.read_bytes() and crc == zlib.crc32(path.read_bytes())
    assert shards.read_shard(path).num_rows == 40


def test_another_runs_shard_is_quarantined_naming_both_run_ids(tmp_path):
    layout = make_layout(tmp_path)
    mine = _write(layout, [sample(0)])  # run id "run-1"
    assert shards.read_shard(mine, run_id="run-1").num_rows == 1
    with pytest.raises(shards.ShardError, match=r"belongs to run run-1.*other-run"):
        shards.read_shard(mine, run_id="other-run")
    assert shards.load_or_quarantine(layout, mine.name, run_id="run-2") is None
    reason = json.loads(layout.quarantine_reason(mine.name).read_text())["reason"]
    assert "run-1" in reason and "run-2" in reason


def test_load_or_quarantine_checks_run_json_by_default(tmp_path):
    layout = make_layout(tmp_path)
    ours, theirs = _write(layout, [sample(0)]), _write(layout, [sample(1)], worker="w1")
    layout.run_json.write_text(json.dumps({"run_id": "run-1", "schema_version": SCHEMA_VERSION}))
    assert shards.load_or_quarantine(layout, ours.name).num_rows == 1
    # the same bytes under another run id: rewrite the metadata, keep the name consistent with the new CRC
    table = ipc.open_file(str(theirs)).read_all()
    table = table.replace_schema_metadata({**table.schema.metadata, b"shardrl.run_id": b"someone-else"})
    theirs.unlink()
    moved = shards.publish_shard(layout, table, "w1", "inc", 0)
    assert shards.load_or_quarantine(layout, moved.name) is None
    assert shards.quarantined(layout) == [moved.name]


def test_zero_row_shard_is_quarantined_saying_so(tmp_path):
    layout = make_layout(tmp_path)
    empty = shards.build_table([], "run-1", "w0", 0)
    path = shards.publish_shard(layout, empty, "w0", "abc", 0)
    with pytest.raises(shards.ShardError, match="0 rows"):
        shards.read_shard(path)


def test_a_fifo_with_a_shard_name_is_quarantined_without_blocking(tmp_path):
    layout = make_layout(tmp_path)
    name = shards.ShardName(shards.bucket_at(time.time()), "w", "fifo", 0, 1, 0).name
    layout.ready_shard(name).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(layout.ready_shard(name))
    assert shards.load_or_quarantine(layout, name) is None
    reason = json.loads(layout.quarantine_reason(name).read_text())["reason"]
    assert "not a regular file" in reason


def test_a_failed_publish_leaves_no_temporary_and_no_thread(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    w = shards.ShardWriter(layout, "run-1", "w0")
    w.add(sample(0))
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards.os, "fsync", full)
    before = threading.active_count()
    with pytest.raises(OSError) as e:
        w.flush()
    assert e.value.errno == errno.ENOSPC and "shards/tmp" in str(e.value)
    assert threading.active_count() == before and list(layout.shards_tmp.iterdir()) == []
    monkeypatch.setattr(shards.os, "fsync", real_fsync)
    assert w.pending == 1 and w.flush() is not None


def test_listing_counts_rows_from_names(tmp_path):
    layout = make_layout(tmp_path)
    _write(layout, [sample(i) for i in range(3)])
    _write(layout, [sample(i) for i in range(5)], worker="w1")
    (layout.shards_ready / "README.txt").write_text("not a shard")
    listed = shards.list_ready(layout)
    assert [s.rows for s in listed] == [3, 5]
    assert shards.ready_sample_count(listed) == 8
    # each shard lies in the bucket its name begins with; a bucket's foreign files are ignored too
    for s in listed:
        assert (
            layout.ready_shard(s.name) == layout.ready_bucket(s.bucket) / s.name
            and layout.ready_shard(s.name).exists()
        )
    (layout.ready_bucket(listed[0].bucket) / "notes.txt").write_text("not a shard")
    buckets = sorted({s.bucket for s in listed})
    assert shards.list_ready(layout, buckets) == listed and shards.list_ready(layout, []) == []
    lister = shards.BucketLister(layout, buckets[0])
    assert lister.list() == listed
    assert (
        shards.BucketLister(layout, buckets[-1] + 1).list() == []
    )  # buckets before ``first`` are not listed
