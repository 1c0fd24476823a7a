"""Crash-safe file primitives for a shared (NFS/Lustre) run directory.

Every file that crosses a process boundary is written tmp -> fsync -> rename, followed by an fsync of the directory,
so a reader sees either the old content or the new one, never a partial file.  Exclusive creation uses
``os.link(tmp, final)``, which stays atomic over NFS where ``O_EXCL`` does not; ``claim_next`` builds "exactly one
process gets number n" on it.  ``retry_transient`` is the one retry policy for the errors NFS/Lustre produce
transiently.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# ENOENT right after a rename, ESTALE after a server-side replace, EIO on a flaky mount: worth a retry.
TRANSIENT_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE, errno.EIO, errno.EAGAIN})
HOST = socket.gethostname().replace(".", "_")


def tmp_name(final: Path) -> Path:
    """A temporary name beside ``final`` that is unique across hosts, processes and requeues."""
    return final.parent / f".tmp.{final.name}.{HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(final: Path, data: bytes) -> Path:
    tmp = tmp_name(final)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def write_atomic(final: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace ``final`` with ``data`` atomically (tmp, fsync, rename, fsync dir)."""
    tmp = _write_tmp(final, data)
    try:
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(final.parent)


def create_exclusive(final: Path, data: bytes) -> bool:
    """Create ``final`` with ``data`` only if it does not exist yet; True when this call created it.

    ``link`` fails with EEXIST when the name is taken, atomically, also on NFS.  A retransmitted LINK may report
    EEXIST for our own successful link, so on EEXIST we compare content to tell "ours" from "somebody else's".
    """
    tmp = _write_tmp(final, data)
    try:
        os.link(tmp, final)
        created = True
    except FileExistsError:
        created = _read_or_none(final) == data
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    if created:
        fsync_dir(final.parent)
    return created


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def write_json_atomic(final: Path, obj: Any) -> None:
    write_atomic(final, json_bytes(obj))


def create_json_exclusive(final: Path, obj: Any) -> bool:
    return create_exclusive(final, json_bytes(obj))


def json_bytes(obj: Any) -> bytes:
    """The one JSON encoding of run-directory records (stable key order, so equal records are equal bytes)."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def claim_next(path_of: Callable[[int], Path], content_of: Callable[[int], bytes], first: int = 1) -> int:
    """Claim the lowest free number ``n >= first``: create ``path_of(n)`` exclusively; return ``n``.

    Exactly one caller wins each number, across processes and hosts (``create_exclusive``); a loser moves on to the
    next one.  ``content_of(n)`` is called again for every attempt, so a record can carry what its writer saw just
    before claiming (e.g. the highest plan step).  ``first`` is only where to start looking (the highest number
    listed + 1 saves attempts); correctness never depends on it.
    """
    n = first
    while not create_exclusive(path_of(n), content_of(n)):
        n += 1
    return n


def numbered(directory: Path, pattern: re.Pattern[str]) -> list[int]:
    """The numbers in the names of ``directory`` that match ``pattern`` (its group 1), ascending."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := pattern.match(n)))


def retry_transient(
    fn: Callable[[], T],
    *,
    attempts: int = 5,
    delay_s: float = 0.05,
    errnos: frozenset[int] = TRANSIENT_ERRNOS,
) -> T:
    """Call ``fn``; retry the OSErrors a network filesystem produces transiently (``errnos``), with backoff.

    The one retry policy of the run directory: ``attempts`` calls in all, sleeping ``delay_s``, then twice that, ...
    between them.  Any other error, and the last transient one, is raised unchanged.
    """
    for i in range(attempts):
        try:
            return fn()
        except OSError as e:
            if e.errno not in errnos or i == attempts - 1:
                raise
            time.sleep(delay_s * (2**i))
    raise ValueError(f"retry_transient: attempts must be >= 1, got {attempts}")


def read_json(path: Path, *, attempts: int = 5) -> Any:
    """Read a JSON record written with ``write_json_atomic``; transient errors are retried."""
    return retry_transient(lambda: json.loads(path.read_bytes()), attempts=attempts)


def read_json_or_none(path: Path) -> Any | None:
    """The JSON content of ``path``, or None if it is absent or (transiently) unreadable."""
    try:
        return read_json(path, attempts=2)
    except (OSError, ValueError):
        return None


def iter_tmp_files(directory: Path) -> Iterator[Path]:
    if directory.is_dir():
        yield from (p for p in directory.iterdir() if p.name.startswith(".tmp."))


def tmp_is_abandoned(path: Path, max_age_s: float) -> bool:
    """A temporary is abandoned when its writer (same host) is dead, or it is older than ``max_age_s``."""
    parts = path.name.split(".")
    try:
        host, pid = parts[-3], int(parts[-2])
    except (IndexError, ValueError):
        host, pid = "", -1
    if host == HOST and pid > 0 and not _pid_alive(pid):
        return True
    try:
        return time.time() - path.stat().st_mtime > max_age_s
    except FileNotFoundError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
