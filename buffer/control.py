"""control.json commands, the durable desired worker count, and worker-slot leases.

People write ``control.json`` with ``echo``, which truncates and rewrites in place, so a reader may see it empty or
half written: an unparsable file is "not yet" until it has stayed the same for ``settle_s``, then it is rejected.
A command is identified by its content plus its change time (mtime_ns, size), so echoing the same text again is a
new command.  Applying a command (or rejecting one) creates the next generation ``control/gen-XXXXXXXX.json`` with an
exclusive create; when several supervisors race, exactly one create wins and the others re-read, find the command
in the history and skip it, so each command is applied exactly once across nodes.

Leases: slot k is held by the supervisor named in ``leases/slot-XXXX.json``; the holder bumps a counter each
heartbeat.  An observer judges a lease stale when the counter has not changed for ``timeout_s`` on its own monotonic
clock, never by comparing clocks of different hosts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from .fsio import HOST, create_json_exclusive, read_json_or_none, write_json_atomic
from .layout import RunLayout

ACTIONS = ("add", "remove", "set")
HISTORY = 256
_GEN_RE = re.compile(r"^gen-(\d{8})\.json$")


class ControlError(ValueError):
    """A rejected command; the message is the one-line reason shown by `shardrl status`."""


def parse_command(
    raw: bytes, current: int, max_workers: int, source: str = "control.json"
) -> tuple[dict, int]:
    """Validate a command; return it with the desired count it leads to, or raise ControlError."""
    try:
        cmd = json.loads(raw)
    except ValueError as e:
        raise ControlError(
            f'{source}: not valid JSON ({getattr(e, "msg", e)}); expected e.g. {{"action":"add","count":2}}'
        ) from None
    if not isinstance(cmd, dict):
        raise ControlError(f'{source}: expected a JSON object like {{"action":"add","count":2}}')
    action, count = cmd.get("action"), cmd.get("count")
    if action not in ACTIONS:
        raise ControlError(f"{source}: field action: {action!r} is not one of add, remove, set")
    if not isinstance(count, int) or isinstance(count, bool):
        raise ControlError(f"{source}: field count: {count!r} is not an integer")
    if count < 0 or (count == 0 and action != "set"):
        raise ControlError(
            f"{source}: field count: {count} is not allowed for {action} (accepted: >= 1, or >= 0 for set)"
        )
    new = {"add": current + count, "remove": current - count, "set": count}[action]
    if new < 0:
        raise ControlError(f"{source}: field count: remove {count} but only {current} workers are desired")
    if new > max_workers:
        raise ControlError(
            f"{source}: field count: would make {new} workers, above run.max_workers = {max_workers}"
        )
    return {"action": action, "count": count}, new


@dataclass(frozen=True)
class ControlState:
    generation: int
    desired: int
    last_applied: dict | None
    last_rejection: dict | None
    history: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "desired": self.desired,
            "last_applied": self.last_applied,
            "last_rejection": self.last_rejection,
            "history": self.history,
        }


def _generations(layout: RunLayout) -> list[int]:
    try:
        names = os.listdir(layout.control_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _GEN_RE.match(n)))


def read_state(layout: RunLayout) -> ControlState:
    """The newest generation; a run without any starts at desired 0."""
    for gen in reversed(_generations(layout)):
        rec = read_json_or_none(layout.control_generation(gen))
        if isinstance(rec, dict):
            return ControlState(
                gen,
                int(rec["desired"]),
                rec.get("last_applied"),
                rec.get("last_rejection"),
                list(rec["history"]),
            )
    return ControlState(0, 0, None, None, [])


def init_state(layout: RunLayout, desired: int) -> None:
    """Generation 0, written once by `shardrl init`."""
    state = ControlState(0, desired, None, None, [])
    create_json_exclusive(layout.control_generation(0), state.to_json())


def _commit(layout: RunLayout, state: ControlState) -> bool:
    return create_json_exclusive(layout.control_generation(state.generation), state.to_json())


def command_key(raw: bytes, st: os.stat_result) -> str:
    return f"{hashlib.sha256(raw).hexdigest()[:16]}-{st.st_mtime_ns}-{st.st_size}"


class ControlWatcher:
    """Polls control.json for one supervisor and applies new commands exactly once (run-wide)."""

    def __init__(self, layout: RunLayout, max_workers: int, settle_s: float, who: str):
        self.layout = layout
        self.max_workers = max_workers
        self.settle_s = settle_s
        self.who = who
        self._handled: str | None = None
        self._unparsable_since: dict[str, float] = {}

    def poll(self) -> ControlState:
        """Look at control.json once; apply or reject a new command; return the current state."""
        try:
            st = os.stat(self.layout.control_file)
            raw = self.layout.control_file.read_bytes()
        except OSError:
            return read_state(self.layout)
        key = command_key(raw, st)
        if key == self._handled:
            return read_state(self.layout)
        while True:
            state = read_state(self.layout)
            if key in state.history:
                self._handled = key
                return state
            new = self._decide(raw, key, state)
            if new is None:  # still being written
                return state
            if _commit(self.layout, new):
                self._handled = key
                self._unparsable_since.pop(key, None)
                return new
            # another supervisor committed this generation first: re-read and check the history again

    def _decide(self, raw: bytes, key: str, state: ControlState) -> ControlState | None:
        history = ([*state.history, key])[-HISTORY:]
        try:
            cmd, desired = parse_command(raw, state.desired, self.max_workers, str(self.layout.control_file))
        except ControlError as e:
            if self._looks_unfinished(raw, key):
                return None
            rejection = {"key": key, "reason": str(e), "at": time.time(), "by": self.who}
            return ControlState(state.generation + 1, state.desired, state.last_applied, rejection, history)
        applied = {"key": key, "command": cmd, "desired": desired, "at": time.time(), "by": self.who}
        return ControlState(state.generation + 1, desired, applied, state.last_rejection, history)

    def _looks_unfinished(self, raw: bytes, key: str) -> bool:
        """An echo in progress: unparsable content that has not yet stayed the same for settle_s."""
        try:
            json.loads(raw)
            return False  # it parses: the command is complete, just wrong
        except ValueError:
            pass
        first = self._unparsable_since.setdefault(key, time.monotonic())
        return time.monotonic() - first < self.settle_s


def write_command(layout: RunLayout, action: str, count: int) -> None:
    """What `shardrl scale` writes: the same text `echo` would, replaced atomically."""
    write_json_atomic(layout.control_file, {"action": action, "count": count})


# ---------------------------------------------------------------------------------------------- leases


@dataclass
class _Observation:
    counter: int
    holder: str
    since: float  # observer's monotonic clock when this (holder, counter) was first seen


class Leases:
    """Worker-slot leases for one supervisor (``holder``)."""

    def __init__(self, layout: RunLayout, holder: str, timeout_s: float):
        self.layout = layout
        self.holder = holder
        self.timeout_s = timeout_s
        self.counters: dict[int, int] = {}
        self._seen: dict[int, _Observation] = {}

    def read(self, slot: int) -> dict | None:
        rec = read_json_or_none(self.layout.lease(slot))
        return rec if isinstance(rec, dict) else None

    def _record(self, slot: int, counter: int) -> dict:
        return {"slot": slot, "holder": self.holder, "counter": counter, "host": HOST, "pid": os.getpid()}

    def is_stale(self, slot: int, rec: dict) -> bool:
        obs = self._seen.get(slot)
        now = time.monotonic()
        if obs is None or obs.counter != rec.get("counter") or obs.holder != rec.get("holder"):
            self._seen[slot] = _Observation(int(rec.get("counter", 0)), str(rec.get("holder")), now)
            return False
        return now - obs.since >= self.timeout_s

    def try_acquire(self, slot: int) -> bool:
        """Take a free slot, or a stale one; True when this supervisor now holds it."""
        rec = self.read(slot)
        if rec is None:
            if create_json_exclusive(self.layout.lease(slot), self._record(slot, 1)):
                self.counters[slot] = 1
                return True
            return False
        if rec.get("holder") == self.holder:
            self.counters[slot] = int(rec.get("counter", 0))
            return self.renew(slot)
        if not self.is_stale(slot, rec):
            return False
        counter = int(rec.get("counter", 0)) + 1
        write_json_atomic(self.layout.lease(slot), self._record(slot, counter))
        # two reclaimers may race; the last rename wins and the loser finds out here (or at its next renew)
        time.sleep(0.05)
        mine = self.read(slot)
        if mine is not None and mine.get("holder") == self.holder:
            self.counters[slot] = counter
            return True
        return False

    def renew(self, slot: int) -> bool:
        """Heartbeat a held lease; False (and forgotten) when somebody else took it over."""
        rec = self.read(slot)
        if rec is None or rec.get("holder") != self.holder:
            self.counters.pop(slot, None)
            return False
        counter = self.counters.get(slot, int(rec.get("counter", 0))) + 1
        write_json_atomic(self.layout.lease(slot), self._record(slot, counter))
        self.counters[slot] = counter
        return True

    def release(self, slot: int) -> None:
        rec = self.read(slot)
        if rec is not None and rec.get("holder") == self.holder:
            with contextlib.suppress(FileNotFoundError):
                self.layout.lease(slot).unlink()
        self.counters.pop(slot, None)

    def held(self) -> list[int]:
        return sorted(self.counters)


def all_leases(layout: RunLayout) -> dict[int, dict]:
    out: dict[int, dict] = {}
    try:
        names = os.listdir(layout.leases)
    except FileNotFoundError:
        return out
    for n in names:
        m = re.match(r"^slot-(\d{4})\.json$", n)
        if m and isinstance(rec := read_json_or_none(layout.leases / n), dict):
            out[int(m.group(1))] = rec
    return out
