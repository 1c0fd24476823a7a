"""Scoring groups in a pool of child processes, so that the reward function never runs on the engine's path.

A reward function is user code (or sympy): it may be CPU-heavy, hang, or crash its interpreter.  ``ScorePool`` keeps
``processes`` persistent children, each of which resolves ``reward.function`` once at start (on the worker's
``sys.path``) and then scores what it is sent over a pipe.  ``submit`` queues a group and returns a future at once;
one dispatcher thread per child takes groups off the queue, so the engine keeps generating while they are scored.

The results are those of ``rewards.Scorer`` for the same group, built from the same helpers of ``rewards``:
``reward.truncated_reward`` applied, a raise or a non-finite value fails the group (``GroupRewards(None, line)``;
the line names the first failing sample in order), and a batched function is called once per group (not once per
batch of groups, as ``Scorer`` does).  Every call of the function has ``timeout_s`` of wall time.  Other forms are
called once per sample, so that a hang costs one sample: a sample past its limit, or whose child died (a segfault,
``os._exit``, the kernel's OOM killer), is scored 0.0, the child is SIGKILLed with its whole process group (whatever
the function started) and replaced, and the group's other samples go on in the fresh child.  A batched call that is
lost scores each of its samples 0.0.  ``GroupRewards.timed_out`` counts such samples and ``note`` is one line about
the first.  A child that cannot resolve the function at start breaks the pool: that group's future and every later
one fail with the child's one line (``RewardConfigError``), and nothing is restarted.  ``close`` kills the children
and fails every future not yet done with ``ScorePoolClosed``.  A reward model is not the pool's business: it stays
in the worker.

Children are started with the "spawn" method, since the worker holds engine threads and a fork could copy a lock
that one of them holds; spawn imports the worker's main module in each child, so that module must keep its work
under ``if __name__ == "__main__"`` (spawn also starts multiprocessing's resource tracker, one per worker).  A group
costs one message each way: the child writes the index and start time of the sample it is on, and each reward, on a
small shared-memory board, from which the parent times every sample and, after a loss, takes the rewards already
computed.  A fresh child costs about 0.4 s to start (an interpreter and ``rollout_worker.rewards``), paid at pool
start and after each lost call.  Overhead, measured on a 2-core machine for ``max_digit`` on groups of 8 (``Scorer``
in process: 44 us a group): one group at a time, 0.37 ms from ``submit`` to result, 0.21 ms of it the worker's CPU;
2000 groups in flight on 2 processes, 0.33 ms of wall time and 0.22 ms of the worker's CPU a group.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

from buffer.config import RewardConfig

from .engines.base import Completion
from .prompts import EncodedPrompt
from .rewards import (
    Form,
    GroupRewards,
    RewardConfigError,
    RewardFunction,
    ScoreItem,
    checked,
    group_items,
    math_answer,
    resolve_reward,
    score_items,
    to_score,
)

# How long a fresh child may take to import the reward function's module before the pool gives up on it.
START_TIMEOUT_S = 120.0
# Samples per call of a non-batched function: a larger group goes in several calls (the board's size).
CALL_SAMPLES = 256
_CTX = multiprocessing.get_context("spawn")


class ScorePoolClosed(RuntimeError):
    """The pool was closed before the group was scored."""


class ScorePoolError(RuntimeError):
    """A child died or hung before it was ready to score; the message is one line."""


@dataclass(frozen=True)
class _Job:
    items: list[ScoreItem]
    future: Future[GroupRewards]


@dataclass(frozen=True)
class _Lost:
    """A call that never answered: ``why`` starts its note, ``scored`` holds the samples finished before it."""

    why: str
    scored: list[float] = field(default_factory=list)


class _Child:
    """One scoring process, the parent's end of its pipe and its board; only its dispatcher thread reads the pipe.

    The board is shared memory the child writes as it goes: ``[sample being scored, when it started (monotonic
    clock, which is system-wide), reward of sample 0, 1, ...]``.  The parent times each sample from it without a
    message per sample, and after a loss it reads the samples already scored (a dead child's stores are visible once
    it is reaped).
    """

    def __init__(self, name: str) -> None:
        self.conn, theirs = _CTX.Pipe()
        self.board = _CTX.RawArray("d", 2 + CALL_SAMPLES)
        self.process = _CTX.Process(
            target=_child_main,
            args=(theirs, self.board, name, list(sys.path), os.getpid()),
            daemon=True,
            name="shardrl-reward",
        )
        self.process.start()
        theirs.close()  # the child must hold the only other end, so that its death reads as EOF here
        self.form: Form | None = None
        # close() kills from its own thread: a signal must not pass a reap, after which the pid may name another
        self._reaping = threading.Lock()

    def ready(self) -> Form:
        """The function's form, once the child has resolved it; RewardConfigError or ScorePoolError if it cannot."""
        if self.form is not None:
            return self.form
        if not self.conn.poll(START_TIMEOUT_S):
            raise ScorePoolError(f"reward process did not start within {START_TIMEOUT_S:g} s")
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            raise ScorePoolError(f"reward process {self._ended()} before it was ready") from None
        if kind == "failed":
            raise RewardConfigError(value)
        self.form = value
        return value

    def call(self, items: list[ScoreItem], timeout_s: float) -> GroupRewards | _Lost:
        """The child's rewards of ``items`` (one call per item unless batched), or the call was lost.

        After a ``_Lost`` the child is of no more use; ``scored`` is read from it once it is discarded.
        """
        self.board[0], self.board[1] = 0.0, time.monotonic()
        try:
            self.conn.send(items)
            if self._answered(timeout_s):
                got: GroupRewards = self.conn.recv()
                return got
            return _Lost(f"reward function timed out after {timeout_s:g} s")
        except (EOFError, OSError):  # BrokenPipeError at send, EOF at recv: the child is gone
            return _Lost(f"reward process {self._ended()}")

    def _answered(self, timeout_s: float) -> bool:
        """True when the answer is in; False when the sample being scored has run ``timeout_s``."""
        while True:
            if self.conn.poll(max(0.0, self.board[1] + timeout_s - time.monotonic())):
                return True
            if self.board[1] + timeout_s <= time.monotonic():  # not moved on to the next sample meanwhile
                return False

    def scored(self) -> list[float]:
        """Rewards of the samples the child finished in the lost call; only after ``discard``."""
        return list(self.board[2 : 2 + int(self.board[0])])

    def alive(self) -> bool:
        with self._reaping:
            return self.process.is_alive()

    def _ended(self) -> str:
        with self._reaping:
            self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            return "closed its pipe"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def kill(self) -> None:
        """SIGKILL the child and its group; safe from any thread, since it touches no pipe."""
        with self._reaping:
            self._signal()

    def discard(self) -> None:
        with self._reaping:
            self._signal()
            self.process.join()
        self.conn.close()

    def _signal(self) -> None:
        pid = self.process.pid
        assert pid is not None  # started in __init__; killpg(0) would be the worker's own group
        # Before the child's setsid its pid names no group and killpg finds nothing: the plain kill covers that.
        # After a reap, a group the function left behind keeps the pid from being reused, so killpg is still safe.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        self.process.kill()


class _Slot:
    """A dispatcher thread's current child (None between a lost call and its replacement's start)."""

    child: _Child | None = None


class ScorePool:
    """``processes`` children scoring submitted groups with ``reward.function``, each call within ``timeout_s``."""

    def __init__(self, reward: RewardConfig, *, processes: int, timeout_s: float) -> None:
        if processes < 1 or not timeout_s > 0:
            raise ValueError(
                f"ScorePool needs processes >= 1 and timeout_s > 0, got {processes} and {timeout_s}"
            )
        self._name = reward.function
        self._truncated = reward.truncated_reward
        self._timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._children: set[_Child] = set()
        self._closed = False
        self._broken: Exception | None = None
        self._threads = [
            threading.Thread(target=self._serve, name=f"shardrl-score-{k}", daemon=True)
            for k in range(processes)
        ]
        for t in self._threads:
            t.start()

    def __enter__(self) -> ScorePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, prompt: EncodedPrompt, outs: Sequence[Completion]) -> Future[GroupRewards]:
        """Queue one group; the future's result equals ``Scorer(reward).score_batch([prompt], [outs])[0]``."""
        future: Future[GroupRewards] = Future()
        items = group_items(prompt, outs)
        with self._lock:
            if self._closed:
                raise ScorePoolClosed("the score pool is closed")
            if self._broken is not None:
                future.set_exception(_again(self._broken))
            else:
                self._jobs.put(_Job(items, future))
        return future

    def close(self) -> None:
        """Kill every child and fail every future not yet done; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            children = list(self._children)
        for child in children:
            child.kill()  # a thread blocked on this child's pipe wakes up at the EOF
        for _ in self._threads:
            self._jobs.put(None)  # after every queued job, which the threads now fail as closed
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:  # close() from a future's callback runs on a dispatcher thread
                t.join()

    # ------------------------------------------------------------------------------------------ dispatching

    def _serve(self) -> None:
        slot = _Slot()
        # At once, so that the first group does not wait for an interpreter; a failure here is tried again, and
        # reported, by the first group's ``_ready``.
        with contextlib.suppress(Exception):
            slot.child = self._spawn()
        try:
            while (job := self._jobs.get()) is not None:
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    result = self._score(slot, job.items)
                except Exception as e:
                    job.future.set_exception(e)
                else:
                    job.future.set_result(result)
        finally:
            if slot.child is not None:
                self._discard(slot.child)

    def _score(self, slot: _Slot, items: list[ScoreItem]) -> GroupRewards:
        """One group's rewards: the cut-off responses' fixed reward, the children's for the rest."""
        self._check_open()
        values: list[Any] = [self._truncated] * len(items)
        todo = to_score(items, self._truncated)
        timed_out, note = 0, None
        while todo:
            batched = self._ready(slot) == "batched"
            call = todo if batched else todo[:CALL_SAMPLES]  # a batched function sees the whole group at once
            got = self._call(slot, [items[i] for i in call])
            if isinstance(got, GroupRewards):
                if got.rewards is None:
                    return GroupRewards(None, got.error, timed_out, note)
                for i, v in zip(call, got.rewards, strict=True):
                    values[i] = v
                todo = todo[len(call) :]
                continue
            for i, v in zip(call, got.scored, strict=False):
                values[i] = v
            lost = call if batched else [call[len(got.scored)]]
            for i in lost:
                values[i] = 0.0
            timed_out += len(lost)
            where = f"the group's call ({len(lost)} samples)" if batched else f"sample {lost[0]} (0-based)"
            note = note or f"{got.why} on {where}; scored 0.0"
            todo = todo[len(got.scored) + len(lost) :]  # the rest go on in the fresh child
        return replace(checked(items, values), timed_out=timed_out, note=note)

    def _call(self, slot: _Slot, items: list[ScoreItem]) -> GroupRewards | _Lost:
        """The slot's child's answer to ``items``; after a lost call the child is replaced."""
        if slot.child is not None and not slot.child.alive():
            # it died while idle (the OOM killer, say): no sample of this call is to blame
            self._discard(slot.child)
            slot.child = None
        self._ready(slot)
        child = slot.child
        assert child is not None
        got = child.call(items, self._timeout_s)
        if isinstance(got, _Lost):
            self._check_open()  # a child killed by close() is no lost sample
            self._discard(child)
            slot.child = None
            got = replace(got, scored=child.scored())
            slot.child = self._spawn()
        return got

    def _ready(self, slot: _Slot) -> Form:
        """The form of the slot's child, started if it has none; a child that cannot start breaks the pool."""
        if slot.child is None:
            slot.child = self._spawn()
        try:
            return slot.child.ready()
        except (RewardConfigError, ScorePoolError) as e:
            self._check_open()
            self._discard(slot.child)  # it may hang in an import: no use keeping it
            slot.child = None
            with self._lock:
                self._broken = self._broken or e
            raise _again(self._broken) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ScorePoolClosed("the score pool was closed before the group was scored")
        if self._broken is not None:
            raise _again(self._broken)

    def _spawn(self) -> _Child:
        self._check_open()
        child = _Child(self._name)
        with self._lock:
            self._children.add(child)
            closed = self._closed
        if closed:  # close() ran while this one started and did not see it
            self._discard(child)
            self._check_open()
        return child

    def _discard(self, child: _Child) -> None:
        child.discard()
        with self._lock:
            self._children.discard(child)


def _again(e: Exception) -> Exception:
    """A fresh exception of the same type and line, so that futures do not share one traceback."""
    return type(e)(str(e))


# ---------------------------------------------------------------------------------------------- the child


def _child_main(conn: Connection, board: Any, name: str, path: list[str], parent: int) -> None:
    """A child's life: resolve the function once, then score what the parent sends until the pipe closes."""
    os.setsid()  # a group of its own: the kill at the time limit takes whatever the function started
    _die_with(parent)
    sys.path[:] = path
    try:
        function = resolve_reward(name)
        _warm(function)
    except Exception as e:
        conn.send(("failed", " ".join(str(e).split()) or type(e).__name__))
        return
    conn.send(("ready", function.form))
    while True:
        try:
            items = conn.recv()
        except EOFError:
            return
        conn.send(
            score_items(function, items)
            if function.form == "batched"
            else _one_by_one(function, items, board)
        )


def _one_by_one(function: RewardFunction, items: list[ScoreItem], board: Any) -> GroupRewards:
    """Each item in its own call, its start and its reward on the board, up to the first that fails."""
    rewards: list[float] = []
    for i, item in enumerate(items):
        board[0], board[1] = i, time.monotonic()
        got = score_items(function, [item])
        if got.rewards is None:
            return got
        # written before the next index, since the parent takes every sample below the index as scored
        board[2 + i] = got.rewards[0]
        rewards.append(got.rewards[0])
    return GroupRewards(rewards)


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this child when the worker dies, so that a hung call cannot outlive it (Linux).

    The signal comes when the *thread* that started the child ends; that is a dispatcher thread, which lives as
    long as the pool.
    """
    if sys.platform != "linux":
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the worker died before the line above
        os._exit(0)


def _warm(function: RewardFunction) -> None:
    # math_answer imports math-verify (sympy: seconds) on its first call; here that is outside any call's limit
    if function.fn is math_answer:
        with contextlib.suppress(ImportError):
            import math_verify  # noqa: F401
