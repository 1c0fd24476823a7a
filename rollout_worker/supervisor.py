"""The node supervisor: one per node, it keeps as many rollout workers running here as the run wants and the node holds.

Run as ``shardrl-rollout --run RUN`` (``python -m rollout_worker``); ``deploy/rollout_only.sh`` starts one per node.
Each tick it
  * polls control.json through ``ControlWatcher`` (every ``run.control_poll_s``; an inotify watch on the run
    directory only wakes it early, since inotify never sees writes made by other NFS/Lustre clients) and reads the
    desired worker count;
  * leases free worker slots ``0 .. desired-1`` (lowest first) up to its local capacity and starts one worker process
    per slot, ``python -m rollout_worker.worker``, in its own process group, on its own GPU (``CUDA_VISIBLE_DEVICES``)
    or CPU cores;
  * renews its leases every ``run.heartbeat_interval_s`` (and at least every ``run.lease_timeout_s / 8``); a slot
    whose lease another supervisor took over (we looked dead) has its worker stopped.  The worker watches the lease
    too and stops by itself when it changes hands or stops moving (this supervisor stalled, e.g. SIGSTOPped), before
    another supervisor can take the slot over, so no two workers of one slot ever publish at once;
  * drains workers of slots >= desired (SIGTERM, SIGKILL at ``rollout.drain_deadline_s``) and releases their leases
    once they exited;
  * restarts a worker that died, after ``rollout.restart_backoff_s`` doubling; ``rollout.max_restarts`` restarts within
    ``rollout.restart_window_s`` (or one exit with code 2, a configuration error no restart can fix) mark the worker
    failed in its status record and give its slot back for another node.  This node then leaves that slot alone for
    ``restart_window_s``.
SIGTERM/SIGINT (Slurm time limit, preemption, Ctrl-C) drains every worker within ``rollout.drain_deadline_s`` and
exits 0; a second signal kills the workers at once.  The run's finished record (the trainer trained
``trainer.total_steps``), seen at a control poll, drains the workers the same way and exits 0: no more samples are
wanted.

Storage trouble never ends the supervisor: a write that fails (a full disk writing a worker's log header or the
status record, a flaky mount) is logged, kept in the status record's ``last_error`` (written once writing works
again) and retried at the next tick.  A damaged newest control generation is reported in ``control_problem``; the
desired count stays what it was until it is repaired.  Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buffer.control import ControlState, ControlWatcher, Leases, all_leases, renew_interval_s
from buffer.fsio import HOST, read_json_or_none
from buffer.heartbeats import StatusWriter, fleet_fields, load_worker, supervisor_status, worker_status
from buffer.layout import RunLayout
from buffer.logs import logger, setup_logging
from buffer.procs import signal_group, start_group, stop_groups
from buffer.records import LIVE_STATES, RecordError
from buffer.run import Run
from buffer.status import read_finished
from rollout_worker import reconcile as core
from rollout_worker.devices import local_devices
from rollout_worker.worker import worker_id_for

log = logger("supervisor")
# How often the node's record is rewritten with its workers' in-flight and published counts (at least every
# heartbeat): about the trainer's feed refresh, so that relaying them adds at most this much to what it lags by.
NODE_FEED_S = 1.0


def worker_log(layout: RunLayout, worker_id: str) -> Path:
    """Where this node's incarnations of a worker write their output (appended; one file per worker and host)."""
    return layout.log_file(f"rollout-{worker_id}-{HOST}")


# ---------------------------------------------------------------------------------------------- one slot


@dataclass
class Slot(core.SlotState):
    """A slot this node holds: the rules' state of it, and its worker process."""

    local: int = 0  # index of the local device group
    worker_id: str = ""
    proc: subprocess.Popen | None = None


def _last_line(path: Path, limit: int = 65536) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][:500] if lines else None


# ---------------------------------------------------------------------------------------------- the supervisor


class Supervisor:
    def __init__(self, run: Run, overrides: dict[str, str]):
        self.run = run
        self.cfg = run.config
        self.layout = run.layout
        self.overrides = overrides
        self.id = f"{HOST}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.devices = local_devices(self.cfg)
        self.policy = core.Policy.of(self.cfg, self.devices.capacity)
        self.watcher = ControlWatcher(
            self.layout, self.cfg.run.max_workers, self.cfg.run.control_settle_s, self.id
        )
        self.leases = Leases(self.layout, self.id, self.cfg.run.lease_timeout_s)
        self.status: StatusWriter = supervisor_status(self.layout, self.id, capacity=self.devices.capacity)
        self.slots: dict[int, Slot] = {}
        self.cooldown: dict[int, float] = {}  # slots this node gave up on, until when
        self.failed: dict[int, str] = {}
        self.desired = 0
        self.control_generation = -1
        self.last_rejection: str | None = None
        self.control_problem: str | None = None
        self.last_error: str | None = None  # the last storage error kept going through, for the status record
        self.stopping = False
        self.deadline = math.inf
        self._signals = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._observer: Any = None

    # ------------------------------------------------------------------ wake-ups and signals

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _sleep(self, seconds: float) -> None:
        ready, _, _ = select.select([self._wake_r], [], [], max(seconds, 0.0))
        if ready:
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self._wake_r, 4096)

    def on_signal(self, signum: int, frame: object) -> None:
        # Only a counter here; the wakeup fd (set in serve) wakes the loop, which does the work.
        self._signals += 1

    def _trouble(self, what: str, e: OSError) -> None:
        """A storage error the supervisor keeps going through: logged, and kept for the status record."""
        line = f"{what}: {e}"
        if line != self.last_error:
            log.warning("supervisor %s: %s; will retry", self.id, line)
        self.last_error = line

    def _watch_control_file(self) -> None:
        """inotify on the run directory, as a hint: same-node writes of control.json wake the loop at once."""
        try:
            from watchdog.events import FileSystemEvent, FileSystemEventHandler
            from watchdog.observers import Observer

            control = str(self.layout.control_file)
            sup = self

            class Hint(FileSystemEventHandler):
                def on_any_event(self, event: FileSystemEvent) -> None:
                    if control in (str(event.src_path), str(getattr(event, "dest_path", ""))):
                        sup.wake()

            observer = Observer()
            observer.schedule(Hint(), str(self.layout.root), recursive=False)
            observer.daemon = True
            observer.start()
            self._observer = observer
        except Exception as e:  # no inotify (limits, platform): polling alone is authoritative anyway
            log.info("supervisor %s: no inotify hint (%s); polling only", self.id, e)

    # ------------------------------------------------------------------ control and leases

    def _poll_control(self) -> None:
        try:
            state: ControlState = self.watcher.poll()
        except OSError as e:  # a flaky mount or a full disk: keep the last desired count
            self._trouble(f"control poll failed (keeping desired {self.desired})", e)
            return
        if state.problem is not None:  # never a silent revert: keep the count we had, and say why
            if state.problem != self.control_problem:
                log.error("supervisor %s: %s; keeping desired %d", self.id, state.problem, self.desired)
            self.control_problem = state.problem
            return
        if self.control_problem is not None:
            log.info("supervisor %s: control state readable again", self.id)
            self.control_problem = None
        first = self.control_generation < 0
        if state.desired != self.desired:
            log.info("supervisor %s: desired workers %d -> %d", self.id, self.desired, state.desired)
        self.desired, self.control_generation = state.desired, state.generation
        reason = (state.last_rejection or {}).get("reason")
        if reason and reason != self.last_rejection and not first:
            log.warning("supervisor %s: control.json rejected (workers unchanged): %s", self.id, reason)
        self.last_rejection = reason

    def _renew(self) -> None:
        for s in list(self.slots.values()):
            try:
                ok = self.leases.renew(s.slot)
            except OSError as e:
                self._trouble(f"renewing the lease of slot {s.slot} failed", e)
                continue
            if not ok and not s.lease_lost:
                log.warning(
                    "supervisor %s: lost the lease of slot %d; stopping %s", self.id, s.slot, s.worker_id
                )
                s.lease_lost = True
                self._stop(s)

    def _reconcile(self) -> None:
        """One control tick: drain unwanted slots, lease and start wanted ones, give back abandoned leases."""
        try:
            leases = all_leases(self.layout)
        except OSError as e:
            self._trouble("reading the leases", e)
            leases = {}  # no give-back this tick; acquiring reads each lease itself
        now = time.monotonic()
        actions = core.reconcile(
            self.desired, leases, self.slots, now, cooldown=self.cooldown, capacity=self.devices.capacity
        )
        for action in actions:
            if isinstance(action, core.Drain):
                s = self.slots[action.slot]
                log.info("supervisor %s: scaling down: draining %s (slot %d)", self.id, s.worker_id, s.slot)
                self._stop(s)
            elif isinstance(action, core.Acquire):
                if len(self.slots) < self.devices.capacity:
                    self._acquire(action.slot)
            else:
                self._give_back(action.slot, action.holder)

    def _acquire(self, slot: int) -> None:
        try:
            before = self.leases.read(slot)
            acquired = self.leases.try_acquire(slot)
        except OSError as e:
            self._trouble(f"lease of slot {slot}", e)
            return
        if not acquired:
            return
        holder = core.taken_over_from(before, self.id)
        if holder is not None:
            log.warning(
                "supervisor %s: took over slot %d from %s (lease not renewed for %gs)",
                self.id,
                slot,
                holder,
                self.cfg.run.lease_timeout_s,
            )
        local = core.free_device((s.local for s in self.slots.values()), self.devices.capacity)
        self.slots[slot] = s = Slot(slot, local=local, worker_id=worker_id_for(slot))
        self.failed.pop(slot, None)
        self._spawn(s)

    def _give_back(self, slot: int, holder: Any) -> None:
        """Release the stale lease of a slot no longer wanted.

        A supervisor killed while holding slot K >= desired leaves a lease nobody would take over (only wanted slots
        are acquired); any live supervisor takes it over once it has stood still for lease_timeout_s, through the
        same exclusive generation create as a takeover, and gives it back at once.
        """
        try:
            if self.leases.try_acquire(slot):
                self.leases.release(slot)
                log.warning("supervisor %s: gave back abandoned slot %d of %s", self.id, slot, holder)
        except OSError as e:
            self._trouble(f"lease of slot {slot}", e)

    # ------------------------------------------------------------------ worker processes

    def _spawn(self, s: Slot) -> None:
        """Start the slot's worker; when that fails (a full disk for its log, no memory), retry after a backoff."""
        args = [a for k, v in self.overrides.items() for a in (f"--{k}", v)]
        cmd = [
            sys.executable,
            "-P",
            "-m",
            "rollout_worker.worker",
            "--run",
            str(self.layout.root),
            "--slot",
            str(s.slot),
            "--worker-id",
            s.worker_id,
            "--supervisor",
            self.id,
            "--parent-pid",
            str(os.getpid()),
            *args,
        ]
        env = self.devices.env(s.local, dict(os.environ))
        env["PYTHONUNBUFFERED"] = "1"
        header = f"\n=== {time.strftime('%F %T')} {s.worker_id} started by {self.id}\n"
        try:
            # its own session: a terminal's Ctrl-C reaches the supervisor, which drains the workers in order
            s.proc = start_group(cmd, self._log_path(s), env=env, header=header)
        except OSError as e:
            self._trouble(f"starting {s.worker_id} failed", e)
            s.restart_at = time.monotonic() + self.cfg.rollout.restart_backoff_s
            return
        s.restart_at = None
        where = env.get("CUDA_VISIBLE_DEVICES") or f"cpu {env.get('VLLM_CPU_OMP_THREADS_BIND', '')}"
        log.info(
            "supervisor %s: started %s (slot %d, pid %d, %s)", self.id, s.worker_id, s.slot, s.proc.pid, where
        )

    def _log_path(self, s: Slot) -> Path:
        return worker_log(self.layout, s.worker_id)

    def _stop(self, s: Slot, deadline: float | None = None) -> None:
        """Ask a worker to drain (SIGTERM); it is killed at the deadline.  A worker waiting for a restart just goes."""
        tell = core.drain_until(s, time.monotonic(), self.policy, deadline)
        if tell and s.proc is not None and s.proc.poll() is None:
            # the worker alone: it finishes its batch on its engine, then closes it; the group dies at the deadline
            with contextlib.suppress(ProcessLookupError):
                s.proc.send_signal(signal.SIGTERM)

    def _reap(self) -> None:
        now = time.monotonic()
        for s in list(self.slots.values()):
            if s.proc is not None and s.proc.poll() is None:
                if core.kill_due(s, now):
                    log.warning("supervisor %s: %s did not drain in time; killing it", self.id, s.worker_id)
                    signal_group(s.proc, signal.SIGKILL)  # reaped at a later tick: the loop never blocks here
                    s.killed = True
                continue
            if s.proc is not None:
                rc = s.proc.returncode
                signal_group(s.proc, signal.SIGKILL)  # leftovers of its engine, if any
                pid, s.proc, s.killed = s.proc.pid, None, False
                outcome = core.on_exit(s, rc, now, self.policy)
                if not isinstance(outcome, core.Drop):
                    self._on_death(s, pid, rc, outcome)
                    continue
                log.info("supervisor %s: %s exited (%s)", self.id, s.worker_id, rc)
            if s.draining:
                self._drop(s)
            elif core.restart_due(s, now, self.stopping):
                self._respawn(s)

    def _still_held(self, s: Slot) -> bool:
        """Renew the slot's lease now; a lost lease drops the slot (its worker is gone) without releasing it."""
        try:
            if self.leases.renew(s.slot):
                return True
        except OSError as e:
            self._trouble(f"renewing the lease of slot {s.slot} failed", e)
            return False  # cannot tell yet: the next tick asks again
        log.warning(
            "supervisor %s: lost the lease of slot %d; not restarting %s", self.id, s.slot, s.worker_id
        )
        s.lease_lost = True
        self._drop(s)
        return False

    def _respawn(self, s: Slot) -> None:
        if self._still_held(s):
            self._spawn(s)

    def _on_death(self, s: Slot, pid: int, rc: int | None, outcome: core.Exit) -> None:
        if isinstance(outcome, core.Restart) and not outcome.crash:
            log.warning("supervisor %s: %s stopped over its slot's lease", self.id, s.worker_id)
            return
        if rc is not None and rc < 0:
            error = f"killed by {signal.Signals(-rc).name}"
        else:
            error = self._last_error(s, pid) or f"exit code {rc}"
        if isinstance(outcome, core.Fail):
            self._fail(s, error, outcome)
            return
        assert isinstance(outcome, core.Restart)
        log.warning(
            "supervisor %s: %s (pid %d) died with exit code %s: %s; restart in %.1fs",
            self.id,
            s.worker_id,
            pid,
            rc,
            error,
            outcome.delay,
        )

    def _last_error(self, s: Slot, pid: int) -> str | None:
        rec = read_json_or_none(self.layout.worker_status(s.worker_id))
        # the worker's own record of this very process, when it got to write one
        if isinstance(rec, dict) and (rec.get("pid"), rec.get("host"), rec.get("state")) == (
            pid,
            HOST,
            "failed",
        ):
            return str(rec.get("last_error") or "") or None
        return _last_line(self._log_path(s))

    def _fail(self, s: Slot, error: str, outcome: core.Fail) -> None:
        """Give up on this worker: failed in its status record, slot released for another node."""
        why = outcome.why
        log.error(
            "supervisor %s: %s failed (%s): %s; releasing slot %d", self.id, s.worker_id, why, error, s.slot
        )
        rec = read_json_or_none(self.layout.worker_status(s.worker_id))
        keep = {k: v for k, v in (rec or {}).items() if k not in ("host", "pid", "beat", "updated_at", "id")}
        keep.update(slot=s.slot, supervisor=self.id)
        with contextlib.suppress(OSError):
            worker_status(self.layout, s.worker_id, **keep).update(
                state="failed", last_error=error, gave_up=why
            )
        self.failed[s.slot] = error
        self.cooldown[s.slot] = outcome.cooldown_until
        self._drop(s)

    def _drop(self, s: Slot) -> None:
        if not s.lease_lost:
            with contextlib.suppress(OSError):
                self.leases.release(s.slot)
        self.slots.pop(s.slot, None)

    # ------------------------------------------------------------------ status

    def _write_status(self, state: str) -> None:
        workers = {
            str(s.slot): {
                "worker_id": s.worker_id,
                "pid": s.proc.pid if s.proc is not None else None,
                "state": "draining" if s.draining else ("running" if s.proc is not None else "restarting"),
                "restarts": len(s.restarts),
                "device": self.devices.gpu_groups[s.local % len(self.devices.gpu_groups)]
                if self.devices.gpu_groups
                else "cpu",
                **self._feed_of(s),
            }
            for s in self.slots.values()
        }
        try:
            self.status.update(
                state=state,
                slots=sorted(self.slots),
                capacity=self.devices.capacity,
                desired=self.desired,
                workers=workers,
                failed_slots={str(k): v for k, v in self.failed.items()},
                control_generation=self.control_generation,
                last_rejection=self.last_rejection,
                control_problem=self.control_problem,
                last_error=self.last_error,
            )
        except OSError as e:  # e.g. a full disk: the error goes into the next record that can be written
            self._trouble("writing the status record failed", e)

    def _feed_of(self, s: Slot) -> dict[str, Any]:
        """What the trainer's feed needs of this slot's worker, from the record of its current process only (a
        record left by the process before a restart counts for nothing: its batch died with it)."""
        if s.proc is None:
            return {}
        try:
            rec = load_worker(self.layout, s.worker_id)
        except (RecordError, OSError):
            return {}
        if rec is None or (rec.pid, rec.host) != (s.proc.pid, HOST) or rec.state not in LIVE_STATES:
            return {}
        return fleet_fields(rec)

    # ------------------------------------------------------------------ main loop

    def serve(self) -> int:
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        self._watch_control_file()
        r = self.run.config.run
        log.info(
            "supervisor %s: run %s, capacity %d (%s)",
            self.id,
            self.layout.root,
            self.devices.capacity,
            f"GPUs {self.devices.gpu_groups}"
            if self.devices.gpu_groups
            else f"cpu, {self.devices.threads} threads each",
        )
        self._write_status("starting")
        beat_s = renew_interval_s(r.lease_timeout_s, r.heartbeat_interval_s)
        next_control = next_beat = next_feed = 0.0
        try:
            while True:
                now = time.monotonic()
                if self._signals and not self.stopping:
                    self._begin_shutdown("signal received")
                elif self._signals > 1 and self.deadline > now:
                    log.warning("supervisor %s: second signal: killing workers now", self.id)
                    self.deadline = now
                    for s in self.slots.values():
                        s.kill_at = now
                if now >= next_beat:
                    self._renew()
                    next_beat = now + beat_s
                # the node's record, which the trainer's feed reads instead of each worker's
                if now >= next_feed:
                    self._write_status("draining" if self.stopping else "running")
                    next_feed = now + min(beat_s, NODE_FEED_S)
                if not self.stopping and now >= next_control and self._run_finished():
                    self._begin_shutdown("the run is finished")
                if not self.stopping and now >= next_control:
                    self._poll_control()
                    self._reconcile()
                    next_control = now + r.control_poll_s
                self._reap()
                if self.stopping and not self.slots:
                    break
                tick = 0.02 if any(s.killed for s in self.slots.values()) else 0.2  # reap the killed at once
                self._sleep(min(tick, max(0.0, min(next_beat, next_control) - time.monotonic())))
        finally:
            self._kill_all()
            self._write_status("stopped")
            if self._observer is not None:
                with contextlib.suppress(Exception):
                    self._observer.stop()
        log.info("supervisor %s: stopped", self.id)
        return 0

    def _run_finished(self) -> bool:
        """True once the trainer recorded the run finished; a damaged record is reported and read as not finished
        (stopping every worker of the run on a misread would be worse than waiting for a repair)."""
        try:
            return read_finished(self.layout) is not None
        except (RecordError, OSError) as e:
            self._trouble("reading the finished record failed", OSError(str(e)))
            return False

    def _begin_shutdown(self, why: str) -> None:
        """Drain everything: SIGTERM now, SIGKILL a little before the deadline so that cleanup still fits in it."""
        self.stopping = True
        budget = self.cfg.rollout.drain_deadline_s
        self.deadline, kill_at = core.shutdown_times(time.monotonic(), budget)
        log.info(
            "supervisor %s: %s: draining %d worker(s) within %gs",
            self.id,
            why,
            len(self.slots),
            budget,
        )
        for s in self.slots.values():
            self._stop(s, min(kill_at, s.kill_at or math.inf))

    def _kill_all(self) -> None:
        """Last resort and normal end alike: no worker process outlives the supervisor; leases go back."""
        stop_groups([s.proc for s in self.slots.values() if s.proc is not None], 0.0, sig=signal.SIGKILL)
        for s in list(self.slots.values()):
            self._drop(s)


def run_supervisor(run: Run, overrides: dict[str, str]) -> int:
    setup_logging("supervisor")
    return Supervisor(run, overrides).serve()
