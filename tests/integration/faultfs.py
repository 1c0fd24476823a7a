"""A passthrough FUSE filesystem that injects the faults NFS and Lustre produce, for the storage tests.

It mirrors a backing directory at a mount point and, per path pattern, makes operations fail or see stale state.
Faults are set at run time through a Unix socket, so one mount serves a whole test:

* ``{"op": "read", "errno": "EIO", "path": "run/shards/ready/*", "count": 1}``: the next ``count`` matching calls
  of that operation fail with that errno (``count`` null: until cleared).  Operations: open, read, write, fsync,
  create, rename, link, unlink, mkdir, getattr, readdir.  Without ``errno`` the rule only counts calls.
* ``{"kind": "enoent_after_rename", "path": ..., "count": 1}``: a name that was just renamed into place answers
  ENOENT to its next ``count`` lookups (NFS may report it so once, right after a rename).
* ``{"kind": "late_names", "path": ..., "seconds": T}``: a new name (created, renamed or linked into place) stays
  invisible to lookups and directory listings for T seconds (the NFS lookup cache of another client).
* ``{"kind": "latency", "path": ..., "seconds": T}``: every metadata call on a matching path (open, create, rename,
  link, unlink, mkdir, getattr, readdir; or only ``op`` when given) takes T seconds more: a network file system's
  round trip, for the benchmarks (``bench/scale.py --latency-ms``).
* ``{"kind": "stale_attr", "path": ..., "seconds": T}``: the attributes of a file (size, mtime) are answered from a
  copy up to T seconds old while it is the same file (the NFS attribute cache; a name replaced by rename is another
  file, as for NFS file handles).

The kernel's own entry and attribute caches are turned off (timeouts 0) so these emulated ones are the only ones.
Paths in rules are relative to the mount root and matched with ``fnmatch`` (``*`` also matches ``/``).

Run in a child process (``python tests/integration/faultfs.py BACKING MOUNT SOCKET``), so a crash of the file
system cannot take the test process with it; ``mounted()`` starts it and always unmounts.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPS = ("open", "read", "write", "fsync", "create", "rename", "link", "unlink", "mkdir", "getattr", "readdir")
KINDS = ("errno", "enoent_after_rename", "late_names", "stale_attr", "latency")
METADATA_OPS = ("open", "create", "rename", "link", "unlink", "mkdir", "getattr", "readdir")
_STAT_KEYS = (
    "st_mode",
    "st_nlink",
    "st_uid",
    "st_gid",
    "st_size",
    "st_atime",
    "st_mtime",
    "st_ctime",
    "st_ino",
)


# ------------------------------------------------------------------------------------------- fault state


@dataclass
class Rule:
    kind: str
    path: str
    op: str | None = None
    errno: int | None = None
    count: int | None = None  # remaining firings; None = until cleared
    seconds: float = 0.0
    fired: int = 0

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Rule:
        kind = d.get("kind", "errno")
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        op = d.get("op")
        if kind == "errno" and op not in OPS:
            raise ValueError(f"op {op!r} is not one of {', '.join(OPS)}")
        name = d.get("errno")
        code = getattr(errno, name) if name else None
        count = d.get("count", 1 if kind == "enoent_after_rename" else None)
        return cls(kind, str(d["path"]), op, code, count, float(d.get("seconds", 0.0)))

    def matches(self, path: str) -> bool:
        return fnmatch.fnmatchcase(path, self.path)


@dataclass
class Faults:
    """Everything the file system decides per call; one lock, as FUSE calls come from several threads."""

    rules: list[Rule] = field(default_factory=list)
    hidden_until: dict[str, float] = field(default_factory=dict)  # late_names: path -> monotonic time
    enoent_left: dict[str, tuple[Rule, int]] = field(default_factory=dict)  # enoent_after_rename
    attrs: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)  # stale_attr copies
    # libfuse looks a new entry up right after mkdir/link/symlink to answer the kernel: that one lookup is the
    # creator's own and sees the name
    own_lookup: set[str] = field(default_factory=set)
    calls: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, rules: list[dict[str, Any]]) -> None:
        parsed = [Rule.parse(r) for r in rules]
        with self.lock:
            self.rules = parsed
            self.hidden_until.clear()
            self.own_lookup.clear()
            self.enoent_left.clear()
            self.attrs.clear()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"fired": [r.fired for r in self.rules], "calls": dict(self.calls)}

    def check(self, op: str, path: str) -> None:
        """Raise the errno of the first live errno rule that matches; count the call; wait out the latency rules
        that match (outside the lock: calls from several threads wait side by side, as round trips do)."""
        delay = 0.0
        with self.lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            for r in self.rules:
                if (
                    r.kind == "latency"
                    and (op == r.op or (r.op is None and op in METADATA_OPS))
                    and r.matches(path)
                ):
                    delay += r.seconds
                    r.fired += 1
        if delay > 0:
            time.sleep(delay)
        with self.lock:
            for r in self.rules:
                if r.kind == "errno" and r.op == op and r.matches(path) and r.count != 0:
                    if r.count is not None:
                        r.count -= 1
                    r.fired += 1
                    if r.errno is not None:
                        raise OSError(r.errno, os.strerror(r.errno), path)

    def created(self, path: str, *, renamed: bool = False, looked_up: bool = False) -> None:
        """A name appeared: start its invisibility, or its ENOENT-after-rename answers.

        ``looked_up``: libfuse looks the entry up itself before answering the call that created it.
        """
        with self.lock:
            if looked_up:
                self.own_lookup.add(path)
            for r in self.rules:
                if not r.matches(path):
                    continue
                if r.kind == "late_names":
                    self.hidden_until[path] = time.monotonic() + r.seconds
                elif r.kind == "enoent_after_rename" and renamed and r.count != 0:
                    self.enoent_left[path] = (r, r.count if r.count is not None else 1 << 30)

    def hidden(self, path: str) -> bool:
        """Whether a lookup of ``path`` must answer ENOENT now (consumes an ENOENT-after-rename answer)."""
        with self.lock:
            if path in self.own_lookup:
                self.own_lookup.discard(path)
                return False
            until = self.hidden_until.get(path)
            if until is not None:
                if time.monotonic() < until:
                    self._fire("late_names", path)
                    return True
                del self.hidden_until[path]
            left = self.enoent_left.get(path)
            if left is not None:
                rule, n = left
                if n <= 1:
                    del self.enoent_left[path]
                else:
                    self.enoent_left[path] = (rule, n - 1)
                rule.fired += 1
                return True
            return False

    def listed(self, path: str) -> bool:
        """Whether a directory listing shows ``path`` now (late names only; nothing is consumed)."""
        with self.lock:
            until = self.hidden_until.get(path)
            if until is not None and time.monotonic() < until:
                self._fire("late_names", path)
                return False
            return True

    def _fire(self, kind: str, path: str) -> None:
        for r in self.rules:
            if r.kind == kind and r.matches(path):
                r.fired += 1
                return

    def attributes(self, path: str, fresh: dict[str, Any]) -> dict[str, Any]:
        """``fresh``, or a copy up to ``seconds`` old of the same file's attributes (stale_attr)."""
        with self.lock:
            rule = next((r for r in self.rules if r.kind == "stale_attr" and r.matches(path)), None)
            if rule is None:
                return fresh
            now = time.monotonic()
            cached = self.attrs.get(path)
            if (
                cached is not None
                and cached[1]["st_ino"] == fresh["st_ino"]
                and now - cached[0] < rule.seconds
            ):
                if cached[1]["st_size"] != fresh["st_size"] or cached[1]["st_mtime"] != fresh["st_mtime"]:
                    rule.fired += 1
                return cached[1]
            self.attrs[path] = (now, fresh)
            return fresh

    def revalidate(self, path: str) -> None:
        with self.lock:
            self.attrs.pop(path, None)

    def forget(self, path: str) -> None:
        with self.lock:
            self.hidden_until.pop(path, None)
            self.enoent_left.pop(path, None)
            self.attrs.pop(path, None)


# ----------------------------------------------------------------------------------------- file system


def _operations_class() -> type:
    """The FUSE operations class; built on demand so that importing this module needs no libfuse."""
    from mfusepy import FuseOSError, Operations

    class FaultOps(Operations):  # type: ignore[misc]
        use_ns = True

        def __init__(self, backing: str, faults: Faults):
            self.backing = backing
            self.faults = faults

        def _real(self, path: str) -> str:
            return os.path.join(self.backing, path.lstrip("/"))

        @staticmethod
        def _rel(path: str) -> str:
            return path.lstrip("/")

        def _guard(self, op: str, path: str) -> None:
            try:
                self.faults.check(op, self._rel(path))
            except OSError as e:
                raise FuseOSError(e.errno) from None

        def _lookup(self, path: str) -> None:
            if self.faults.hidden(self._rel(path)):
                raise FuseOSError(errno.ENOENT)

        def _wrap(self, fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except OSError as e:
                raise FuseOSError(e.errno or errno.EIO) from None

        # metadata
        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            if fh is None:
                self._lookup(path)
            self._guard("getattr", path)
            st = self._wrap(os.fstat, fh) if fh is not None else self._wrap(os.lstat, self._real(path))
            fresh = {k: getattr(st, k) for k in _STAT_KEYS}
            for k in ("st_atime", "st_mtime", "st_ctime"):
                fresh[k] = getattr(st, k + "_ns")
            return self.faults.attributes(self._rel(path), fresh)

        def readdir(self, path: str, fh: int) -> list[Any]:
            self._guard("readdir", path)
            rel = self._rel(path)
            entries = self._wrap(lambda: list(os.scandir(self._real(path))))
            # with use_ino an entry needs its inode number: readdir(3) skips entries whose d_ino is 0
            return [".", ".."] + [
                (e.name, {"st_ino": e.inode(), "st_mode": e.stat(follow_symlinks=False).st_mode}, 0)
                for e in entries
                if self.faults.listed(f"{rel}/{e.name}" if rel else e.name)
            ]

        def readlink(self, path: str) -> str:
            self._lookup(path)
            return self._wrap(os.readlink, self._real(path))

        def statfs(self, path: str) -> dict[str, int]:
            st = os.statvfs(self._real(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag")
            return {k: getattr(st, k) for k in (*keys, "f_frsize", "f_namemax")}

        def access(self, path: str, amode: int) -> int:
            self._lookup(path)
            if not os.access(self._real(path), amode):
                raise FuseOSError(errno.EACCES)
            return 0

        def chmod(self, path: str, mode: int) -> int:
            return self._wrap(os.chmod, self._real(path), mode)

        def chown(self, path: str, uid: int, gid: int) -> int:
            return self._wrap(os.chown, self._real(path), uid, gid)

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            return self._wrap(
                lambda: os.utime(self._real(path), ns=times) if times else os.utime(self._real(path))
            )

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            self._guard("write", path)
            if fh is not None:
                return self._wrap(os.ftruncate, fh, length)
            return self._wrap(os.truncate, self._real(path), length)

        # names
        def mkdir(self, path: str, mode: int) -> int:
            self._guard("mkdir", path)
            self._wrap(os.mkdir, self._real(path), mode)
            self.faults.created(self._rel(path), looked_up=True)
            return 0

        def rmdir(self, path: str) -> int:
            self._wrap(os.rmdir, self._real(path))
            self.faults.forget(self._rel(path))
            return 0

        def unlink(self, path: str) -> int:
            self._guard("unlink", path)
            self._wrap(os.unlink, self._real(path))
            self.faults.forget(self._rel(path))
            return 0

        def symlink(self, target: str, source: str) -> int:
            self._wrap(os.symlink, source, self._real(target))
            self.faults.created(self._rel(target), looked_up=True)
            return 0

        def rename(self, old: str, new: str) -> int:
            self._guard("rename", new)
            self._wrap(os.rename, self._real(old), self._real(new))
            self.faults.forget(self._rel(old))
            self.faults.forget(self._rel(new))
            self.faults.created(self._rel(new), renamed=True)
            return 0

        def link(self, target: str, source: str) -> int:
            self._guard("link", target)
            self._wrap(os.link, self._real(source), self._real(target))
            self.faults.created(self._rel(target), looked_up=True)
            return 0

        # file contents
        def open(self, path: str, flags: int) -> int:
            self._lookup(path)
            self._guard("open", path)
            fd = self._wrap(os.open, self._real(path), flags)
            # close-to-open consistency: an open revalidates the attributes (a stat alone may stay stale)
            self.faults.revalidate(self._rel(path))
            return fd

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            self._guard("create", path)
            fd = self._wrap(os.open, self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            self.faults.created(self._rel(path))
            return fd

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            self._guard("read", path)
            return self._wrap(os.pread, fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            self._guard("write", path)
            return self._wrap(os.pwrite, fh, data, offset)

        def flush(self, path: str, fh: int) -> int:
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            self._guard("fsync", path)
            self._wrap(os.fdatasync if datasync else os.fsync, fh)
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            return 0

    return FaultOps


class _Control(socketserver.StreamRequestHandler):
    """One JSON request per line: {"set": [rules]} or {"stats": true}; one JSON answer per line."""

    faults: Faults

    def handle(self) -> None:
        for line in self.rfile:
            try:
                req = json.loads(line)
                if "set" in req:
                    self.faults.set(req["set"])
                    ans: dict[str, Any] = {"ok": True}
                else:
                    ans = {"ok": True, **self.faults.stats()}
            except (ValueError, KeyError, AttributeError) as e:
                ans = {"ok": False, "error": str(e)}
            self.wfile.write((json.dumps(ans) + "\n").encode())
            self.wfile.flush()


def serve(backing: str, mount: str, sock: str) -> None:
    """Mount ``backing`` at ``mount`` (foreground, until unmounted) with faults controlled through ``sock``."""
    from mfusepy import FUSE

    faults = Faults()
    handler = type("Control", (_Control,), {"faults": faults})
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    server = socketserver.ThreadingUnixStreamServer(sock, handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FUSE(
        _operations_class()(backing, faults),
        mount,
        foreground=True,
        hard_remove=True,  # an unlinked open file must not linger as .fuse_hidden* in listings
        use_ino=True,
        entry_timeout=0,
        attr_timeout=0,
        negative_timeout=0,
        fsname="faultfs",
    )


# ------------------------------------------------------------------------------------------ the client


def fuse_unavailable() -> str | None:
    """Why a FUSE mount cannot be made here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None and os.geteuid() != 0:
        return "fusermount3 missing (apt-get install fuse3) and not root"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: libfuse missing
        return f"the FUSE binding does not load ({e}); pip install mfusepy, apt-get install fuse3"
    return None


class FaultFS:
    """A running mount and its control channel."""

    def __init__(self, backing: Path, mount: Path, sock: Path, proc: subprocess.Popen[bytes]):
        self.backing = backing
        self.mount = mount
        self.sock = sock
        self.proc = proc

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.sock))
            s.sendall((json.dumps(req) + "\n").encode())
            ans = json.loads(s.makefile("rb").readline())
        if not ans.get("ok"):
            raise ValueError(f"faultfs refused {req}: {ans.get('error')}")
        return ans

    def set(self, *rules: dict[str, Any]) -> None:
        """Replace all rules (and forget every cached name and attribute)."""
        self._ask({"set": list(rules)})

    def clear(self) -> None:
        self.set()

    def fired(self) -> list[int]:
        """How often each current rule has fired, in the order given to ``set``."""
        return list(self._ask({"stats": True})["fired"])

    def calls(self) -> dict[str, int]:
        """Operation -> number of calls since the mount."""
        return dict(self._ask({"stats": True})["calls"])


def _unmount(mount: Path) -> None:
    for cmd in (["fusermount3", "-u", "-z", str(mount)], ["umount", "-l", str(mount)]):
        if not os.path.ismount(mount):
            return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, capture_output=True, timeout=10, check=False)


@contextlib.contextmanager
def mounted(base: Path, timeout_s: float = 20.0) -> Iterator[FaultFS]:
    """Mount a fresh fault file system over ``base/backing`` at ``base/mnt``; unmount on exit, whatever happens."""
    backing, mount, sock = base / "backing", base / "mnt", base / "faultfs.sock"
    backing.mkdir(parents=True, exist_ok=True)
    mount.mkdir(parents=True, exist_ok=True)
    log = open(base / "faultfs.log", "wb")  # noqa: SIM115 - the child writes to it until the end
    proc = subprocess.Popen(
        [sys.executable, __file__, str(backing), str(mount), str(sock)], stdout=log, stderr=subprocess.STDOUT
    )
    fs = FaultFS(backing, mount, sock, proc)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"faultfs exited with {proc.returncode}: {(base / 'faultfs.log').read_text()}"
                )
            if os.path.ismount(mount) and sock.exists():
                with contextlib.suppress(OSError):
                    fs.clear()
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"faultfs did not mount within {timeout_s}s: {(base / 'faultfs.log').read_text()}"
                )
            time.sleep(0.05)
        yield fs
    finally:
        _unmount(mount)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        _unmount(mount)
        log.close()


if __name__ == "__main__":
    serve(*sys.argv[1:4])
