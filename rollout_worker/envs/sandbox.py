"""Running one tool call in a process of its own, with a wall-time limit, an address-space limit and a cap on its result.

The rollout worker holds an engine (and its threads, its GPU, its memory) for its whole life, so tool code, which is
user code and may hang, leak, print without end or crash the interpreter, never runs inside it.  Each worker process
starts one small *zygote* on its first call: a child interpreter running this file (a script: it imports nothing of
ours) that listens on a Unix socket in a private directory.  Each call connects, and the zygote forks a fresh process
for it: that process starts a session of its own, sends its pid, applies ``RLIMIT_AS``, sends its stdout and stderr to
/dev/null, imports the tool, runs it, cuts the result to ``max_chars`` and writes one JSON line; the zygote reaps it
and adds its exit status.  The caller kills the call's whole session at the time limit and reads a bounded number of
bytes, so no tool can block or flood the worker.  A fork is far cheaper than a fresh interpreter (the
lookup demo calls a tool in every episode: its median tool time per episode was 0.36 s with an interpreter per call,
0.04 s forked), and every call still starts from the same clean state.  A zygote that died is started again by the next call.

Every failure is a ``ToolResult`` with ``error`` set (time-out, a raise, a process killed by a signal or out of
memory, an answer that is not JSON), which the environment hands to the model as the tool's message.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

# Bytes of answer the caller reads beyond the result's cap (the JSON frame, escapes of the kept characters).
_FRAME_SLACK = 64 << 10
_START_S = 30.0  # a zygote that has not listened within this is taken as failed


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the model is shown as the tool's message
    error: str | None = None  # set when the call failed; ``content`` then says so
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class ToolRunner:
    """Runs calls of ``module:function`` targets in forked processes under the limits of ``env``'s config."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_chars: int = 4096

    def run(self, target: str, arguments: dict[str, Any]) -> ToolResult:
        start = time.monotonic()
        request = json.dumps(
            {
                "target": target,
                "arguments": arguments,
                "memory_mb": self.memory_mb,
                "max_chars": self.max_chars,
            }
        )
        try:
            conn = _ZYGOTE.connect()
        except OSError as e:
            return _failed(f"could not start the tool process: {e}", time.monotonic() - start)
        with conn:
            conn.sendall(request.encode() + b"\n")
            lines, timed_out = self._read(conn, start + self.timeout_s)
        seconds = time.monotonic() - start
        pid = _field(lines, "pid")
        if pid is not None:  # the call's session: what its tool left running dies with it, time-out or not
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)
        if timed_out:
            return _failed(f"timed out after {self.timeout_s:g} s and was killed", seconds, timed_out=True)
        return self._result(lines, seconds)

    def _read(self, conn: socket.socket, deadline: float) -> tuple[list[bytes], bool]:
        """The lines the call sent (its pid, its answer, its exit status), read until the exit status or the end
        of the connection, at most the cap plus a frame; ``True`` when the time limit passed first."""
        limit = 4 * self.max_chars + _FRAME_SLACK
        buf = b""
        while len(buf) <= limit:
            left = deadline - time.monotonic()
            if left <= 0:
                return buf.split(b"\n"), True
            conn.settimeout(left)
            try:
                data = conn.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            buf += data
            if b'"exit":' in data and buf.endswith(b"\n"):
                break
        return buf.split(b"\n"), False

    def _result(self, lines: list[bytes], seconds: float) -> ToolResult:
        status = _field(lines, "exit")
        obj = next(
            (o for o in map(_json, lines) if isinstance(o, dict) and ("content" in o or "error" in o)), None
        )
        if obj is None:
            if isinstance(status, int) and status < 0:
                return _failed(f"killed by signal {signal.Signals(-status).name}", seconds)
            return _failed(f"exited with status {status} without a result", seconds)
        if obj.get("error"):
            return _failed(str(obj["error"])[: self.max_chars], seconds)
        return ToolResult(str(obj.get("content", "")), truncated=bool(obj.get("truncated")), seconds=seconds)


def _json(line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8", errors="replace")) if line.strip() else None
    except ValueError:
        return None


def _field(lines: list[bytes], key: str) -> Any:
    """``key`` of the first line that is a JSON object holding it (the pid line, the exit line)."""
    for line in lines:
        obj = _json(line)
        if isinstance(obj, dict) and key in obj and len(obj) == 1:
            return obj[key]
    return None


def _failed(why: str, seconds: float, *, timed_out: bool = False) -> ToolResult:
    return ToolResult(f"error: {why}", error=why, timed_out=timed_out, seconds=seconds)


class _Zygote:
    """This process's zygote: started on the first call, and again by a call that finds it gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._path = ""

    def connect(self) -> socket.socket:
        for attempt in range(2):
            with self._lock:
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                path = self._path
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(path)
                return conn
            except OSError:
                conn.close()
                if attempt:
                    raise
                with self._lock:  # it died between the check and the call: start another
                    self._stop()
        raise AssertionError("unreachable")

    def _start(self) -> None:
        self._stop()
        self._path = os.path.join(tempfile.mkdtemp(prefix="shardrl-tools-"), "zygote")
        # Its stdin is a pipe only this process holds: when this process dies, however it dies, the zygote reads
        # its end and exits (the calls in flight are in sessions of their own and are killed by their limits).
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self._path, json.dumps(sys.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _START_S
        while not os.path.exists(self._path):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"the tool zygote did not start (exit status {self._proc.poll()})")
            time.sleep(0.002)

    def _stop(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self._path:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
                os.rmdir(os.path.dirname(self._path))


_ZYGOTE = _Zygote()


# ---------------------------------------------------------------------------------------------- the zygote


def cut(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` kept to ``max_chars`` characters, with the cut said at its end."""
    if len(text) <= max_chars:
        return text, False
    return f"{text[:max_chars]}\n[... {len(text) - max_chars} more characters cut]", True


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _zygote(path: str) -> None:
    """Accept calls and fork one process for each; reap each and send its exit status after its answer.

    One thread only, so that every fork is of a process with no other thread (a lock held elsewhere at the fork
    would stay held in the child forever)."""
    import selectors

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(256)
    os.rename(path + ".tmp", path)  # the caller waits for the name: it appears only once calls can connect
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up byte is written
    calls: dict[int, socket.socket] = {}  # pid -> its connection
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = os.fork()
                if pid == 0:
                    keep = conn.fileno()
                    for fd in [listener.fileno(), wake_r, wake_w, *(c.fileno() for c in calls.values())]:
                        if fd != keep:
                            os.close(fd)
                    _call(conn)  # never returns
                calls[pid] = conn
            elif key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(calls)
            elif not os.read(sys.stdin.fileno(), 4096):  # the worker is gone
                for pid in calls:
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))
                os._exit(0)


def _reap(calls: dict[int, socket.socket]) -> None:
    while calls:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = calls.pop(pid, None)
        if conn is not None:
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                conn.sendall(b"\n" + json.dumps({"exit": code}).encode() + b"\n")
            conn.close()


def _call(conn: socket.socket) -> None:
    """One call, in the forked process: its own session, its limits, the tool, one JSON line; then exit."""
    import importlib
    import resource

    code = 0
    try:
        os.setsid()  # pgid = pid: the caller kills the session, and so whatever the tool started in it
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        req = json.loads(conn.makefile("rb").readline())
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the tool's prints are not its result, and must not fill a pipe nobody reads
            os.dup2(devnull, fd)
        limit = int(req["memory_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        out: dict[str, Any]
        try:
            module_name, _, attr = req["target"].partition(":")
            fn = getattr(importlib.import_module(module_name), attr)
            content, truncated = cut(_as_text(fn(**req["arguments"])), int(req["max_chars"]))
            out = {"content": content, "truncated": truncated}
        except MemoryError:
            out = {"error": f"ran out of memory (limit {req['memory_mb']} MiB)"}
        except BaseException as e:  # SystemExit and KeyboardInterrupt of tool code are its failures too
            out = {"error": cut(f"{type(e).__name__}: {e}", int(req["max_chars"]))[0]}
        conn.sendall(json.dumps(out, ensure_ascii=False).encode() + b"\n")
    except BaseException:
        code = 1
    os._exit(code)


# Standard modules that tools commonly import, imported once here rather than in every call (the forked process
# shares them, as loaded): only the standard library, whose import cannot hang or fail.
_PRELOAD = (
    "dataclasses",
    "hashlib",
    "random",
    "re",
    "math",
    "typing",
    "collections",
    "itertools",
    "functools",
)

if __name__ == "__main__":
    for _name in _PRELOAD:
        __import__(_name)
    sys.path[:] = json.loads(sys.argv[2])  # the worker's, so that a tool imports here as it does there
    _zygote(sys.argv[1])
