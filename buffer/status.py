"""The state of a run as seen from outside: the sample backlog, and one snapshot of everything.

``backlog(layout)`` (or a ``BacklogCounter`` kept across polls) is the one count of ready, consumed, dropped and
unconsumed samples: `shardrl status`, the demo, the trainer's status record and the workers' backpressure all use it.
``snapshot(layout)`` is what `shardrl status --json` prints and the views draw; a record that cannot be read is listed
under ``problems`` instead of stopping the view.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import heartbeats, metrics, plans, shards, weights
from .control import CONTROL_MAX_BYTES, all_leases, command_key, read_state
from .fsio import HOST, FileRefused, read_capped_stat, read_json_or_none
from .layout import RunLayout
from .records import (
    RecordError,
    RunFinished,
    SupervisorStatus,
    TrainerStatus,
    WorkerStatus,
    create_record,
    read_record,
)


@dataclass(frozen=True)
class Backlog:
    """Samples of a run, counted from the shard names in ready/ and the valid plans."""

    ready_samples: int  # rows of the shards in shards/ready (quarantined shards are not there)
    consumed_samples: int  # in a valid plan: trained, or dropped as too stale
    dropped_samples: int  # the part of consumed_samples that was dropped as too stale
    unconsumed_samples: int  # ready and not consumed: what the trainer can still use
    # The highest step with a valid plan: a trainer plans the step it computes and, meanwhile, the next one, so
    # steps up to here will publish weights before samples that are not yet in a plan are used.  Not a count of
    # samples: neither compared nor reported with them.
    planned_step: int = field(default=0, compare=False)

    def as_counts(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "planned_step"}


class BacklogCounter:
    """Counts the backlog again and again, reading each plan file once (plans never change once written).

    A poll costs a listing of shards/ready, plans/ and plans/epochs plus the plans written since the last poll.
    """

    def __init__(self, layout: RunLayout):
        self.layout = layout
        self._plan_counts: dict[Path, tuple[int, int]] = {}  # plan file -> (consumed, dropped)

    def read(self, problems: list[str] | None = None) -> Backlog:
        """The backlog now.  A plan that is not a valid record raises RecordError, or, when ``problems`` is given,
        is reported there and not counted."""
        ready = shards.ready_sample_count(shards.list_ready(self.layout))
        consumed = dropped = 0
        files = plans.valid_plan_files(self.layout)
        for f in files.values():
            counts = self._plan_counts.get(f.path)
            if counts is None:
                try:
                    plan = plans.read_plan(f)
                except RecordError as e:
                    if problems is None:
                        raise
                    problems.append(str(e))
                    continue
                counts = self._plan_counts[f.path] = (
                    len(plan.sample_ids) + len(plan.dropped_ids),
                    len(plan.dropped_ids),
                )
            consumed += counts[0]
            dropped += counts[1]
        # max(): a shard quarantined after it was consumed (fsck --repair) leaves ready below consumed
        return Backlog(ready, consumed, dropped, max(0, ready - consumed), planned_step=max(files, default=0))


def backlog(layout: RunLayout) -> Backlog:
    """The backlog of ``layout`` now (reads every plan; a poller keeps a ``BacklogCounter`` instead)."""
    return BacklogCounter(layout).read()


def read_finished(layout: RunLayout) -> RunFinished | None:
    """The run's finished record; None while the run goes on; RecordError when the file is not a valid record."""
    try:
        return read_record(RunFinished, layout.finished, attempts=2)
    except FileNotFoundError:
        return None


def mark_finished(
    layout: RunLayout, step: int, total_steps: int, published_version: int, epoch: int | None
) -> bool:
    """Record that the run trained its whole budget; written once (the first writer wins), True when this call did."""
    record = RunFinished(
        step=step,
        total_steps=total_steps,
        published_version=published_version,
        epoch=epoch,
        host=HOST,
        pid=os.getpid(),
        at=time.time(),
    )
    return create_record(layout.finished, record)


# Config values the view explains with, when config.json cannot be read (the config models' defaults).
_DEFAULTS = {
    ("run", "lease_timeout_s"): 30.0,
    ("trainer", "poll_interval_s"): 0.5,
    ("trainer", "total_steps"): None,
    ("rollout", "max_backlog_samples"): None,
    ("rollout", "max_staleness"): None,
}
STALE_POLLS = (
    5  # a trainer status older than this many poll intervals (and the lease timeout) is called stale
)


def _settings(layout: RunLayout) -> dict[tuple[str, str], Any]:
    """The few config values the snapshot explains with, read leniently (status shows any run, even one whose
    config this shardrl would refuse)."""
    cfg = read_json_or_none(layout.config_json)
    out = dict(_DEFAULTS)
    for section, key in _DEFAULTS:
        value = (
            cfg.get(section, {}).get(key)
            if isinstance(cfg, dict) and isinstance(cfg.get(section), dict)
            else None
        )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[section, key] = value
    return out


def snapshot(layout: RunLayout) -> dict[str, Any]:
    """Everything `shardrl status` shows, as JSON-ready values; unreadable records are listed under ``problems``."""
    problems: list[str] = []
    settings = _settings(layout)
    state = read_state(layout)
    control_problem = getattr(state, "problem", None)  # set while the newest control generation is unreadable
    if control_problem is not None:
        problems.append(str(control_problem))
    ready = shards.list_ready(layout)
    try:
        plan_steps = sorted(plans.valid_plan_files(layout))
        counts = BacklogCounter(layout).read(problems)
    except RecordError as e:  # an epoch claim: fencing, hence the plan counts, cannot be decided
        problems.append(str(e))
        plan_steps, counts = [], None
    workers = heartbeats.load_workers(layout)
    supervisors = heartbeats.load_supervisors(layout)
    problems += workers.problems + supervisors.problems
    return {
        "run": str(layout.root),
        "finished": _finished(layout, problems),
        "desired_workers": state.desired,
        "control": {
            "generation": state.generation,
            "last_applied": state.last_applied,
            "last_rejection": state.last_rejection,
            "pending": _pending_command(layout, state.history),
        },
        "workers": [_worker(w, settings) for w in workers.records],
        "supervisors": [_supervisor(s) for s in supervisors.records],
        "leases": {str(k): v.get("holder") for k, v in sorted(all_leases(layout).items())},
        **_weights(layout, problems),
        "trainer": _trainer_view(_trainer(layout, problems), max(plan_steps, default=0), settings),
        "shards": {
            "ready": len(ready),
            "ready_samples": shards.ready_sample_count(ready),
            "consumed_samples": counts.consumed_samples if counts else None,
            "dropped_samples": counts.dropped_samples if counts else None,
            "unconsumed_samples": counts.unconsumed_samples if counts else None,
            "quarantined": len(shards.quarantined(layout)),
        },
        "plans": len(plan_steps),
        "eval": metrics.last(layout.metrics_file("eval")),  # the evaluator's latest score, None before one
        "problems": problems,
    }


def _finished(layout: RunLayout, problems: list[str]) -> dict[str, Any] | None:
    try:
        rec = read_finished(layout)
    except (RecordError, OSError) as e:
        problems.append(str(e))
        return None
    return None if rec is None else rec.to_json()


def _pending_command(layout: RunLayout, history: list[str]) -> dict[str, Any] | None:
    """control.json when no supervisor has applied (or rejected) it yet: its text and age."""
    try:
        raw, st = read_capped_stat(layout.control_file, CONTROL_MAX_BYTES)
    except (OSError, FileRefused):  # none, or one a supervisor will reject (and the rejection is shown then)
        return None
    if command_key(raw, st) in history:
        return None
    return {
        "text": " ".join(raw.decode(errors="replace").split())[:200],
        "age_s": max(0.0, time.time() - st.st_mtime),
    }


def _supervisor(s: SupervisorStatus) -> dict[str, Any]:
    return {
        "id": s.id,
        "host": s.host,
        "state": s.state,
        "slots": s.slots,
        "capacity": s.capacity,
        "workers": len(s.workers),
        "heartbeat_age_s": s.age_s(),
        "last_error": s.last_error or s.control_problem,
    }


def _worker(w: WorkerStatus, settings: dict[tuple[str, str], Any]) -> dict[str, Any]:
    return {
        "id": w.id,
        "state": w.state,
        "weights_version": w.weights_version,
        "latest_version": w.latest_version,
        "heartbeat_age_s": w.age_s(),
        "slot": w.slot,
        "host": w.host,
        "samples": w.samples,
        "tokens_per_s": w.tokens_per_s,
        "paused_reason": w.paused_reason if w.state == "paused" else None,
        "paused_why": _paused_why(w, settings) if w.state == "paused" else None,
        "last_error": w.last_error,
    }


def _paused_why(w: WorkerStatus, settings: dict[tuple[str, str], Any]) -> str:
    """Why a paused worker does not generate, in the terms of the setting that holds it back."""
    if w.paused_reason == "backlog":
        bound = settings["rollout", "max_backlog_samples"]
        return f"backlog: {_n(w.backlog)} unconsumed samples > rollout.max_backlog_samples {_n(bound)}"
    if w.paused_reason == "stale":
        bound = settings["rollout", "max_staleness"]
        return (
            f"stale: weights {version_name(w.weights_version)} behind latest {version_name(w.latest_version)} "
            f"by more than rollout.max_staleness {_n(bound)}"
        )
    return "paused"


def _trainer_view(
    trainer: TrainerStatus | None, plan_step: int, settings: dict[tuple[str, str], Any]
) -> dict[str, Any]:
    """The trainer's record, with its staleness judged: no update for a few poll intervals (and the lease
    timeout) while it says it runs."""
    stale_after = max(
        settings["run", "lease_timeout_s"], STALE_POLLS * settings["trainer", "poll_interval_s"]
    )
    age = trainer.age_s() if trainer else None
    return {
        "step": trainer.step if trainer else plan_step,
        "total_steps": settings["trainer", "total_steps"],
        "state": trainer.state if trainer else "absent",
        "published_version": trainer.published_version if trainer else None,
        "publishing": trainer.publishing if trainer else None,
        "heartbeat_age_s": age,
        "stale_after_s": stale_after,
        "heartbeat_stale": bool(
            trainer and trainer.state != "stopped" and age is not None and age > stale_after
        ),
        "waiting": trainer.waiting if trainer else None,
        "last_error": trainer.last_error if trainer else None,
    }


def version_name(version: int | None) -> str:
    """How a weight version is shown: ``v3``; ``base`` for the base model (0); ``-`` for none loaded yet."""
    if version is None:
        return "-"
    return "base" if version == 0 else f"v{version}"


def _n(value: Any) -> str:
    return "?" if value is None else str(value)


def _trainer(layout: RunLayout, problems: list[str]) -> TrainerStatus | None:
    try:
        return heartbeats.load_trainer(layout)
    except (RecordError, OSError) as e:
        problems.append(str(e))
        return None


def _weights(layout: RunLayout, problems: list[str]) -> dict[str, Any]:
    try:
        latest = weights.latest_version(layout)
    except (RecordError, OSError) as e:
        problems.append(str(e))
        latest = None
    return {
        "latest_weights_version": latest,
        "latest_weights_path": str(layout.weight_version(latest)) if latest else None,
    }
