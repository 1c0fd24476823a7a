"""Published actor weights: versioned HF-format directories and the atomic LATEST pointer.

Publishing version V (trainer side, any number of ranks):
  1. every rank writes its files into ``staging_dir(layout, V)`` (same path on every rank),
  2. one rank calls ``commit_version``: it writes ``manifest.json`` last (version, step, dtype, every file with size
     and digest), renames the directory to ``weights/vXXXXXX`` and then replaces ``weights/LATEST`` atomically.
A publisher killed at any point leaves LATEST on the previous complete version.

Reading (worker side): ``latest_version`` reads the small pointer file (cheap to poll on NFS), ``verify_version``
checks the manifest against the files (sizes, then the digest of every file), so a worker never loads a
half-published or damaged version.  LATEST and the manifest are ``records.LatestPointer`` /
``records.WeightsManifest``.

A file's digest is the sha256 over the sha256 digests of its consecutive ``DIGEST_CHUNK``-byte pieces (the manifest
says so with ``chunk_bytes``), not the sha256 of the whole file: one sha256 stream runs at ~0.8 GB/s, so a 7B
model's 14.5 GB took a worker 17 s to verify on every new version (measured on an H200 host), while pieces hash in
parallel threads (hashlib releases the GIL) and both sides, the trainer while it writes and the worker before it
loads, go as fast as the storage.  Manifests without ``chunk_bytes`` carry the plain sha256 and are checked as such.

A version is full HF weights or, with LoRA (``model.lora.rank`` > 0), a peft adapter directory for the unchanged base
model; its manifest names the base and ``base_model_hash`` of it, which a worker compares with its own base before it
applies the adapter.

A full version may also be stored as a *delta* against an earlier full version (``buffer/deltas.py``): its
safetensors files are then XOR + zstd files and ``delta.json``, listed in the manifest like any file, names the base
and the size and digest of every reconstructed file.  ``verify_version`` checks a delta's own files;
``buffer/localcache.py`` turns it back into full files on a worker's node.  Retention keeps the base of every delta
it keeps.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .deltas import DELTA_RECORD, DeltaError, DeltaRecord, read_delta_record, write_delta_record

# re-exported: the digests of weight files are part of this module's interface
from .digests import (  # noqa: F401
    DIGEST_CHUNK,
    HASH_THREADS,
    StreamDigest,
    WeightsError,
    digest_as,
    file_digests,
    hash_threads,
    sha256_file,
    sha256_files,
)
from .fsio import (
    chmod_file,
    fsync_dir,
    make_dirs,
    naming,
    read_json_or_none,
    retry_transient,
    write_json_atomic,
)
from .layout import RunLayout
from .records import LatestPointer, ManifestFile, RecordError, WeightsManifest, read_record, write_record

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class WeightVersion:
    version: int
    path: Path
    step: int
    dtype: str
    kind: str = "full"  # "full" | "adapter"
    adapter: Path | None = None  # the peft adapter directory of this version, if it has one
    base_sha256: str | None = None  # base_model_hash of the base the adapter applies to
    base: int | None = None  # kind "delta": the full version the delta applies to


def base_model_hash(model_dir: Path) -> str:
    """A cheap fingerprint of a base model: sha256 over its config.json bytes and the names and sizes of its
    safetensors files (and their index).  Reads no weight bytes: it tells a base swapped under a run's path, or a
    worker on another base, from the trainer's base, without hashing gigabytes on every worker start."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    try:
        h.update(b"config.json\0" + (model_dir / "config.json").read_bytes())
    except FileNotFoundError:
        raise WeightsError(f"{model_dir / 'config.json'}: missing; not an HF base model directory") from None
    for p in sorted(model_dir.iterdir()):
        if p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json"):
            h.update(f"\0{p.name}\0{p.stat().st_size}".encode())
    return h.hexdigest()


def staging_dir(layout: RunLayout, version: int) -> Path:
    """Where the ranks write version ``version`` before it is committed (deterministic: every rank agrees)."""
    d = layout.weight_staging(version)
    make_dirs(d)
    return d


def commit_version(
    layout: RunLayout,
    version: int,
    staging: Path,
    *,
    step: int,
    dtype: str,
    known_digests: dict[str, str] | None = None,
    kind: str = "full",
    adapter: str | None = None,
    base_model: str | None = None,
    base_sha256: str | None = None,
    delta: DeltaRecord | None = None,
) -> WeightVersion:
    """Seal ``staging`` as version ``version``: manifest last, rename, then LATEST.

    ``known_digests`` lets writers pass digests they computed while writing (``StreamDigest``); missing ones are
    computed here.
    ``kind``, ``adapter``, ``base_model`` and ``base_sha256`` go into the manifest (``records.WeightsManifest``).
    ``delta``: the version is a delta (its delta files are in ``staging``); the record is written as
    ``delta.json`` and sealed by the manifest with the other files.
    """

    known = known_digests or {}
    if delta is not None:
        if kind != "full" or adapter is not None:
            raise WeightsError(f"{staging}: only full weights without an adapter are published as a delta")
        missing = [e.delta for e in delta.files.values() if not (staging / e.delta).is_file()]
        if not delta.files or missing:
            raise WeightsError(f"{staging}: delta file {missing[0] if missing else '(none)'} missing")
        write_delta_record(staging, delta)
    paths = [p for p in sorted(staging.rglob("*")) if p.is_file() and p.name != MANIFEST]
    for p in paths:
        with naming(p), open(p, "rb+") as f:
            # readable under the run's mode whoever wrote it (some libraries write 0600), and durable
            chmod_file(f.fileno())
            os.fsync(f.fileno())
    rels = [str(p.relative_to(staging)) for p in paths]
    unknown = [p for p, rel in zip(paths, rels, strict=True) if not known.get(rel)]
    computed = dict(zip(unknown, file_digests(unknown), strict=True))
    files = {
        rel: ManifestFile(
            size=p.stat().st_size, sha256=known.get(rel) or computed[p], chunk_bytes=DIGEST_CHUNK
        )
        for p, rel in zip(paths, rels, strict=True)
    }
    if delta is None and not any(name.endswith(".safetensors") for name in files):
        raise WeightsError(f"{staging}: no *.safetensors file to publish")
    if delta is not None and DELTA_RECORD not in files:
        raise WeightsError(f"{staging / DELTA_RECORD}: not written")
    if adapter is not None and not (staging / adapter / "adapter_config.json").is_file():
        raise WeightsError(f"{staging / adapter}: no adapter_config.json in the adapter directory")
    manifest = WeightsManifest.validated(
        {
            "version": version,
            "step": step,
            "dtype": dtype,
            "created_at": time.time(),
            "files": files,
            "kind": kind,
            "adapter": adapter,
            "base_model": base_model,
            "base_sha256": base_sha256,
            "delta_of": None if delta is None else delta.base,
        },
        staging / MANIFEST,
    )
    write_record(staging / MANIFEST, manifest)
    final = layout.weight_version(version)
    if final.exists():
        raise WeightsError(f"{final}: version {version} is already published")
    staging.rename(final)
    fsync_dir(layout.weights)
    write_latest(layout, version, step, delta_of=manifest.delta_of)
    return _weight_version(final, manifest)


def write_latest(layout: RunLayout, version: int, step: int, *, delta_of: int | None = None) -> None:
    """Point LATEST at ``version`` (atomically); ``commit_version`` does this once the version is sealed.
    ``delta_of``: the full version that ``version`` is a delta against (None: a full version)."""
    write_record(
        layout.latest_pointer,
        LatestPointer(
            version=version, path=layout.weight_version(version).name, step=step, delta_of=delta_of
        ),
    )


def latest_version(layout: RunLayout) -> int:
    """The version LATEST points at; 0 (the base model) when nothing has been published.

    A LATEST that is not a valid pointer raises RecordError: loading or numbering versions from a guess is worse.
    """
    try:
        return read_record(LatestPointer, layout.latest_pointer, attempts=2).version
    except FileNotFoundError:
        return 0


def verify_version(layout: RunLayout, version: int, *, checksums: bool = True) -> WeightVersion:
    """Check version ``version`` against its manifest; raise WeightsError naming what is wrong.

    Sizes first (cheap, and they catch a version still being copied), then the digest of every file
    (``checksums=False`` skips those: only for a caller that hashes the files itself).  The digest is the one the
    manifest names: pieces of ``chunk_bytes`` (``file_digests``), or without it the plain sha256 of older manifests.
    """
    path = layout.weight_version(version)
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        raise WeightsError(f"{path / MANIFEST}: missing (version not published or deleted)") from None
    except RecordError as e:
        raise WeightsError(str(e)) from None
    if manifest.version != version:
        raise WeightsError(f"{path / MANIFEST}: field version is {manifest.version}, expected {version}")
    seen = []
    for rel, meta in sorted(manifest.files.items()):
        f = path / rel
        try:
            st = retry_transient(f.stat)
        except FileNotFoundError:
            raise WeightsError(f"{f}: listed in the manifest but missing") from None
        if st.st_size != meta.size:
            raise WeightsError(f"{f}: size {st.st_size} != manifest size {meta.size}")
        seen.append((rel, st.st_ino, st.st_size, st.st_mtime_ns))
    if checksums:
        _check_sha256(path, manifest, tuple(seen))
    return _weight_version(path, manifest)


_hash_failures: dict[tuple, str] = {}


def _check_sha256(path: Path, manifest: WeightsManifest, seen: tuple) -> None:
    """Hash every file of the version; a mismatch is remembered with the files' identity and times, so that a
    worker polling a damaged LATEST every second does not hash it again until something changes."""
    key = (path, manifest.created_at, seen)
    if key in _hash_failures:
        raise WeightsError(_hash_failures[key])
    rels = [rel for rel, *_ in seen]
    for rel, digest in zip(rels, _digests(path, manifest, rels), strict=True):
        if digest != manifest.files[rel].sha256:
            if len(_hash_failures) > 64:
                _hash_failures.clear()
            _hash_failures[key] = f"{path / rel}: sha256 does not match the manifest (damaged or replaced)"
            raise WeightsError(_hash_failures[key])


def _digests(path: Path, manifest: WeightsManifest, rels: list[str]) -> list[str]:
    """Each file's digest in the form its manifest entry uses."""
    out: dict[str, str] = {}
    for chunk in {manifest.files[rel].chunk_bytes for rel in rels}:
        mine = [rel for rel in rels if manifest.files[rel].chunk_bytes == chunk]
        paths = [path / rel for rel in mine]
        digests = sha256_files(paths) if chunk is None else file_digests(paths, chunk)
        out.update(zip(mine, digests, strict=True))
    return [out[rel] for rel in rels]


def _weight_version(path: Path, manifest: WeightsManifest) -> WeightVersion:

    adapter = path / manifest.adapter if manifest.adapter is not None else None
    delta = read_delta_record(path) if DELTA_RECORD in manifest.files else None
    return WeightVersion(
        manifest.version,
        path,
        manifest.step,
        manifest.dtype,
        "delta" if delta is not None else manifest.kind,
        adapter,
        manifest.base_sha256,
        delta.base if delta is not None else None,
    )


def read_latest(layout: RunLayout, *, checksums: bool = True) -> WeightVersion | None:
    """The newest complete, verified version, or None when only the base model exists."""
    v = latest_version(layout)
    return verify_version(layout, v, checksums=checksums) if v > 0 else None


def published_versions(layout: RunLayout) -> list[int]:
    out = []
    if layout.weights.is_dir():
        for p in layout.weights.iterdir():
            if p.name.startswith("v") and p.name[1:].isdigit() and (p / MANIFEST).exists():
                out.append(int(p.name[1:]))
    return sorted(out)


def retained(versions: list[int], keep: int, every: int = 0) -> set[int]:
    """The versions retention keeps of ``versions`` (sorted): the newest ``keep``, and with ``every`` > 0 each
    multiple of ``every`` (milestones: a version's number, not its position, so a gap never shifts them)."""
    newest = set(versions[-keep:]) if keep > 0 else set(versions)
    return newest | ({v for v in versions if v % every == 0} if every > 0 else set())


def delta_base(layout: RunLayout, version: int) -> int | None:
    """The full version that version ``version`` is a delta against; None for a full (or missing) version.  A delta
    whose record cannot be read names no base: it cannot be reconstructed anyway.

    The manifest says whether there is a delta record; only then is it read.  Reading an absent one would wait out
    every retry that a missing file gets on a network filesystem (0.75 s), for each full version at each collection.
    """
    path = layout.weight_version(version)
    try:
        if DELTA_RECORD not in read_manifest(path).files:
            return None
        record = read_delta_record(path)
    except (DeltaError, RecordError, OSError):
        return None
    return record.base if record is not None else None


def best_version(layout: RunLayout) -> tuple[int, float] | None:
    """The evaluator's best-scoring version and its score (``weights/BEST.json``), or None (no evaluator, nothing
    scored yet, or an unreadable record: then nothing extra is kept)."""
    rec = read_json_or_none(layout.best_pointer)
    if not isinstance(rec, dict):
        return None
    version, score = rec.get("version"), rec.get("score")
    if not isinstance(version, int) or isinstance(version, bool) or not isinstance(score, (int, float)):
        return None
    return version, float(score)


def record_best(layout: RunLayout, version: int, score: float) -> None:
    """Name ``version`` the best so far (the evaluator calls this when a version beats the recorded best)."""
    write_json_atomic(layout.best_pointer, {"version": version, "score": score, "at": time.time()})


def garbage_collect(layout: RunLayout, keep: int, in_use: Iterable[int], every: int = 0) -> list[int]:
    """Delete the versions ``retained`` does not keep (the newest ``keep``, multiples of ``every``), never LATEST,
    the evaluator's best (``BEST.json``), nor one a live worker reports as loaded, nor the full base of a delta
    version that is kept.

    Deleting a directory another node still reads gives it ESTALE/SIGBUS, hence ``in_use`` (from status records).
    """
    best = best_version(layout)
    protected = set(in_use) | {latest_version(layout)} | ({best[0]} if best is not None else set())
    versions = published_versions(layout)
    kept = retained(versions, keep, every) | protected
    kept |= {b for v in kept if v in versions and (b := delta_base(layout, v)) is not None}
    doomed = [v for v in versions if v not in kept]
    for v in doomed:
        shutil.rmtree(layout.weight_version(v), ignore_errors=True)
    return doomed


def abandoned_staging(layout: RunLayout) -> list[Path]:
    """Staging directories of versions that are already published or older than LATEST (a publisher died)."""
    latest = latest_version(layout)
    out = []
    if layout.weights.is_dir():
        for p in layout.weights.iterdir():
            if p.name.startswith(".staging-v") and p.name[len(".staging-v") :].isdigit():
                v = int(p.name[len(".staging-v") :])
                if v <= latest and p == layout.weight_staging(v):
                    out.append(p)
    return out


def read_manifest(path: Path) -> WeightsManifest:
    """The manifest of the version directory ``path``; RecordError when it is not a valid manifest."""
    return read_record(WeightsManifest, path / MANIFEST)


def manifest_of(path: Path) -> dict:
    """The manifest as a JSON object (``read_manifest`` is the typed one)."""
    return read_manifest(path).to_json()
