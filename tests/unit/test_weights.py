"""Published weight versions: manifest last, atomic LATEST, verification, garbage collection."""

from __future__ import annotations

import json

import pytest

from buffer import heartbeats, weights
from buffer.records import RecordError

from .buffer_helpers import make_layout


def _publish(layout, version: int, payload: bytes = b"x" * 100):
    st = weights.staging_dir(layout, version)
    (st / "model.safetensors").write_bytes(payload)
    (st / "config.json").write_text("{}")
    return weights.commit_version(layout, version, st, step=version * 10, dtype="float32")


def test_publish_then_read_latest(tmp_path):
    layout = make_layout(tmp_path)
    assert weights.read_latest(layout) is None and weights.latest_version(layout) == 0
    _publish(layout, 1)
    v = weights.read_latest(layout, checksums=True)
    assert v is not None and v.version == 1 and v.step == 10
    manifest = json.loads((v.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "config.json"}
    assert manifest["files"]["model.safetensors"]["size"] == 100


def test_damaged_version_fails_verification(tmp_path):
    layout = make_layout(tmp_path)
    v = _publish(layout, 1)
    (v.path / "model.safetensors").write_bytes(b"y" * 100)  # same size, other bytes
    weights.verify_version(layout, 1)  # sizes still match
    with pytest.raises(weights.WeightsError, match="sha256"):
        weights.verify_version(layout, 1, checksums=True)
    (v.path / "model.safetensors").write_bytes(b"y" * 10)
    with pytest.raises(weights.WeightsError, match="size"):
        weights.verify_version(layout, 1)
    (v.path / "model.safetensors").unlink()
    with pytest.raises(weights.WeightsError, match="missing"):
        weights.read_latest(layout)


def test_uncommitted_staging_is_invisible(tmp_path):
    layout = make_layout(tmp_path)
    _publish(layout, 1)
    st = weights.staging_dir(layout, 2)
    (st / "model.safetensors").write_bytes(b"half")
    assert weights.latest_version(layout) == 1
    assert weights.published_versions(layout) == [1]


def test_gc_keeps_last_k_latest_and_versions_in_use(tmp_path):
    layout = make_layout(tmp_path)
    for v in range(1, 7):
        _publish(layout, v)
    w = heartbeats.worker_status(layout, "w0", slot=0)
    w.update(state="running", weights_version=2)
    heartbeats.worker_status(layout, "w1", slot=1).update(state="stopped", weights_version=3)
    deleted = weights.garbage_collect(layout, keep=2, in_use=heartbeats.versions_in_use(layout))
    assert deleted == [1, 3, 4]
    assert weights.published_versions(layout) == [2, 5, 6]


def test_latest_and_manifest_are_typed_records(tmp_path):
    layout = make_layout(tmp_path)
    v = _publish(layout, 1)
    assert weights.read_manifest(v.path).files["model.safetensors"].size == 100
    layout.latest_pointer.write_text(json.dumps({"version": "1", "path": "v000001", "step": 0}))
    with pytest.raises(RecordError, match=r"LATEST: field schema_version: missing"):
        weights.latest_version(layout)  # never a guess at which version to load
    weights.write_latest(layout, 1, step=10)
    assert weights.latest_version(layout) == 1
    manifest = json.loads((v.path / "manifest.json").read_text())
    del manifest["files"]["config.json"]["sha256"]
    (v.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(weights.WeightsError, match=r"manifest.json: field files.config.json.sha256: missing"):
        weights.verify_version(layout, 1)  # a worker skips the version instead of crashing
