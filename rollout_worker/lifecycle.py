"""How a rollout worker process ends, whatever the reason, and always with a final state in its status record.

Reasons to stop, each watched here:
  * SIGTERM/SIGINT (the supervisor draining, Slurm, Ctrl-C).  The handler only sets a flag.  Python runs handlers
    only between bytecodes of the main thread, which may sit in C code for long (an engine loading), so the signal
    also reaches a small thread through ``signal.set_wakeup_fd``.  While running, a signal drains (the loop finishes
    its batch and publishes); more SIGTERMs change nothing, since Slurm and the supervisor may both send one, but a
    second SIGINT (Ctrl-C pressed again) ends the process at once.  While starting or loading the engine there is
    nothing to finish: any signal ends the process at once.
  * The supervisor gone: the kernel's parent-death signal (Linux), and a poll of the parent pid, send SIGTERM.
  * The slot's lease no longer the supervisor's, or no longer moving (the supervisor stalled): see
    ``buffer.control.LeaseWatch``.  The worker publishes nothing more from that moment and is gone at most
    ``lease_timeout_s / 8`` later, before another supervisor can take the slot over.
  * An engine process dying under a ``generate`` that does not notice.

Ending at once (``exit_now``) happens under the worker's I/O lock: the final status record is written, no shard or
status temporary of ours is left half-written, the engine's processes are stopped, and the process leaves with
``os._exit``, from whichever thread decided it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from buffer.control import LeaseWatch
from buffer.logs import logger

# 75 (EX_TEMPFAIL): distinct from what a crashing library exits with; the supervisor still checks the lease itself
EXIT_OK, EXIT_CRASH, EXIT_USER, EXIT_LEASE = 0, 1, 2, 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CHILD_GRACE_S = 2.0  # engine processes get this long to leave after SIGTERM, then SIGKILL
ENGINE_REPORT_S = 5.0  # a dead engine process: how long the main thread gets to report it itself

log = logger("rollout")


class Lifecycle:
    """The stop flags of one worker process, and the threads that set them.

    ``phase`` is ``starting`` | ``loading`` | ``running`` | ``closing``.  ``final_status(state, error)`` writes the
    final status record; it is called under ``io_lock``.
    """

    def __init__(self, name: str, io_lock: threading.RLock):
        self.name = name
        self.io_lock = io_lock
        self.final_status: Callable[[str, str | None], None] | None = None
        self.phase = "starting"
        self.stop_requested = False
        self.fenced: str | None = None  # why this worker may publish nothing more
        self.interrupts = 0  # SIGINTs received
        self._draining = False
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._exiting = threading.Lock()

    # ------------------------------------------------------------------ signals

    def install_signal_handlers(self) -> None:
        """Main thread only; called again after the engine started, in case its library replaced them."""
        if self._wake_w is None:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            threading.Thread(target=self._read_signals, daemon=True, name="signals").start()
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def _read_signals(self) -> None:
        assert self._wake_r is not None
        while True:
            try:
                data = os.read(self._wake_r, 64)
            except OSError:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._signalled(signum)

    def _signalled(self, signum: int) -> None:
        self.stop_requested = True
        self.interrupts += signum == signal.SIGINT
        if self.interrupts >= 2:
            self.exit_now("stopped", "stopped at once on a second interrupt", EXIT_OK)
        if self.phase in ("starting", "loading"):
            self.exit_now("stopped", None, EXIT_OK)
        if not self._draining:
            self._draining = True
            log.info("%s: signal received: finishing the batch in flight, then stopping", self.name)

    # ------------------------------------------------------------------ the slot's lease

    def watch_lease(self, watch: LeaseWatch) -> None:
        threading.Thread(target=self._watch_lease, args=(watch,), daemon=True, name="lease").start()

    def _watch_lease(self, watch: LeaseWatch) -> None:
        while (reason := watch.check()) is None:
            time.sleep(watch.poll_s)
        self.fence(reason)
        time.sleep(watch.exit_s)  # the main thread usually finishes first
        self.exit_now("stopped", reason, EXIT_LEASE)

    def fence(self, reason: str) -> None:
        """From now on nothing is published; the loop stops at its next check."""
        if self.fenced is None:
            log.warning("%s: %s; stopping without publishing what is buffered", self.name, reason)
        self.fenced = reason
        self.stop_requested = True
        if self.phase in ("starting", "loading"):
            self.exit_now("stopped", reason, EXIT_LEASE)

    # ------------------------------------------------------------------ the supervisor process

    def watch_parent(self, parent_pid: int) -> None:
        """A worker outlives its supervisor only until it notices; then it drains as on SIGTERM.

        PR_SET_PDEATHSIG makes the kernel send SIGTERM the moment the supervisor dies (Linux); polling the parent
        pid covers other systems and a supervisor that died before the call.
        """
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        threading.Thread(target=_poll_parent, args=(parent_pid,), daemon=True, name="parent").start()

    # ------------------------------------------------------------------ the engine's processes

    def watch_engine(self, pids: set[int]) -> None:
        """Exit once one of ``pids``, the engine's processes, dies under us.

        An engine that runs in child processes (vLLM's engine core) can die while ``generate`` waits for it, and a
        waiting call does not always notice.  The main thread gets a few seconds to report the failure itself.
        Only the engine's: a reward or tool process that dies is a lost sample, not a lost worker.
        """
        threading.Thread(target=self._watch_engine, args=(set(pids),), daemon=True, name="engine").start()

    def _watch_engine(self, pids: set[int]) -> None:
        while pids and self.phase != "closing":
            time.sleep(1.0)
            dead = [p for p in pids if not _is_child(p)]
            if not dead:
                continue
            time.sleep(ENGINE_REPORT_S)
            if self.phase == "closing":
                return
            error = f"EngineError: engine process {dead[0]} died"
            log.error("%s: %s; exiting", self.name, error)
            if self.stop_requested:
                self.exit_now("stopped", error, EXIT_OK)
            self.exit_now("failed", error, EXIT_CRASH)

    # ------------------------------------------------------------------ leaving

    def exit_now(self, state: str, error: str | None, code: int) -> NoReturn:
        """Leave at once, from any thread, with ``state`` in the status record and no temporary left behind."""
        with self._exiting, self.io_lock:
            self.phase = "closing"
            if self.final_status is not None:
                with contextlib.suppress(Exception):
                    self.final_status(state, error)
            log.info("%s: %s%s", self.name, state, f" ({error})" if error else "")
            _silence()  # the interrupted main thread's complaints about the processes stopped below are noise
            stop_children(CHILD_GRACE_S)
            os._exit(code)


def leave(code: int) -> NoReturn:
    """The end of a worker process whose work is done and recorded: no interpreter teardown.

    Tearing down torch, transformers and an engine can take seconds, during which no thread of ours runs any more;
    a worker that must be gone by a deadline (its lease) cannot afford that, and nothing is left to clean up.
    """
    with contextlib.suppress(Exception):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    stop_children(CHILD_GRACE_S)
    os._exit(code)


def _silence() -> None:
    """Flush what was said, then send anything this process still writes to stdout and stderr to /dev/null."""
    with contextlib.suppress(Exception):
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)


def _poll_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...); None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def child_pids() -> set[int]:
    """This process's living children (Linux /proc; an empty set elsewhere)."""
    me, out = str(os.getpid()), set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit() and (st := _stat(int(name))) is not None and st[1] == me and st[0] not in "ZX":
                out.add(int(name))
    return out


def _is_child(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X") and st[1] == str(os.getpid())


def stop_children(grace_s: float) -> None:
    """SIGTERM to every child, SIGKILL to those still there after ``grace_s``."""
    pids = child_pids()
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while (pids := {p for p in pids if _is_child(p)}) and time.monotonic() < end:
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
