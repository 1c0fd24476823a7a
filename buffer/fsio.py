"""Crash-safe file primitives for a shared (NFS/Lustre) run directory.

Every file that crosses a process boundary is written tmp -> fsync -> rename, followed by an fsync of the directory,
so a reader sees either the old content or the new one, never a partial file.  Exclusive creation uses
``os.link(tmp, final)``, which stays atomic over NFS where ``O_EXCL`` does not; ``claim_next`` builds "exactly one
process gets number n" on it.  ``retry_transient`` is the one retry policy for the errors NFS/Lustre produce
transiently.

Every OSError raised here names its file (a run directory may span several file systems, and ``[Errno 28]`` alone
does not say which one is full), and a temporary whose write failed is removed before the error is raised.

Files and directories are created with the run's modes (``set_modes``, from ``run.file_mode``/``run.dir_mode``),
never with whatever umask the process happened to inherit; ``set_modes`` also sets the umask, so that files written
by libraries (checkpoints, safetensors, logs) get the same read/write bits as the directories.  Reads of files that
another process or a person writes are size-capped (``read_capped``): a huge or non-regular file is refused before
it is read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# ENOENT right after a rename, ESTALE after a server-side replace, EIO on a flaky mount: worth a retry.
TRANSIENT_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE, errno.EIO, errno.EAGAIN})
HOST = socket.gethostname().replace(".", "_")
# Run-directory JSON read by ``read_json``: far above any record we write (a plan of 100k sample ids is ~5 MB).
JSON_MAX_BYTES = 64 << 20


# ------------------------------------------------------------------------------------------------------- modes


@dataclass(frozen=True)
class Modes:
    """Permission bits of what a process creates in the run directory."""

    file: int = 0o644
    dir: int = 0o755


GROUP_SHARED = Modes(file=0o660, dir=0o2770)  # one group shares the run; new entries inherit it (setgid)


def mode_problem(modes: Modes) -> str | None:
    """Why ``modes`` cannot be a run's modes, or None: never writable by others; the owner can always use its own
    files; a file mode grants nothing its directory mode withholds."""
    if modes.file & ~0o777 or modes.file & 0o111:
        return f"file mode {modes.file:#o} must be permission bits without execute (within 0o666)"
    if modes.dir & ~0o3777:
        return f"dir mode {modes.dir:#o} must be permission bits, optionally with setgid (0o2000) or sticky (0o1000)"
    for what, mode, need in (("file", modes.file, 0o600), ("dir", modes.dir, 0o700)):
        if mode & 0o002:
            return f"{what} mode {mode:#o} is writable by every user; the run directory is trusted input"
        if mode & need != need:
            return f"{what} mode {mode:#o} must give its owner at least {need:#o}"
    if modes.file & ~modes.dir & 0o666:
        return f"file mode {modes.file:#o} grants read/write bits that dir mode {modes.dir:#o} does not"
    return None


def _current_umask() -> int:
    try:  # race-free where /proc says it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


_modes = Modes()
_umask = _current_umask()


def set_modes(modes: Modes) -> None:
    """Use ``modes`` for everything this process creates from now on; the umask follows the directory mode."""
    global _modes, _umask
    problem = mode_problem(modes)
    if problem is not None:
        raise ValueError(problem)
    _modes = modes
    _umask = 0o777 & ~modes.dir
    os.umask(_umask)


def modes() -> Modes:
    return _modes


def create_file(path: Path) -> int:
    """Create ``path`` exclusively with the run's file mode; returns the open (write-only) descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _modes.file)
    if _modes.file & _umask:  # the umask took bits the run wants: one more metadata round trip
        try:
            os.fchmod(fd, _modes.file)
        except BaseException:
            os.close(fd)
            raise
    return fd


def chmod_file(fd: int) -> None:
    """Give a file another program created (a safetensors writer, a copy) the run's file mode."""
    if stat.S_IMODE(os.fstat(fd).st_mode) != _modes.file:
        os.fchmod(fd, _modes.file)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` with the run's directory mode on every directory it creates (setgid included)."""
    missing: list[Path] = []
    p = Path(path)
    while not p.exists():  # a regular file on the way is mkdir's to refuse (NotADirectoryError)
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(_modes.dir & 0o777)
        except FileExistsError:
            if d.is_dir():
                continue  # another process made it: its mode is that process's business
            raise
        if _modes.dir & (_umask | 0o7000):  # mkdir applies the umask and drops setgid/sticky
            os.chmod(d, _modes.dir)


# ---------------------------------------------------------------------------------------------- named errors


def named(e: OSError, path: Path | str) -> OSError:
    """``e`` naming ``path``, with the same errno (and so the same OSError subclass); ``e`` when it names one."""
    if e.filename is not None:
        return e
    if e.errno is None:  # raised by a library with a message only
        return OSError(f"{path}: {e}")
    return OSError(e.errno, e.strerror or str(e), str(path))


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """Raise every OSError of the block naming ``path``."""
    try:
        yield
    except OSError as e:
        raise named(e, path) from None


# ------------------------------------------------------------------------------------------------------ writes


def tmp_name(final: Path) -> Path:
    """A temporary name beside ``final`` that is unique across hosts, processes and requeues."""
    return final.parent / f".tmp.{final.name}.{HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    with naming(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_tmp(final: Path, data: bytes) -> Path:
    """``data`` in a new temporary beside ``final``, fsynced; nothing is left behind when that fails."""
    tmp = tmp_name(final)
    try:
        with open(create_file(tmp), "wb") as f:  # NFS may report a failed write only at close: inside the try
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise named(e, final) from None
        raise
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


# ------------------------------------------------------------------------------------------------------- reads


def retry_transient(
    fn: Callable[[], T],
    *,
    attempts: int = 5,
    delay_s: float = 0.05,
    errnos: frozenset[int] = TRANSIENT_ERRNOS,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn``; retry the OSErrors a network filesystem produces transiently (``errnos``), with backoff.

    The one retry policy of the run directory: ``attempts`` calls in all, sleeping ``delay_s``, then twice that, ...
    between them (through ``sleep``, so a test can act during the backoff).  Any other error, and the last transient
    one, is raised unchanged.
    """
    for i in range(attempts):
        try:
            return fn()
        except OSError as e:
            if e.errno not in errnos or i == attempts - 1:
                raise
            sleep(delay_s * (2**i))
    raise ValueError(f"retry_transient: attempts must be >= 1, got {attempts}")


class FileRefused(ValueError):
    """A file that is not read at all: not a regular file, or larger than its reader accepts.  One line."""

    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


def read_capped_stat(path: Path | str, max_bytes: int) -> tuple[bytes, os.stat_result]:
    """The bytes of ``path`` and the ``fstat`` of the very file read (not of whatever the name points to later),
    taken after the read: a write moves the file's mtime before its bytes land, so bytes read whole are never paired
    with the time of an earlier write (a stat taken before the read was: a command echoed while a supervisor read
    it got two keys, the half-written file's time and size with the whole text, and was applied twice).

    Refused (``FileRefused``) without reading it all: anything but a regular file (a FIFO, whose open would block,
    is opened non-blocking and refused; a directory), and a file over ``max_bytes``, by its size and again by what
    the reads return (it may grow while being read).  OSErrors name the file; transient ones are not retried here.
    """
    with naming(path):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileRefused(path, f"not a regular file ({_kind(st.st_mode)}); refused unread")
            if st.st_size > max_bytes:
                raise FileRefused(
                    path, f"{st.st_size} bytes, more than the {max_bytes} accepted; refused unread"
                )
            chunks, got = [], 0
            while got <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - got)):
                chunks.append(chunk)
                got += len(chunk)
            if got > max_bytes:
                raise FileRefused(path, f"more than the {max_bytes} bytes accepted (it grew while read)")
            return b"".join(chunks), os.fstat(fd)
        finally:
            os.close(fd)


def read_capped(path: Path | str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them, else ``FileRefused``
    (``read_capped_stat`` says how)."""
    return read_capped_stat(path, max_bytes)[0]


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def read_json(path: Path, *, attempts: int = 5, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """Read a JSON record written with ``write_json_atomic``; transient errors are retried.  A file over
    ``max_bytes`` or not a regular file is ``FileRefused`` (a ValueError, as unparsable JSON is)."""
    return json.loads(retry_transient(lambda: read_capped(path, max_bytes), attempts=attempts))


def read_json_or_none(path: Path) -> Any | None:
    """The JSON content of ``path``, or None if it is absent or (transiently) unreadable."""
    try:
        return read_json(path, attempts=2)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- temporaries


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
