"""Digests of weight files, and the error of a weight version that does not verify (used by ``weights`` and
``deltas`` alike).

A manifest digest is the sha256 over the sha256 digests of a file's ``DIGEST_CHUNK``-byte pieces, so the pieces of
one large file are hashed in parallel threads; ``StreamDigest`` computes it while the file is being written.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .fsio import naming, retry_transient

HASH_THREADS = 8  # sha256 runs at ~1-2 GB/s per core: a few threads keep up with a parallel file system
DIGEST_CHUNK = 64 << 20  # bytes per independently hashed piece of a weight file


class WeightsError(RuntimeError):
    """A weight version is missing, incomplete or does not match its manifest."""


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with naming(path), open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> list[str]:
    """``sha256_file`` of each path, in parallel threads (one file alone is hashed in this thread)."""
    if len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(min(len(paths), HASH_THREADS, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_file, paths))


def hash_threads(tasks: int) -> int:
    return max(1, min(tasks, HASH_THREADS, os.cpu_count() or 1))


def _sha256_parts(parts: list[memoryview]) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()


def _digest_of(piece_digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(piece_digests)).hexdigest()


def _hash_piece(path: Path, offset: int, length: int, block: int = 8 << 20) -> bytes:
    h = hashlib.sha256()
    buf = bytearray(min(block, max(length, 1)))
    view = memoryview(buf)
    with naming(path), open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        while length > 0:
            n = os.preadv(fd, [view[: min(length, len(buf))]], offset)
            if n == 0:
                break  # shorter than its size a moment ago: the digest will not match
            h.update(view[:n])
            offset, length = offset + n, length - n
    return h.digest()


def file_digests(paths: list[Path], chunk: int | None = None) -> list[str]:
    """The manifest digest of each file (sha256 over the sha256 digests of its ``chunk``-byte pieces; one empty piece
    for an empty file), every piece of every file hashed in parallel threads; ``chunk`` defaults to
    ``DIGEST_CHUNK``."""
    chunk = chunk or DIGEST_CHUNK
    pieces = []
    for i, p in enumerate(paths):
        size = retry_transient(p.stat).st_size
        pieces += [(i, p, off, min(chunk, size - off)) for off in range(0, max(size, 1), chunk)]
    with ThreadPoolExecutor(hash_threads(len(pieces))) as pool:
        digests = list(pool.map(lambda t: _hash_piece(t[1], t[2], t[3]), pieces))
    by_file: list[list[bytes]] = [[] for _ in paths]
    for (i, *_), d in zip(pieces, digests, strict=True):
        by_file[i].append(d)
    return [_digest_of(ds) for ds in by_file]


def digest_as(path: Path, chunk_bytes: int | None) -> str:
    """``path``'s digest in the form of a manifest entry with this ``chunk_bytes`` (None: the plain sha256)."""
    return sha256_file(path) if chunk_bytes is None else file_digests([path], chunk_bytes)[0]


class StreamDigest:
    """The manifest digest of a file written as a stream of blocks, its pieces hashed in ``pool``'s threads.

    Blocks must stay unchanged until ``hexdigest`` returns (the writer's staged host memory does)."""

    def __init__(self, pool: ThreadPoolExecutor, chunk: int | None = None):
        self.pool, self.chunk = pool, chunk or DIGEST_CHUNK
        self._parts: list[memoryview] = []
        self._fill = 0
        self._pieces: list[Future[bytes]] = []

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.chunk - self._fill)
            self._parts.append(data[:take])
            self._fill += take
            data = data[take:]
            if self._fill == self.chunk:
                self._piece()

    def _piece(self) -> None:
        self._pieces.append(self.pool.submit(_sha256_parts, self._parts))
        self._parts, self._fill = [], 0

    def hexdigest(self) -> str:
        if self._parts or not self._pieces:
            self._piece()
        return _digest_of([f.result() for f in self._pieces])
