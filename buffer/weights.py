"""Published actor weights: versioned HF-format directories and the atomic LATEST pointer.

Publishing version V (trainer side, any number of ranks):
  1. every rank writes its files into ``staging_dir(layout, V)`` (same path on every rank),
  2. one rank calls ``commit_version``: it writes ``manifest.json`` last (version, step, dtype, every file with size
     and sha256), renames the directory to ``weights/vXXXXXX`` and then replaces ``weights/LATEST`` atomically.
A publisher killed at any point leaves LATEST on the previous complete version.

Reading (worker side): ``latest_version`` reads the small pointer file (cheap to poll on NFS), ``verify_version``
checks the manifest against the files (sizes always, checksums optionally), so a worker never loads a half-published
or damaged version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .fsio import (
    fsync_dir,
    read_json,
    read_json_or_none,
    retry_transient,
    write_json_atomic,
)
from .layout import RunLayout

MANIFEST = "manifest.json"


class WeightsError(RuntimeError):
    """A weight version is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class WeightVersion:
    version: int
    path: Path
    step: int
    dtype: str


def staging_dir(layout: RunLayout, version: int) -> Path:
    """Where the ranks write version ``version`` before it is committed (deterministic: every rank agrees)."""
    d = layout.weights / f".staging-v{version:06d}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def commit_version(
    layout: RunLayout,
    version: int,
    staging: Path,
    *,
    step: int,
    dtype: str,
    file_sha256: dict[str, str] | None = None,
) -> WeightVersion:
    """Seal ``staging`` as version ``version``: manifest last, rename, then LATEST.

    ``file_sha256`` lets writers pass digests they computed while writing; missing ones are computed here.
    """
    known = file_sha256 or {}
    files = {}
    for p in sorted(staging.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = str(p.relative_to(staging))
            with open(p, "rb+") as f:  # the writer may have been another process: make its bytes durable
                os.fsync(f.fileno())
            files[rel] = {"size": p.stat().st_size, "sha256": known.get(rel) or sha256_file(p)}
    if not any(name.endswith(".safetensors") for name in files):
        raise WeightsError(f"{staging}: no *.safetensors file to publish")
    manifest = {"version": version, "step": step, "dtype": dtype, "created_at": time.time(), "files": files}
    write_json_atomic(staging / MANIFEST, manifest)
    final = layout.weight_version(version)
    if final.exists():
        raise WeightsError(f"{final}: version {version} is already published")
    staging.rename(final)
    fsync_dir(layout.weights)
    write_json_atomic(layout.latest_pointer, {"version": version, "path": final.name, "step": step})
    return WeightVersion(version, final, step, dtype)


def latest_version(layout: RunLayout) -> int:
    """The version LATEST points at; 0 (the base model) when nothing has been published."""
    ptr = read_json_or_none(layout.latest_pointer)
    if not isinstance(ptr, dict) or not isinstance(ptr.get("version"), int):
        return 0
    return int(ptr["version"])


def verify_version(layout: RunLayout, version: int, *, checksums: bool = False) -> WeightVersion:
    """Check version ``version`` against its manifest; raise WeightsError naming what is wrong."""
    path = layout.weight_version(version)
    try:
        manifest = retry_transient(lambda: read_json(path / MANIFEST))
    except FileNotFoundError:
        raise WeightsError(f"{path / MANIFEST}: missing (version not published or deleted)") from None
    except ValueError as e:
        raise WeightsError(f"{path / MANIFEST}: not valid JSON: {e}") from None
    if manifest.get("version") != version:
        raise WeightsError(
            f"{path / MANIFEST}: field version is {manifest.get('version')!r}, expected {version}"
        )
    for rel, meta in manifest.get("files", {}).items():
        f = path / rel
        try:
            size = retry_transient(f.stat).st_size
        except FileNotFoundError:
            raise WeightsError(f"{f}: listed in the manifest but missing") from None
        if size != meta["size"]:
            raise WeightsError(f"{f}: size {size} != manifest size {meta['size']}")
        if checksums and sha256_file(f) != meta["sha256"]:
            raise WeightsError(f"{f}: sha256 does not match the manifest")
    return WeightVersion(version, path, int(manifest.get("step", 0)), str(manifest.get("dtype", "")))


def read_latest(layout: RunLayout, *, checksums: bool = False) -> WeightVersion | None:
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


def garbage_collect(layout: RunLayout, keep: int, in_use: Iterable[int]) -> list[int]:
    """Delete all but the newest ``keep`` versions, never LATEST nor one a live worker reports as loaded.

    Deleting a directory another node still reads gives it ESTALE/SIGBUS, hence ``in_use`` (from status records).
    """
    protected = set(in_use) | {latest_version(layout)}
    versions = published_versions(layout)
    doomed = [v for v in versions[:-keep] if v not in protected] if keep > 0 else []
    for v in doomed:
        shutil.rmtree(layout.weight_version(v), ignore_errors=True)
    return doomed


def abandoned_staging(layout: RunLayout) -> list[Path]:
    """Staging directories of versions that are already published or older than LATEST (a publisher died)."""
    latest = latest_version(layout)
    out = []
    if layout.weights.is_dir():
        for p in layout.weights.iterdir():
            if p.name.startswith(".staging-v"):
                v = int(p.name.removeprefix(".staging-v"))
                if v <= latest:
                    out.append(p)
    return out


def manifest_of(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())
