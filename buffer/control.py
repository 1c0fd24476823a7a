"""control.json commands, the durable desired worker count, and worker-slot leases.

People write ``control.json`` with ``echo``, which truncates and rewrites in place, so a reader may see it empty or
half written: an unparsable file is "not yet" until it has stayed the same for ``settle_s``, then it is rejected.
A command is identified by its content plus its change time (mtime_ns, size), so echoing the same text again is a
new command.  Applying a command (or rejecting one) creates the next generation ``control/gen-XXXXXXXX.json`` with an
exclusive create; when several supervisors race, exactly one create wins and the others re-read, find the command
in the history and skip it, so each command is applied exactly once across nodes.

The newest generation is the truth: when it cannot be read or is not a valid record, the state carries a
``problem`` and nothing is committed on top of it (supervisors keep the count they had, and say why), rather than
falling back to an older generation's count.

Leases: slot k is held by the supervisor named in its newest lease generation ``leases/slot-XXXX/GGGGGGGG.json``;
the holder rewrites only its own generation, bumping a counter each heartbeat.  An observer judges a lease stale when
(generation, counter) has not changed for ``timeout_s`` on its own monotonic clock, never by comparing clocks of
different hosts.  Taking a slot over (or taking a free or released one) is the exclusive create of the next
generation, the mechanism control generations and plan epochs use: of any number of reclaimers that saw generation g
stale, exactly one creates g + 1; the others find it taken and hold nothing.  A holder that finds a newer generation
than its own has lost the slot.  The worker of a slot watches the lease too (``LeaseWatch``) and stops by itself
once it is not its supervisor's any more, or stops moving (the supervisor stalled), well before anyone else can take
the slot over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .fsio import (
    HOST,
    TRANSIENT_ERRNOS,
    FileRefused,
    create_json_exclusive,
    read_capped_stat,
    read_json,
    write_json_atomic,
)
from .layout import RunLayout
from .records import Lease, RecordError, create_record, read_record, write_record

ACTIONS = ("add", "remove", "set")
HISTORY = 256
COMMIT_ATTEMPTS = 8  # commits lost in a row before a poll gives up until the next one
# A command is a few dozen bytes; anything far larger is refused unread (a stray redirect must not cost a core).
CONTROL_MAX_BYTES = 64 * 1024
FIELDS = ("action", "count")
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
    unknown = sorted(set(cmd) - set(FIELDS))
    if unknown:
        # A field the command does not have is a typo or an option it lacks; applying the rest would surprise.
        raise ControlError(
            f"{source}: unknown field(s) {', '.join(map(repr, unknown))}; accepted: action, count"
        )
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
    # Set when the newest generation is unreadable or invalid: ``desired`` and the rest then come from the newest
    # valid older generation, for display only; supervisors keep their own count and commit nothing on top.
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "desired": self.desired,
            "last_applied": self.last_applied,
            "last_rejection": self.last_rejection,
            "history": self.history,
        }

    @classmethod
    def from_json(cls, generation: int, rec: Any) -> ControlState:
        """A generation record, checked field by field; ValueError names what is wrong."""
        if not isinstance(rec, dict):
            raise ValueError("not a JSON object")
        desired, history = rec.get("desired"), rec.get("history")
        if not isinstance(desired, int) or isinstance(desired, bool) or desired < 0:
            raise ValueError(f"field desired: {desired!r} is not an integer >= 0")
        if not isinstance(history, list) or not all(isinstance(k, str) for k in history):
            raise ValueError("field history: not a list of command keys")
        applied, rejection = rec.get("last_applied"), rec.get("last_rejection")
        return cls(
            generation,
            desired,
            applied if isinstance(applied, dict) else None,
            rejection if isinstance(rejection, dict) else None,
            history,
        )


def _generations(layout: RunLayout) -> list[int]:
    try:
        names = os.listdir(layout.control_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _GEN_RE.match(n)))


def _read_generation(layout: RunLayout, gen: int) -> ControlState:
    """Generation ``gen``; OSError after the transient retries, ValueError when it is not a valid record."""
    return ControlState.from_json(gen, read_json(layout.control_generation(gen)))


def read_state(layout: RunLayout) -> ControlState:
    """The newest generation; a run without any starts at desired 0.

    A newest generation that cannot be read or is invalid (a damaged disk, a hand edit) is reported in ``problem``,
    never silently replaced by an older one.
    """
    gens = _generations(layout)
    if not gens:
        return ControlState(0, 0, None, None, [])
    try:
        return _read_generation(layout, gens[-1])
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        problem = (
            f"{layout.control_generation(gens[-1])}: {reason}; the desired worker count is unknown until it is "
            "repaired (supervisors keep their current count): move it away, then repeat the last command"
        )
    for gen in reversed(gens[:-1]):
        with contextlib.suppress(OSError, ValueError):
            return replace(_read_generation(layout, gen), generation=gens[-1], problem=problem)
    return ControlState(gens[-1], 0, None, None, [], problem)


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

    def __init__(
        self,
        layout: RunLayout,
        max_workers: int,
        settle_s: float,
        who: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.layout = layout
        self.max_workers = max_workers
        self.settle_s = settle_s
        self.who = who
        self._clock = clock  # settle_s is judged on this clock (a test moves it by hand)
        self._handled: str | None = None
        self._unparsable_since: dict[str, float] = {}
        self._failing_since: dict[int, tuple[int, float]] = {}

    def poll(self) -> ControlState:
        """Look at control.json once; apply or reject a new command; return the current state."""
        path = self.layout.control_file
        try:
            # The stat of the very file read: a stale stat followed by a fresh one would give one echo two keys.
            raw, st = read_capped_stat(path, CONTROL_MAX_BYTES)
        except FileNotFoundError:
            if not path.is_symlink():
                return read_state(self.layout)  # no command: the usual case
            raw, st = self._refusal(path, "a symbolic link whose target is missing")
        except FileRefused as e:
            raw, st = self._refusal(path, e.reason)
        except OSError as e:
            if e.errno in TRANSIENT_ERRNOS and not self._persistent(e.errno):
                return read_state(self.layout)  # NFS hiccup: the next poll reads it
            raw, st = self._refusal(path, f"unreadable ({e.strerror or e})")
        self._failing_since.clear()
        if len(raw) != st.st_size and not raw.startswith(b"\0refused\0"):
            return read_state(self.layout)  # written while read: the next poll reads it whole
        key = command_key(raw, st)
        if key == self._handled:
            return read_state(self.layout)
        for _ in range(COMMIT_ATTEMPTS):
            state = read_state(self.layout)
            if state.problem is not None:  # nothing is decided on top of a state we cannot read
                return state
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
        # still losing: a generation we cannot see yet (a cached directory listing); the next poll tries again
        return state

    def _persistent(self, err: int) -> bool:
        """A transient-looking error is judged persistent once seen on two polls in a row, settle_s apart."""
        count, first = self._failing_since.get(err, (0, self._clock()))
        self._failing_since[err] = (count + 1, first)
        return count + 1 >= 2 and self._clock() - first >= self.settle_s

    @staticmethod
    def _refusal(path: Any, reason: str) -> tuple[bytes, os.stat_result]:
        """A control.json that cannot be read as a command becomes a command that is rejected once, with its reason
        (the lstat identifies it, so a changed one is judged again)."""
        st = os.lstat(path)
        return f"\0refused\0{path}: {reason}".encode(), st

    def _decide(self, raw: bytes, key: str, state: ControlState) -> ControlState | None:
        history = ([*state.history, key])[-HISTORY:]
        try:
            if raw.startswith(b"\0refused\0"):
                raise ControlError(
                    raw.split(b"\0", 2)[2].decode(errors="replace") + "; expected a file holding "
                    'e.g. {"action":"add","count":2}'
                )
            cmd, desired = parse_command(raw, state.desired, self.max_workers, str(self.layout.control_file))
        except ControlError as e:
            if not raw.startswith(b"\0refused\0") and self._looks_unfinished(raw, key):
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
        first = self._unparsable_since.setdefault(key, self._clock())
        return self._clock() - first < self.settle_s


def write_command(layout: RunLayout, action: str, count: int) -> None:
    """What `shardrl scale` writes: the same text `echo` would, replaced atomically."""
    write_json_atomic(layout.control_file, {"action": action, "count": count})


# ---------------------------------------------------------------------------------------------- leases

_LEASE_RE = re.compile(r"^(\d{8})\.json$")
_SLOT_RE = re.compile(r"^slot-(\d{4})$")

# Fractions of ``run.lease_timeout_s`` (T).  Another supervisor can take a slot over only once its lease stood still
# for T on that supervisor's clock.  The holder renews at least every T/8.  The slot's worker reads the lease every
# T/8 and stops publishing once it is not its supervisor's any more, or has stood still for T/2 on the worker's clock:
# at most 3T/4 after the last renewal it saw; it is gone T/8 later, by 7T/8, before a takeover is possible.
RENEW_FRACTION = 1 / 8
WATCH_POLL_FRACTION = 1 / 8
WATCH_STALL_FRACTION = 1 / 2
WATCH_EXIT_FRACTION = 1 / 8


def renew_interval_s(timeout_s: float, heartbeat_interval_s: float) -> float:
    """How often a supervisor renews its leases: every heartbeat, and never less often than T/8."""
    return min(heartbeat_interval_s, timeout_s * RENEW_FRACTION)


def lease_generations(layout: RunLayout, slot: int) -> list[int]:
    try:
        names = os.listdir(layout.lease_dir(slot))
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _LEASE_RE.match(n)))


def read_lease(layout: RunLayout, slot: int) -> dict | None:
    """The newest generation of the slot's lease, with its ``generation``; None for a slot never leased.

    An unreadable newest generation reads as holder None: it stands still, so it turns stale and is taken over.
    """
    gens = lease_generations(layout, slot)
    if not gens:
        return None
    try:
        rec = read_record(Lease, layout.lease(slot, gens[-1]), attempts=2).to_json()
    except (RecordError, OSError):
        rec = {"slot": slot, "holder": None, "counter": None}
    return {**rec, "generation": gens[-1]}


@dataclass
class _Observation:
    key: tuple[Any, ...]  # (generation, holder, counter) as last read
    since: float  # observer's monotonic clock when this key was first seen


class Leases:
    """Worker-slot leases for one supervisor (``holder``)."""

    def __init__(
        self, layout: RunLayout, holder: str, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.layout = layout
        self.holder = holder
        self.timeout_s = timeout_s
        self._clock = clock  # staleness is judged on this observer's clock only
        self.generations: dict[int, int] = {}  # slot -> the generation we hold
        self.counters: dict[int, int] = {}
        self._seen: dict[int, _Observation] = {}

    def read(self, slot: int) -> dict | None:
        return read_lease(self.layout, slot)

    def _record(self, slot: int, generation: int, counter: int, *, released: bool = False) -> Lease:
        return Lease(
            slot=slot,
            generation=generation,
            holder=self.holder,
            counter=counter,
            released=released,
            host=HOST,
            pid=os.getpid(),
            written_at=time.time(),
        )

    def is_stale(self, slot: int, rec: dict) -> bool:
        """True once ``rec`` (generation, holder, counter) has stayed the same for ``timeout_s`` on our clock."""
        key = (rec.get("generation"), rec.get("holder"), rec.get("counter"))
        obs, now = self._seen.get(slot), self._clock()
        if obs is None or obs.key != key:
            self._seen[slot] = _Observation(key, now)
            return False
        return now - obs.since >= self.timeout_s

    def try_acquire(self, slot: int) -> bool:
        """Take a free, released or stale slot; True when this supervisor now holds it."""
        rec = self.read(slot)
        if rec is None:
            return self._claim(slot, 1)
        if rec.get("holder") == self.holder and not rec.get("released"):
            self.generations[slot], self.counters[slot] = rec["generation"], int(rec.get("counter") or 0)
            return self.renew(slot)
        if rec.get("released") or self.is_stale(slot, rec):
            return self._claim(slot, rec["generation"] + 1)
        return False

    def _claim(self, slot: int, generation: int) -> bool:
        """Exclusive create of exactly ``generation``: of all who try it, one wins; the others hold nothing."""
        self.layout.lease_dir(slot).mkdir(parents=True, exist_ok=True)
        if not create_record(self.layout.lease(slot, generation), self._record(slot, generation, 1)):
            return False
        self.generations[slot], self.counters[slot] = generation, 1
        for old in lease_generations(self.layout, slot):
            if old < generation - 1:  # the one we took over from stays, to say whom we took it from
                with contextlib.suppress(OSError):
                    self.layout.lease(slot, old).unlink()
        return True

    def _superseded(self, slot: int) -> bool:
        return max(lease_generations(self.layout, slot), default=0) > self.generations[slot]

    def renew(self, slot: int) -> bool:
        """Heartbeat a held lease; False (and forgotten) when a newer generation took it over."""
        if slot not in self.generations:
            return False
        if self._superseded(slot):
            self._forget(slot)
            return False
        counter = self.counters[slot] + 1
        gen = self.generations[slot]
        write_record(self.layout.lease(slot, gen), self._record(slot, gen, counter))
        self.counters[slot] = counter
        return True

    def release(self, slot: int) -> None:
        """Give a held slot back: its generation says ``released``, so the next taker need not wait."""
        if slot in self.generations and not self._superseded(slot):
            gen = self.generations[slot]
            write_record(
                self.layout.lease(slot, gen), self._record(slot, gen, self.counters[slot] + 1, released=True)
            )
        self._forget(slot)

    def _forget(self, slot: int) -> None:
        self.generations.pop(slot, None)
        self.counters.pop(slot, None)

    def held(self) -> list[int]:
        return sorted(self.generations)


class LeaseWatch:
    """A worker's view of its own slot's lease: is it still its supervisor's, and is it still moving?"""

    def __init__(
        self,
        layout: RunLayout,
        slot: int,
        holder: str,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.layout = layout
        self.slot = slot
        self.holder = holder
        self._clock = clock  # the stall is judged on the worker's own clock
        self.poll_s = timeout_s * WATCH_POLL_FRACTION
        self.stall_s = timeout_s * WATCH_STALL_FRACTION
        self.exit_s = timeout_s * WATCH_EXIT_FRACTION
        self._key: tuple[Any, ...] | None = None
        self._since = clock()

    def check(self) -> str | None:
        """None while the lease is fine; otherwise the one-line reason why the worker must stop now."""
        now = self._clock()
        try:
            rec = read_lease(self.layout, self.slot)
        except OSError:
            rec = {"holder": self.holder, "generation": None}  # cannot tell: counts as not moving
        if rec is None or rec.get("released"):
            return f"lease of slot {self.slot} was given back by {self.holder}"
        if rec.get("holder") != self.holder:
            return (
                f"lease of slot {self.slot} is now held by {rec.get('holder')} (generation "
                f"{rec.get('generation')}), not by {self.holder}"
            )
        key = (rec.get("generation"), rec.get("counter"))
        if key != self._key and rec.get("generation") is not None:
            self._key, self._since = key, now
            return None
        if now - self._since >= self.stall_s:
            return (
                f"lease of slot {self.slot} not renewed for {self.stall_s:g}s (lease_timeout_s / 2): "
                f"supervisor {self.holder} is stalled or gone"
            )
        return None


def all_leases(layout: RunLayout) -> dict[int, dict]:
    """slot -> the newest generation of every lease that is held (not given back)."""
    out: dict[int, dict] = {}
    try:
        names = os.listdir(layout.leases)
    except FileNotFoundError:
        return out
    for n in names:
        m = _SLOT_RE.match(n)
        if m and (rec := read_lease(layout, int(m.group(1)))) is not None and not rec.get("released"):
            out[int(m.group(1))] = rec
    return out
