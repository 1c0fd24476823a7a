"""The node-local copy of weight versions that the rollout workers of one node share.

Without it every worker read each version twice from shared storage (every byte hashed to verify it, then read again
by its engine): at 7B and 64 workers, ~1.9 TB a version.  With it the first worker of a node that needs version V
copies it from the run directory into ``rollout.local_cache_dir`` once, checks every copied file against the
version's manifest there, turns a delta version back into full files (``buffer/deltas.py``, against the base's
local copy, materialised the same way first), and renames the result into place; the node's other workers find the
finished directory and load it without touching shared storage.  A file lock per version (``filelock``, on the
local disk) makes the first worker the only one: the others wait for it and then find the version there.

A cached directory is a full version (its own ``manifest.json``: the run's one, or for a delta one written for the
reconstructed files), so engines load it as they load a published one.  After each version is materialised the
cache is pruned to the newest ``keep`` versions, plus the bases the kept deltas were made from (the next delta needs
the same base).  Failures (a damaged file, a missing base, a full local disk) are ``WeightsError`` lines; the same
failure of an unchanged version is remembered for a while, so a worker polling a damaged LATEST every second does
not copy it every second.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .deltas import DELTA_RECORD, DeltaError, base_tensors, decode_file, manifest_sha256, read_delta_record
from .fsio import naming
from .layout import RunLayout
from .records import ManifestFile, RecordError, WeightsManifest, write_record
from .weights import (
    MANIFEST,
    WeightsError,
    WeightVersion,
    file_digests,
    read_manifest,
    sha256_files,
    verify_version,
)

KEEP = 3  # versions kept on a node (and the bases they need)
FAILURE_TTL_S = 300.0  # how long a version that failed unchanged is not tried again
_BASE_MARK = ".delta-base"  # in a cached delta's directory: the number of the base it was made from
_COPY_BLOCK = 16 << 20


def default_cache_dir(run_id: str) -> Path:
    """``rollout.local_cache_dir`` when it is empty: the node's temporary directory (``TMPDIR``), per run."""
    return Path(tempfile.gettempdir()) / f"shardrl-cache-{run_id}"


@dataclass
class NodeCache:
    """Weight versions of the run at ``layout``, copied or reconstructed under ``root`` on this node."""

    layout: RunLayout
    root: Path
    keep: int = KEEP
    shared_bytes_read: int = 0  # bytes this process read from the run directory's version files
    built: list[int] = field(default_factory=list)  # versions this process materialised (not found ready)
    _failures: dict[int, tuple[tuple, float, str]] = field(default_factory=dict)

    @classmethod
    def of_run(cls, layout: RunLayout) -> NodeCache:
        """The cache the run's config names (``rollout.local_cache_dir``, default ``default_cache_dir``)."""
        from .run import open_run

        try:
            run = open_run(layout.root)
        except ValueError as e:  # ConfigError: an unreadable run is reported, not raised past the worker
            raise WeightsError(str(e)) from None
        configured = run.config.rollout.local_cache_dir
        return cls(layout, Path(configured) if configured else default_cache_dir(run.run_id))

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def _lock(self, version: int) -> Path:
        return self.root / f".v{version:06d}.lock"

    def _tmp(self, version: int) -> Path:
        return self.root / f".tmp-v{version:06d}"

    def ready(self, version: int) -> WeightVersion | None:
        """The cached version when it is complete here (its files have the sizes its manifest says), else None."""
        d = self.path(version)
        if not (d / MANIFEST).is_file():  # the common miss, without read_record's retries of a missing file
            return None
        try:
            manifest = read_manifest(d)
            for rel, meta in manifest.files.items():
                if (d / rel).stat().st_size != meta.size:
                    return None
        except (OSError, RecordError):
            return None
        return WeightVersion(
            version,
            d,
            manifest.step,
            manifest.dtype,
            manifest.kind,
            d / manifest.adapter if manifest.adapter is not None else None,
            manifest.base_sha256,
        )

    def materialise(self, version: int) -> WeightVersion:
        """Version ``version`` as full files on this node, made here by this process or found made by another;
        then the cache is pruned.  WeightsError (one line) when it cannot be made."""
        wv = self._materialise(version)
        with contextlib.suppress(OSError):
            self.prune(protect={version})
        return wv

    def _materialise(self, version: int) -> WeightVersion:
        from filelock import FileLock, Timeout

        found = self.ready(version)
        if found is not None:
            return found
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self._lock(version))):
                found = self.ready(version)  # made by another worker while we waited
                if found is not None:
                    return found
                return self._build(version)
        except Timeout as e:  # not with a blocking lock; kept so a lock error is never a crash
            raise WeightsError(f"{self._lock(version)}: {e}") from None
        except OSError as e:
            hint = (
                f" (rollout.local_cache_dir must be a local disk with room for {self.keep} versions)"
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
                else ""
            )
            raise WeightsError(f"copying v{version} into {self.root}: {e}{hint}") from None

    def _identity(self, src: Path, manifest: WeightsManifest) -> tuple:
        ids = []
        for rel in sorted(manifest.files):
            with contextlib.suppress(OSError):
                st = (src / rel).stat()
                ids.append((rel, st.st_ino, st.st_size, st.st_mtime_ns))
        return (manifest.created_at, tuple(ids))

    def _build(self, version: int) -> WeightVersion:
        src = self.layout.weight_version(version)
        shared = verify_version(
            self.layout, version, checksums=False
        )  # sizes: cheap, and names what is missing
        manifest = read_manifest(src)
        key = self._identity(src, manifest)
        failed = self._failures.get(version)
        if failed is not None and failed[0] == key and time.monotonic() - failed[1] < FAILURE_TTL_S:
            raise WeightsError(failed[2])
        tmp = self._tmp(version)
        shutil.rmtree(tmp, ignore_errors=True)  # a builder that died: we hold the version's lock
        try:
            tmp.mkdir()
            self._copy_checked(src, tmp, manifest)
            if shared.kind == "delta":
                self._reconstruct(version, tmp, manifest)
            os.rename(tmp, self.path(version))
        except WeightsError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if len(self._failures) > 64:
                self._failures.clear()
            self._failures[version] = (key, time.monotonic(), str(e))
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.built.append(version)
        found = self.ready(version)
        if found is None:
            raise WeightsError(f"{self.path(version)}: incomplete right after it was made")
        return found

    def _copy_checked(self, src: Path, dest: Path, manifest: WeightsManifest) -> None:
        """Copy the version's files (one read of each byte of shared storage), then check the copies against the
        manifest's digests: a damaged file is named by its path in the run directory."""
        rels = sorted(manifest.files)
        for rel in [*rels, MANIFEST]:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            self._copy(src / rel, dest / rel)
        by_chunk: dict[int | None, list[str]] = {}
        for rel in rels:
            by_chunk.setdefault(manifest.files[rel].chunk_bytes, []).append(rel)
        for chunk, group in by_chunk.items():
            paths = [dest / rel for rel in group]
            digests = sha256_files(paths) if chunk is None else file_digests(paths, chunk)
            for rel, digest in zip(group, digests, strict=True):
                if digest != manifest.files[rel].sha256:
                    raise WeightsError(
                        f"{src / rel}: sha256 does not match the manifest (damaged or replaced)"
                    )

    def _copy(self, src: Path, dest: Path) -> None:
        with naming(src), open(src, "rb", buffering=0) as fin, naming(dest), open(dest, "wb") as fout:
            buf = bytearray(_COPY_BLOCK)
            view = memoryview(buf)
            while n := fin.readinto(buf):
                fout.write(view[:n])
                self.shared_bytes_read += n

    def _reconstruct(self, version: int, tmp: Path, manifest: WeightsManifest) -> None:
        """Turn the delta files copied into ``tmp`` into the full files, against the base's local copy."""
        record = read_delta_record(tmp)
        assert record is not None
        if record.base >= version:
            raise DeltaError(f"{tmp / DELTA_RECORD}: base v{record.base} is not older than v{version}")
        try:
            base = self._materialise(record.base)
        except WeightsError as e:
            raise DeltaError(
                f"v{version} is a delta against v{record.base}, which cannot be used: {e}"
            ) from None
        if base.kind != "full" or (base.path / _BASE_MARK).exists():
            raise DeltaError(f"v{version}: its base v{record.base} is not a full version")
        if manifest_sha256(base.path) != record.base_manifest_sha256:
            raise DeltaError(
                f"v{version}: its base v{record.base} is not the one it was made from (manifest sha256 differs)"
            )
        files = {rel: m for rel, m in manifest.files.items() if rel != DELTA_RECORD}
        with base_tensors(base.path) as tensors:
            for target, entry in sorted(record.files.items()):
                decode_file(tmp / entry.delta, entry, tensors, tmp / target)
                (tmp / entry.delta).unlink()
                files.pop(entry.delta, None)
                files[target] = ManifestFile(
                    size=entry.size, sha256=entry.sha256, chunk_bytes=entry.chunk_bytes
                )
        (tmp / DELTA_RECORD).unlink()
        (tmp / _BASE_MARK).write_text(f"{record.base}\n")
        local = WeightsManifest.validated(
            {**manifest.to_json(), "files": {k: v.model_dump() for k, v in files.items()}}, tmp / MANIFEST
        )
        write_record(tmp / MANIFEST, local)

    def _base_of(self, version: int) -> int | None:
        try:
            return int((self.path(version) / _BASE_MARK).read_text())
        except (OSError, ValueError):
            return None

    def prune(self, protect: Iterable[int] = ()) -> list[int]:
        """Delete cached versions but the newest ``keep``, the bases they were made from and ``protect``; and
        temporaries whose builder is gone.  Returns the versions deleted."""
        from filelock import FileLock, Timeout

        try:
            names = [p.name for p in self.root.iterdir()]
        except FileNotFoundError:
            return []
        cached = sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit())
        kept = set(cached[-self.keep :]) | set(protect)
        kept |= {b for v in kept if (b := self._base_of(v)) is not None}
        doomed = []
        for v in cached:
            if v in kept:
                continue
            try:  # a version being made or re-made is left alone
                with FileLock(str(self._lock(v)), timeout=0):
                    shutil.rmtree(self.path(v), ignore_errors=True)
                    doomed.append(v)
            except Timeout:
                continue
        for n in names:
            if n.startswith(".tmp-v") and n[6:].isdigit() and int(n[6:]) not in kept:
                with contextlib.suppress(Timeout), FileLock(str(self._lock(int(n[6:]))), timeout=0):
                    shutil.rmtree(self.root / n, ignore_errors=True)
        return doomed
