"""Published weight versions: manifest last, atomic LATEST, verification, garbage collection."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import stat
import subprocess
import time

import pytest

from buffer import digests, fsio, heartbeats, weights
from buffer.records import RecordError

from .buffer_helpers import make_layout, publish_version


def test_publish_then_read_latest(tmp_path):
    layout = make_layout(tmp_path)
    assert weights.read_latest(layout) is None and weights.latest_version(layout) == 0
    publish_version(layout, 1)
    v = weights.read_latest(layout, checksums=True)
    assert v is not None and v.version == 1 and v.step == 10
    manifest = json.loads((v.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "config.json"}
    assert manifest["files"]["model.safetensors"]["size"] == 100


def test_damaged_version_fails_verification(tmp_path):
    layout = make_layout(tmp_path)
    v = publish_version(layout, 1)
    (v.path / "model.safetensors").write_bytes(b"y" * 100)  # same size, other bytes
    weights.verify_version(layout, 1, checksums=False)  # sizes still match
    with pytest.raises(weights.WeightsError, match=r"model\.safetensors: sha256"):
        weights.verify_version(layout, 1)  # the worker's check: checksums by default
    (v.path / "model.safetensors").write_bytes(b"y" * 10)
    with pytest.raises(weights.WeightsError, match="size"):
        weights.verify_version(layout, 1)
    (v.path / "model.safetensors").unlink()
    with pytest.raises(weights.WeightsError, match="missing"):
        weights.read_latest(layout)


def test_uncommitted_staging_is_invisible(tmp_path):
    layout = make_layout(tmp_path)
    publish_version(layout, 1)
    st = weights.staging_dir(layout, 2)
    (st / "model.safetensors").write_bytes(b"half")
    assert weights.latest_version(layout) == 1
    assert weights.published_versions(layout) == [1]


def test_gc_keeps_last_k_latest_and_versions_in_use(tmp_path):
    layout = make_layout(tmp_path)
    for v in range(1, 7):
        publish_version(layout, v)
    w = heartbeats.worker_status(layout, "w0", slot=0)
    w.update(state="running", weights_version=2)
    heartbeats.worker_status(layout, "w1", slot=1).update(state="stopped", weights_version=3)
    deleted = weights.garbage_collect(layout, keep=2, in_use=heartbeats.versions_in_use(layout))
    assert deleted == [1, 3, 4]
    assert weights.published_versions(layout) == [2, 5, 6]


def test_latest_and_manifest_are_typed_records(tmp_path):
    layout = make_layout(tmp_path)
    v = publish_version(layout, 1)
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


def test_parallel_hashes_are_the_files_sha256(tmp_path):
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(os.urandom(100_000 + i))
    assert weights.sha256_files(paths) == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert weights.sha256_file(paths[0], chunk=999) == hashlib.sha256(paths[0].read_bytes()).hexdigest()


def _pieces_digest(data: bytes, chunk: int) -> str:
    """The manifest's digest, computed plainly: sha256 over the sha256 digests of the pieces."""
    pieces = [data[i : i + chunk] for i in range(0, max(len(data), 1), chunk)]
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 4321])
def test_piece_digests_of_files_and_of_streams_agree(tmp_path, size):
    from concurrent.futures import ThreadPoolExecutor

    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    want = _pieces_digest(data, 1000)
    assert weights.file_digests([path, path], chunk=1000) == [want, want]
    assert weights.digest_as(path, 1000) == want
    assert weights.digest_as(path, None) == hashlib.sha256(data).hexdigest()
    with ThreadPoolExecutor(3) as pool:
        for cuts in ([], [7], [500, 1000, 1001], list(range(0, size, 333))):  # blocks across piece boundaries
            stream = weights.StreamDigest(pool, chunk=1000)
            edges = [0, *[c for c in cuts if 0 < c < size], size]
            for a, b in itertools.pairwise(edges):
                stream.update(memoryview(data)[a:b])
            assert stream.hexdigest() == want, cuts


def test_a_damaged_piece_in_the_middle_is_found_and_old_plain_manifests_still_verify(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    monkeypatch.setattr(weights, "DIGEST_CHUNK", 4096)
    monkeypatch.setattr(digests, "DIGEST_CHUNK", 4096)  # where the pieces are cut
    data = os.urandom(5 * 4096 + 17)
    v = publish_version(layout, 1, data)
    manifest = json.loads((v.path / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"]["chunk_bytes"] == 4096
    assert manifest["files"]["model.safetensors"]["sha256"] == _pieces_digest(data, 4096)
    damaged = bytearray(data)
    damaged[3 * 4096 + 5] ^= 1
    (v.path / "model.safetensors").write_bytes(bytes(damaged))
    with pytest.raises(weights.WeightsError, match="sha256 does not match"):
        weights.verify_version(layout, 1)
    # a manifest written before pieces: the whole file's sha256, no chunk_bytes
    (v.path / "model.safetensors").write_bytes(data)
    for entry, name in ((manifest["files"][n], n) for n in list(manifest["files"])):
        entry.pop("chunk_bytes")
        entry["sha256"] = hashlib.sha256((v.path / name).read_bytes()).hexdigest()
    (v.path / "manifest.json").write_text(json.dumps(manifest))
    assert weights.verify_version(layout, 1).version == 1


def test_a_damaged_file_is_refused_until_it_changes_and_is_not_rehashed_meanwhile(tmp_path, monkeypatch):
    layout = make_layout(tmp_path)
    v = publish_version(layout, 1, os.urandom(100))
    good = (v.path / "model.safetensors").read_bytes()
    (v.path / "model.safetensors").write_bytes(bytes(100))
    with pytest.raises(weights.WeightsError, match="sha256"):
        weights.verify_version(layout, 1)
    hashed = []
    monkeypatch.setattr(digests, "_hash_piece", lambda p, *_: hashed.append(p) or b"0" * 32)
    with pytest.raises(weights.WeightsError, match="sha256"):
        weights.verify_version(layout, 1)  # a worker polling every second: nothing changed, nothing hashed
    assert hashed == []
    monkeypatch.undo()
    (v.path / "model.safetensors").write_bytes(good)  # repaired: a new mtime, so it is hashed again
    os.utime(v.path / "model.safetensors", ns=(1, 1))
    assert weights.verify_version(layout, 1).version == 1


def test_commit_gives_every_file_the_run_file_mode(tmp_path):
    layout = make_layout(tmp_path)
    st = weights.staging_dir(layout, 1)
    (st / "model.safetensors").write_bytes(b"x" * 10)
    (st / "model.safetensors").chmod(0o600)  # as transformers' save_pretrained leaves it
    (st / "config.json").write_text("{}")
    v = weights.commit_version(layout, 1, st, step=1, dtype="float32")
    assert stat.S_IMODE((v.path / "model.safetensors").stat().st_mode) == fsio.modes().file


@pytest.mark.proc
def test_fsck_finds_empty_temporaries_anywhere_and_abandoned_staging(tmp_path):
    from buffer.config import ShardRLConfig
    from buffer.fsck import fsck

    layout = make_layout(tmp_path)
    publish_version(layout, 1)
    weights.staging_dir(layout, 1)  # a publisher that died after the rename: its version is published
    old = weights.staging_dir(layout, 2)
    (old / "model.safetensors").write_bytes(b"half")
    for p in (old / "model.safetensors", old):
        os.utime(p, (time.time() - 7200,) * 2)  # nothing written for two hours
    (weights.staging_dir(layout, 3) / "model.safetensors").write_bytes(b"being written")
    slot = layout.lease_dir(0)
    slot.mkdir(parents=True)
    empty = fsio.tmp_name(slot / "00000001.json")  # ours, alive: only its emptiness says the write failed
    empty.write_bytes(b"")
    os.utime(empty, (time.time() - 120,) * 2)
    busy = fsio.tmp_name(layout.plans / "step-00000001.e1.json")
    busy.write_bytes(b"{")  # a writer at work
    dead = _dead_pid()
    build = layout.root / f".tmp.base_model.{fsio.HOST}.{dead}.abcd1234"
    (build / "sub").mkdir(parents=True)  # a tiny-model build cut short: a directory
    cfg = ShardRLConfig.model_validate({"reward": {"function": "max_digit"}})

    rep = fsck(layout, cfg)
    text = "\n".join(rep.problems)
    assert f"{empty.relative_to(layout.root)} (0 bytes" in text and build.name in text
    assert ".staging-v000001" in text and ".staging-v000002" in text
    assert ".staging-v000003" not in text and busy.name not in text
    fsck(layout, cfg, repair=True)
    assert not empty.exists() and not build.exists() and busy.exists()
    assert sorted(p.name for p in layout.weights.glob(".staging-v*")) == [".staging-v000003"]
    assert fsck(layout, cfg).ok


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
