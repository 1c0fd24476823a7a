"""Experience shards: schema, crash-safe publish, validation and quarantine."""

from __future__ import annotations

import json
import math

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
    real = shards.pa.memory_map
    calls = {"n": 0}

    def flaky(p, *a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FileNotFoundError(2, "No such file (just renamed)")
        return real(p, *a, **k)

    monkeypatch.setattr(shards.pa, "memory_map", flaky)
    assert shards.read_shard(path).num_rows == 1
    assert calls["n"] == 2


def test_listing_counts_rows_from_names(tmp_path):
    layout = make_layout(tmp_path)
    _write(layout, [sample(i) for i in range(3)])
    _write(layout, [sample(i) for i in range(5)], worker="w1")
    (layout.shards_ready / "README.txt").write_text("not a shard")
    listed = shards.list_ready(layout)
    assert [s.rows for s in listed] == [3, 5]
    assert shards.ready_sample_count(listed) == 8
