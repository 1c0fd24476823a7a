"""Child processes as process groups: start one in its own session, signal the whole group, stop it by a deadline.

A rollout worker's engine spawns processes of its own (vLLM's engine core), and a trainer spawns ranks; signalling
only the direct child would leave those behind.  Each child is therefore started as the leader of a new session
(``start_new_session``: Ctrl-C typed at a terminal reaches only the parent, which stops its children in order), and
is always signalled as a group.  The node supervisor, ``shardrl demo`` and the tests all use these functions.
Imports nothing of ours and nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path


def start_group(
    cmd: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    header: str | None = None,
) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new session, stdout and stderr appended to ``log``.

    ``header`` is written to the log first (a line that says who started what, when).  OSError (a full disk, no
    such program) reaches the caller with nothing started.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        if header is not None:
            f.write(header.encode())
            f.flush()
        return subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads; a group that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_groups(
    procs: Iterable[subprocess.Popen],
    deadline_s: float,
    *,
    sig: int = signal.SIGTERM,
    leader_only: bool = False,
) -> list[int | None]:
    """Stop every group: ``sig`` now, SIGKILL to the group of whoever still runs at the deadline.

    ``leader_only`` sends ``sig`` to the leaders alone, as a person's ``kill`` does, for a leader that stops its own
    children in order (a supervisor draining its workers, a trainer).  Whatever the leader's outcome, the rest of its
    group gets SIGKILL at the end, so no engine or rank process outlives this call.  Returns the leaders' exit codes
    (negative: killed by that signal).
    """
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            if leader_only:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)
            else:
                signal_group(p, sig)
    end = time.monotonic() + max(deadline_s, 0.0)
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(p, signal.SIGKILL)
            p.wait()
    for p in procs:
        signal_group(p, signal.SIGKILL)
    return [p.returncode for p in procs]
