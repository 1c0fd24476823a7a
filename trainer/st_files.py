"""Writing safetensors files as streams: the header from the shapes alone, the bytes from a reusable host buffer,
written by one thread while others hash the pieces (``trainer/publish.py`` writes each rank's file this way)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from buffer import weights
from buffer.weights import WeightsError

ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_WRITE_BLOCK = 64 << 20  # bytes per write() call
# The host buffer of the tensors a rank writes, kept across publishes: pinning memory is slow.
_PINNED: list[torch.Tensor] = []


def as_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).contiguous().reshape(-1).view(torch.uint8)


def safetensors_header(items: Sequence[Any]) -> bytes:
    """A safetensors header for ``items`` (with ``name``, ``shape``, ``dtype``, ``nbytes``) laid out back to back in this order (padded to 8 bytes)."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for it in items:
        if it.dtype not in ST_DTYPES:
            raise WeightsError(f"publish: {it.name} has dtype {it.dtype}, which safetensors cannot store")
        meta[it.name] = {
            "dtype": ST_DTYPES[it.dtype],
            "shape": list(it.shape),
            "data_offsets": [offset, offset + it.nbytes],
        }
        offset += it.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class StreamWriter:
    """Appends byte blocks to one file from a writer thread while other threads hash its pieces (the manifest's
    digest, ``buffer.weights.StreamDigest``; all drop the GIL)."""

    def __init__(self, path: Path):
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="publish-write")
        self._hash = ThreadPoolExecutor(weights.hash_threads(weights.HASH_THREADS), "publish-hash")
        self._digest = weights.StreamDigest(self._hash)
        self._pending: list[Future[Any]] = []

    def append(self, block: torch.Tensor | bytes) -> list[Future[Any]]:
        """Queue ``block`` (bytes, or a contiguous uint8 CPU tensor kept unchanged until ``close``)."""
        data = block.numpy().data if isinstance(block, torch.Tensor) else memoryview(block)
        self._digest.update(data.cast("B"))
        futures: list[Future[Any]] = []
        for start in range(0, len(data), _WRITE_BLOCK):
            futures.append(self._io.submit(self._file.write, data[start : start + _WRITE_BLOCK]))
        self._pending.extend(futures)
        return futures

    def close(self) -> str:
        """Wait for every block, fsync, close; return the file's digest."""
        try:
            for f in self._pending:
                f.result()
            self._file.flush()
            os.fsync(self._file.fileno())
            return self._digest.hexdigest()
        finally:
            self._io.shutdown()
            self._hash.shutdown()
            self._file.close()


def host_buffer(device: torch.device, nbytes: int) -> torch.Tensor:
    """A host buffer of at least ``nbytes``, reused across publishes (pinned on GPU: pageable copies are ~30x slower,
    and pinning memory is slow).  Safe to reuse: a version is staged only once the previous one is written."""
    pinned = device.type == "cuda"
    if not _PINNED or _PINNED[0].numel() < nbytes or _PINNED[0].is_pinned() != pinned:
        _PINNED[:] = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)]
    return _PINNED[0][:nbytes]


def write_rank_file(path: Path, header: bytes, host: torch.Tensor | None) -> str:
    """Stream ``header`` and ``host`` into ``path`` (fsynced); the file's digest (the manifest's form)."""
    writer = StreamWriter(path)
    writer.append(header)
    if host is not None and host.numel():
        writer.append(host)
    return writer.close()
