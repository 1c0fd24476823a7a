"""The base of delta versions: this rank's bytes of the last full version it committed, owned by one publisher.

A delta version (``trainer.publish_full_every`` > 1) is each rank's file XOR-ed against the same rank's file of the
full version before it and compressed (``buffer/deltas.py``).  The publisher that commits a full version keeps a copy
of its bytes here; the next versions are deltas against it while every rank holds it with the same file layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from buffer import deltas


@dataclass
class DeltaBase:
    version: int | None = None  # the full version held (None: the next version is published in full)
    file: str | None = None  # this rank's file name of it (None: this rank owned no tensor)
    header: bytes = b""
    host: torch.Tensor | None = None  # a copy of that file's tensor bytes

    def holds(self, version: int, file: str | None, header: bytes) -> bool:
        """Whether this rank holds ``version`` with the file layout of the version being staged."""
        return self.version == version and self.file == file and self.header == header

    def keep(self, version: int, file: str | None, header: bytes, host: torch.Tensor | None) -> None:
        """After ``version`` was committed in full: its bytes become the base (a copy: the staging buffer is reused
        by the next publish)."""
        self.version, self.file, self.header = version, file, header
        self.host = host.clone() if host is not None and file is not None else None

    def forget(self) -> None:
        """A publish failed: whatever failed may have been the base, so the next version is full."""
        self.version, self.file, self.header, self.host = None, None, b"", None

    def encode(self, out: Path, header: bytes, host: torch.Tensor) -> deltas.DeltaFile:
        """This rank's file (``header`` + ``host``) as a delta against the base, written to ``out``."""
        assert self.host is not None, "no base bytes on this rank"
        source = f"v{self.version} {self.file}"
        base_tensors = deltas.tensors_of(self.header, self.host.numpy().data.cast("B"), source)
        return deltas.encode_file(out, header, host.numpy().data.cast("B"), base_tensors)
