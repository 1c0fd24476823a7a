"""Delta weight versions: each safetensors file of a version as the XOR of its tensors' raw bytes against the same
tensors of an earlier full version (the base), zstd-compressed.

Why XOR: the trainer keeps fp32 master weights and publishes bf16; after a step at a small learning rate most bf16
values round to the bytes they had, so the XOR of two versions is mostly zero bytes and compresses to a few percent
(docs/PERFORMANCE.md, "Delta weight versions").  XOR is its own inverse, exact for every dtype, and needs no
arithmetic on the values: reconstruction is bit-exact by construction, and checked against the digest of the full
file anyway.

A delta version directory holds, besides the small files of a full version (config, index, tokenizer), for each
safetensors file ``F`` of the full version a file ``F + DELTA_SUFFIX``: the header of ``F`` verbatim, then for each
tensor of ``F`` in file order its bytes cut in ``frame_bytes`` pieces, each piece XORed with the base tensor's bytes
(or left as is, for a tensor the base lacks or has with another dtype or shape) and compressed as one zstd frame.
``delta.json`` (``DeltaRecord``) names the base version, the sha256 of the base's ``manifest.json`` (so a delta is
never applied to another base), and for each ``F`` its size and manifest digest as a full file, and each tensor's
compressed frame sizes.  It is listed in the version's manifest like every other file, so the manifest seals it.

Frames are independent: both sides compress and decompress them in parallel threads (zstd and numpy drop the GIL),
a window of them at a time, so memory stays bounded by a few frames per thread.  Run by the trainer's publisher
(``trainer/publish.py``) and by the node-local cache of the rollout workers (``buffer/localcache.py``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from .digests import DIGEST_CHUNK, StreamDigest, WeightsError, hash_threads
from .fsio import naming
from .records import Record, read_record, write_record

DELTA_RECORD = "delta.json"
DELTA_SUFFIX = ".xor.zst"
FRAME_BYTES = 8 << 20  # raw bytes per independently compressed frame
ZSTD_LEVEL = 1  # mostly-zero input: higher levels shrink it little and cost several times the CPU
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one we wrote
_WINDOW_PER_THREAD = 4  # frames in flight per thread


class DeltaError(WeightsError):
    """A delta that cannot be applied: damaged, made against another base, or not matching its record."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class DeltaTensor(_Strict):
    name: str
    nbytes: int = Field(ge=0)
    xor: bool  # False: the bytes as they are (the base has no tensor of this name, dtype and shape)
    frames: list[int]  # compressed size of each consecutive frame_bytes piece


class DeltaFile(_Strict):
    """One safetensors file of the version, stored as ``delta``; size and digest are the reconstructed file's."""

    delta: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    chunk_bytes: int = Field(ge=1)
    header_bytes: int = Field(ge=8)
    frame_bytes: int = Field(ge=1)
    tensors: list[DeltaTensor]


class DeltaRecord(Record):
    """``weights/vXXXXXX/delta.json``: this version is a delta against the full version ``base``."""

    schema_version: Literal[1] = 1
    max_bytes: ClassVar[int] = 64 << 20
    base: int = Field(ge=1)
    base_manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    codec: Literal["zstd"] = "zstd"
    files: dict[str, DeltaFile]


@dataclass(frozen=True)
class Span:
    """A tensor of a safetensors file: dtype, shape and byte range relative to the end of the header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def parse_header(head: bytes, source: Path | str) -> tuple[int, list[Span]]:
    """(header bytes including the 8-byte length, tensors in file order) of a safetensors file starting with
    ``head`` (at least the whole header); DeltaError when it is not a safetensors header."""
    if len(head) < 8:
        raise DeltaError(f"{source}: too short for a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER or len(head) < 8 + n:
        raise DeltaError(f"{source}: safetensors header of {n} bytes is cut short or implausible")
    try:
        meta = json.loads(bytes(head[8 : 8 + n]))
        spans = [
            Span(k, v["dtype"], tuple(v["shape"]), int(v["data_offsets"][0]), int(v["data_offsets"][1]))
            for k, v in meta.items()
            if k != "__metadata__"
        ]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise DeltaError(f"{source}: not a safetensors header ({e})") from None
    spans.sort(key=lambda s: s.start)
    pos = 0
    for s in spans:
        if s.start != pos or s.end < s.start:
            raise DeltaError(
                f"{source}: tensor {s.name} at bytes {s.start}..{s.end}, expected to start at {pos}"
            )
        pos = s.end
    return 8 + n, spans


def read_header(path: Path) -> bytes:
    """The header of the safetensors file ``path`` (the 8-byte length included)."""
    with naming(path), open(path, "rb") as f:
        first = f.read(8)
        if len(first) < 8:
            raise DeltaError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", first)
        if n > MAX_HEADER:
            raise DeltaError(f"{path}: safetensors header of {n} bytes is implausible")
        return first + f.read(n)


BaseTensors = Mapping[str, tuple[str, tuple[int, ...], memoryview]]  # name -> (dtype, shape, bytes)


def tensors_of(
    header: bytes, body: memoryview, source: str
) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
    """The tensors of a safetensors file given as its header and the bytes after it."""
    _, spans = parse_header(header, source)
    return {s.name: (s.dtype, s.shape, body[s.start : s.end]) for s in spans}


@contextmanager
def base_tensors(version_dir: Path) -> Iterator[dict[str, tuple[str, tuple[int, ...], memoryview]]]:
    """Every tensor of the safetensors files of the full version ``version_dir``, mapped read-only from disk."""
    maps: list[mmap.mmap] = []
    views: list[memoryview] = []
    out: dict[str, tuple[str, tuple[int, ...], memoryview]] = {}
    try:
        for p in sorted(version_dir.rglob("*.safetensors")):
            if p.relative_to(version_dir).parts[0] != p.name:
                continue  # a merged version's adapter/: not base weights
            with naming(p), open(p, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise DeltaError(f"{p}: too short for a safetensors file")
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            maps.append(m)
            view = memoryview(m)
            views.append(view)
            (n,) = struct.unpack("<Q", view[:8])
            if n > MAX_HEADER or 8 + n > size:
                raise DeltaError(f"{p}: not a safetensors file")
            header_bytes, spans = parse_header(bytes(view[: 8 + n]), p)
            for s in spans:
                piece = view[header_bytes + s.start : header_bytes + s.end]
                views.append(piece)
                out[s.name] = (s.dtype, s.shape, piece)
        yield out
    finally:
        out.clear()
        for v in reversed(views):
            v.release()
        for m in maps:
            m.close()


_local = threading.local()


def _compressor() -> Any:
    import zstandard

    c = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _decompressor() -> Any:
    import zstandard

    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _xor(a: memoryview | bytes, b: memoryview) -> memoryview:
    import numpy as np

    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    if len(x) % 8 == 0:  # eight bytes at a time: the same result, fewer loop steps
        return np.bitwise_xor(x.view(np.uint64), y.view(np.uint64)).view(np.uint8).data
    return np.bitwise_xor(x, y).data


def _encode_frame(piece: memoryview, base: memoryview | None) -> bytes:
    return bytes(_compressor().compress(piece if base is None else _xor(piece, base)))


def _decode_frame(frame: bytes, nbytes: int, base: memoryview | None, where: str) -> memoryview:
    import zstandard

    try:
        raw = _decompressor().decompress(frame, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise DeltaError(f"{where}: damaged frame ({e})") from None
    if len(raw) != nbytes:
        raise DeltaError(f"{where}: frame holds {len(raw)} bytes, expected {nbytes}")
    return memoryview(raw) if base is None else _xor(raw, base)


def _ordered(pool: ThreadPoolExecutor, jobs: Iterator[Callable[[], Any]], window: int) -> Iterator[Any]:
    """Run ``jobs`` in ``pool``, at most ``window`` at a time, yielding their results in order."""
    pending: deque[Future[Any]] = deque()
    for job in jobs:
        pending.append(pool.submit(job))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _pieces(nbytes: int, frame_bytes: int) -> list[tuple[int, int]]:
    return [(off, min(frame_bytes, nbytes - off)) for off in range(0, nbytes, frame_bytes)]


def _matching(span: Span, base: BaseTensors) -> memoryview | None:
    hit = base.get(span.name)
    if (
        hit is None
        or hit[0] != span.dtype
        or tuple(hit[1]) != span.shape
        or len(hit[2]) != span.end - span.start
    ):
        return None
    return hit[2]


def encode_file(
    out: Path, header: bytes, body: memoryview, base: BaseTensors, *, frame_bytes: int = FRAME_BYTES
) -> DeltaFile:
    """Write the delta of the safetensors file ``header + body`` against ``base`` to ``out`` (fsynced); its entry
    for ``DeltaRecord.files``, with the full file's size and manifest digest (hashed here, in parallel)."""
    header_bytes, spans = parse_header(header, out.name)
    if header_bytes != len(header) or (spans and spans[-1].end != len(body)):
        raise DeltaError(f"{out.name}: header and body do not match ({len(header)} + {len(body)} bytes)")
    threads = hash_threads(os.cpu_count() or 1)
    tensors: list[DeltaTensor] = []
    with ThreadPoolExecutor(threads, "delta-encode") as pool, naming(out), open(out, "wb") as f:
        digest = StreamDigest(pool, DIGEST_CHUNK)
        digest.update(memoryview(header))
        digest.update(body)  # hashed in the pool while the frames compress
        f.write(header)

        def jobs() -> Iterator[Callable[[], bytes]]:
            for s in spans:
                b = _matching(s, base)
                for off, n in _pieces(s.end - s.start, frame_bytes):
                    piece = body[s.start + off : s.start + off + n]
                    yield partial(_encode_frame, piece, None if b is None else b[off : off + n])

        frames = _ordered(pool, jobs(), threads * _WINDOW_PER_THREAD)
        for s in spans:
            sizes = []
            for _ in _pieces(s.end - s.start, frame_bytes):
                frame = next(frames)
                f.write(frame)
                sizes.append(len(frame))
            tensors.append(
                DeltaTensor(
                    name=s.name, nbytes=s.end - s.start, xor=_matching(s, base) is not None, frames=sizes
                )
            )
        f.flush()
        os.fsync(f.fileno())
        sha = digest.hexdigest()
    return DeltaFile(
        delta=out.name,
        size=len(header) + len(body),
        sha256=sha,
        chunk_bytes=DIGEST_CHUNK,
        header_bytes=header_bytes,
        frame_bytes=frame_bytes,
        tensors=tensors,
    )


def decode_file(delta: Path, entry: DeltaFile, base: BaseTensors, out: Path) -> None:
    """Reconstruct the full file ``out`` from the delta file ``delta`` and ``base``; DeltaError (naming the delta
    file) unless every frame decodes and the result has the size and digest ``entry`` records."""
    threads = hash_threads(os.cpu_count() or 1)
    with naming(delta), open(delta, "rb") as src:
        header = src.read(entry.header_bytes)
        header_bytes, spans = parse_header(header, delta)
        if header_bytes != entry.header_bytes:
            raise DeltaError(
                f"{delta}: header of {header_bytes} bytes, {DELTA_RECORD} says {entry.header_bytes}"
            )
        if [(s.name, s.end - s.start) for s in spans] != [(t.name, t.nbytes) for t in entry.tensors]:
            raise DeltaError(f"{delta}: its tensors are not the ones {DELTA_RECORD} lists")
        missing = [t.name for t in entry.tensors if t.xor and t.name not in base]
        if missing:
            raise DeltaError(f"{delta}: tensor {missing[0]} is XORed against a base that does not have it")

        def jobs() -> Iterator[Callable[[], memoryview]]:
            for s, t in zip(spans, entry.tensors, strict=True):
                b = _matching(s, base) if t.xor else None
                if t.xor and b is None:
                    raise DeltaError(f"{delta}: tensor {t.name} has another dtype or shape in the base")
                pieces = _pieces(t.nbytes, entry.frame_bytes)
                if len(pieces) != len(t.frames):
                    raise DeltaError(
                        f"{delta}: tensor {t.name} has {len(t.frames)} frames, expected {len(pieces)}"
                    )
                for (off, n), size in zip(pieces, t.frames, strict=True):
                    frame = src.read(size)
                    if len(frame) != size:
                        raise DeltaError(f"{delta}: cut short in tensor {t.name}")
                    q = None if b is None else b[off : off + n]
                    yield partial(_decode_frame, frame, n, q, f"{delta} tensor {t.name}")

        with ThreadPoolExecutor(threads, "delta-decode") as pool, naming(out), open(out, "wb") as dst:
            digest = StreamDigest(pool, entry.chunk_bytes)
            digest.update(memoryview(header))
            dst.write(header)
            for block in _ordered(pool, jobs(), threads * _WINDOW_PER_THREAD):
                digest.update(block)  # the block stays referenced by the digest until its piece is hashed
                dst.write(block)
            size = dst.tell()
            sha = digest.hexdigest()
        if src.read(1):
            raise DeltaError(f"{delta}: bytes after the last frame")
    if size != entry.size or sha != entry.sha256:
        raise DeltaError(
            f"{delta}: the reconstructed {out.name} does not match the digest in {DELTA_RECORD} "
            "(damaged delta or base)"
        )


def manifest_sha256(version_dir: Path) -> str:
    with naming(version_dir / "manifest.json"):
        return hashlib.sha256((version_dir / "manifest.json").read_bytes()).hexdigest()


def write_delta_record(staging: Path, record: DeltaRecord) -> None:
    write_record(staging / DELTA_RECORD, record)


def read_delta_record(version_dir: Path) -> DeltaRecord | None:
    """The version's delta record, None for a full or adapter version; DeltaError when it is not a valid one."""
    from .records import RecordError

    path = version_dir / DELTA_RECORD
    try:
        return read_record(DeltaRecord, path)
    except FileNotFoundError:
        return None
    except RecordError as e:
        raise DeltaError(str(e)) from None
