"""Running one tool call in a child process, with a wall-time limit, an address-space limit and a cap on its result.

The rollout worker holds an engine (and its threads, its GPU, its memory) for its whole life, so tool code, which is
user code and may hang, leak, print without end or crash the interpreter, never runs inside it.  Each call is one
child interpreter running this file (a script: it imports nothing but the tool) in its own session: the request (the tool's ``module:function``, the
arguments, the worker's ``sys.path``) goes in on stdin, one JSON answer comes back on a descriptor the tool's code does
not know of, while the tool's own stdout and stderr go to /dev/null.  The child applies ``RLIMIT_AS`` before it
imports the tool and cuts the result to ``max_chars`` before writing it; the parent kills the whole session at the
time limit and reads at most a bounded number of bytes, so no tool can block or flood the worker.

Every failure is a ``ToolResult`` with ``error`` set (time-out, a raise, a child killed by a signal or out of
memory, an answer that is not JSON), which the environment hands to the model as the tool's message.  A fresh
interpreter per call costs some tens of milliseconds: small next to a tool that does real work, and it gives every
call a clean state.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

# Bytes of answer the parent reads beyond the result's cap (the JSON frame, escapes of the kept characters).
_FRAME_SLACK = 64 << 10


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the model is shown as the tool's message
    error: str | None = None  # set when the call failed; ``content`` then says so
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class ToolRunner:
    """Runs calls of ``module:function`` targets in child processes under the limits of ``env``'s config."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_chars: int = 4096

    def run(self, target: str, arguments: dict[str, Any]) -> ToolResult:
        start = time.monotonic()
        request = json.dumps(
            {
                "target": target,
                "arguments": arguments,
                "path": sys.path,
                "memory_mb": self.memory_mb,
                "max_chars": self.max_chars,
            }
        )
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(write_fd,),
                start_new_session=True,  # a tool's own children die with it at the time limit
            )
        finally:
            os.close(write_fd)
        try:
            answer, timed_out = self._wait(proc, request, read_fd)
        finally:
            os.close(read_fd)
            _kill(proc)
        seconds = time.monotonic() - start
        if timed_out:
            return _failed(f"timed out after {self.timeout_s:g} s and was killed", seconds, timed_out=True)
        return self._result(answer, proc.returncode, seconds)

    def _wait(self, proc: subprocess.Popen[bytes], request: str, read_fd: int) -> tuple[bytes, bool]:
        """The child's answer (at most the cap plus a frame), read until it closes it or the time limit passes."""
        import selectors

        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # a child that died at once is judged by its exit status
            proc.stdin.write(request.encode())
            proc.stdin.close()
        deadline = time.monotonic() + self.timeout_s
        limit = 4 * self.max_chars + _FRAME_SLACK
        chunks: list[bytes] = []
        got = 0
        with selectors.DefaultSelector() as sel:
            sel.register(read_fd, selectors.EVENT_READ)
            while got <= limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    return b"", True
                if not sel.select(timeout=left):
                    continue
                data = os.read(read_fd, 1 << 16)
                if not data:
                    break
                chunks.append(data)
                got += len(data)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return b"", True
        return b"".join(chunks), False

    def _result(self, answer: bytes, returncode: int | None, seconds: float) -> ToolResult:
        try:
            obj = json.loads(answer.decode("utf-8", errors="replace")) if answer else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            if returncode is not None and returncode < 0:
                return _failed(f"killed by signal {signal.Signals(-returncode).name}", seconds)
            return _failed(f"exited with status {returncode} without a result", seconds)
        if obj.get("error"):
            return _failed(str(obj["error"])[: self.max_chars], seconds)
        return ToolResult(str(obj.get("content", "")), truncated=bool(obj.get("truncated")), seconds=seconds)


def _failed(why: str, seconds: float, *, timed_out: bool = False) -> ToolResult:
    return ToolResult(f"error: {why}", error=why, timed_out=timed_out, seconds=seconds)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # what it left behind in its session
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------------------------------------- the child


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


def _child(answer_fd: int) -> None:
    import importlib
    import resource

    req = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the tool's prints are not its result, and must not fill a pipe nobody reads
    os.dup2(devnull, 2)
    limit = int(req["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.path[:] = req["path"]
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
    with os.fdopen(answer_fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    _child(int(sys.argv[1]))
