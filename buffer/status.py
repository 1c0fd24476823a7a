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
    """Samples of a run, counted from the shard names in the open buckets of ready/ and the consumption log."""

    ready_samples: int  # published and not quarantined: consumed plus unconsumed
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
    """Counts the backlog again and again from the consumption log (``plans.Consumption``: the newest valid summary,
    then each plan once) and the listings of the buckets that may hold unconsumed samples.

    For views and tools; rollout workers read the trainer's record instead (``records.TrainerStatus``)."""

    def __init__(self, layout: RunLayout):
        self.layout = layout
        self._consumption: plans.Consumption | None = None
        self._lister: shards.BucketLister | None = None
        self.listed: list[shards.ShardName] = []  # the ready shards the last ``read`` counted

    def read(self, problems: list[str] | None = None) -> Backlog:
        """The backlog now.  A plan that is not a valid record raises RecordError, or, when ``problems`` is given,
        is reported there and not counted."""
        if self._consumption is None:
            self._consumption = plans.Consumption.load_lenient(
                self.layout, shards.first_bucket(self.layout), problems
            )
            self._lister = shards.BucketLister(self.layout, self._consumption.open_from)
        else:
            self._consumption.catch_up(self.layout, problems)
        c, lister = self._consumption, self._lister
        assert lister is not None
        listed = self.listed = lister.list()
        unconsumed = max(0, sum(s.rows for s in listed) - sum(c.consumed_in(s.name) for s in listed))
        return Backlog(
            c.consumed_samples + unconsumed,
            c.consumed_samples,
            c.dropped_samples,
            unconsumed,
            planned_step=c.step,
        )


def backlog(layout: RunLayout) -> Backlog:
    """The backlog of ``layout`` now (a poller keeps a ``BacklogCounter`` instead)."""
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
    try:
        counter = BacklogCounter(layout)
        counts = counter.read(problems)
        ready = counter.listed
        plan_step = counts.planned_step
    except RecordError as e:  # an epoch claim: fencing, hence the plan counts, cannot be decided
        problems.append(str(e))
        plan_step, counts, ready = 0, None, []
    workers = heartbeats.load_workers(layout)
    supervisors = heartbeats.load_supervisors(layout)
    problems += workers.problems + supervisors.problems
    supervised = _supervised(supervisors.records, settings)
    worker_views = [_worker(w, settings, supervised) for w in workers.records]
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
        "running_workers": sum(w["state"] in _RUNNING for w in worker_views),
        "workers_why": _workers_why(state.desired, worker_views, supervisors.records, settings),
        "reward_failures": _reward_failures(worker_views),
        "workers": worker_views,
        "supervisors": [_supervisor(s) for s in supervisors.records],
        "leases": {str(k): v.get("holder") for k, v in sorted(all_leases(layout).items())},
        **_weights(layout, problems),
        "trainer": _trainer_view(_trainer(layout, problems), plan_step, settings),
        "shards": {
            "ready": len(ready),  # in the buckets that may hold unconsumed samples
            "ready_samples": shards.ready_sample_count(ready),
            "consumed_samples": counts.consumed_samples if counts else None,
            "dropped_samples": counts.dropped_samples if counts else None,
            "unconsumed_samples": counts.unconsumed_samples if counts else None,
            "quarantined": len(shards.quarantined(layout)),
        },
        "plans": plan_step,
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


# Worker states that count as running against the desired count (not starting, not stopped or failed).
_RUNNING = frozenset({"running", "reloading", "paused"})


def _live(s: SupervisorStatus, settings: dict[tuple[str, str], Any]) -> bool:
    return s.state not in ("stopped",) and s.age_s() <= settings["run", "lease_timeout_s"]


def _supervised(
    supervisors: list[SupervisorStatus], settings: dict[tuple[str, str], Any]
) -> dict[str, tuple[str, int]]:
    """worker id -> (state, restarts) as the live supervisors see their workers."""
    return {
        w.worker_id: (w.state, w.restarts)
        for s in supervisors
        if _live(s, settings)
        for w in s.workers.values()
    }


def _workers_why(
    desired: int,
    workers: list[dict[str, Any]],
    supervisors: list[SupervisorStatus],
    settings: dict[tuple[str, str], Any],
) -> str | None:
    """Why fewer workers run than desired, in the terms of what holds them back; None when none are missing."""
    running = sum(w["state"] in _RUNNING for w in workers)
    if running >= desired:
        return None
    live = [s for s in supervisors if _live(s, settings)]
    if not live:
        return "no node supervisor is running (start one per node: python -m rollout_worker --run-dir RUN)"
    failed = {slot: err for s in live for slot, err in s.failed_slots.items()}
    capacity = sum(s.capacity for s in live)
    held = sum(len(s.slots) for s in live)
    reasons = []
    if capacity < desired:
        reasons.append(
            f"no supervisor has a free slot: {len(live)} supervisor(s) hold {capacity} slot(s) in all "
            "(per node: rollout.max_local_workers, else one per GPU, else rollout.cpu_workers); start a supervisor "
            "on another node or lower the desired count"
        )
    if failed:
        slot, err = sorted(failed.items())[0]
        reasons.append(
            f"{len(failed)} slot(s) failed and are left alone for rollout.restart_window_s (slot {slot}: {err})"
        )
    starting = held - running
    if starting > 0:
        reasons.append(f"{starting} worker(s) starting or restarting")
    return "; ".join(reasons) or f"{desired - running} worker(s) not started yet"


def _reward_failures(workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Groups dropped because their reward failed, over every worker, with the first worker's first error."""
    hit = [w for w in workers if w["dropped_reward_groups"]]
    if not hit:
        return None
    return {
        "groups": sum(w["dropped_reward_groups"] for w in hit),
        "samples": sum(w["dropped_reward_samples"] for w in hit),
        "workers": [w["id"] for w in hit],
        "first_error": next((w["first_reward_error"] for w in hit if w["first_reward_error"]), None),
    }


def _worker(
    w: WorkerStatus,
    settings: dict[tuple[str, str], Any],
    supervised: dict[str, tuple[str, int]] | None = None,
) -> dict[str, Any]:
    seen = (supervised or {}).get(w.id)
    # A worker that crashed records `failed` before it exits; while its supervisor restarts it, it is restarting.
    restarting = w.state == "failed" and w.gave_up is None and seen is not None and seen[0] == "restarting"
    return {
        "id": w.id,
        "state": "restarting" if restarting else w.state,
        "restarts": seen[1] if seen else None,
        "dropped_reward_groups": w.dropped_reward_groups,
        "dropped_reward_samples": w.dropped_reward_samples,
        "first_reward_error": w.first_reward_error,
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
        # streaming workers: requests in the engine, its busy share of unpaused time, weights loaded in flight
        "requests_in_flight": w.requests_in_flight,
        "engine_busy": w.engine_busy,
        "reloads_in_flight": w.reloads_in_flight,
        "reward_timeouts": w.reward_timeouts,
        "aborted_stale_samples": w.aborted_stale_samples,
        "episodes": _episodes(w),
    }


def _episodes(w: WorkerStatus) -> dict[str, Any] | None:
    """A multi-turn worker's episodes: turns and tool calls per episode, tool errors and time-outs, truncated."""
    if not w.episodes:
        return None
    return {
        "episodes": w.episodes,
        "turns_per_episode": round(w.model_turns / w.episodes, 2),
        "tool_calls_per_episode": round(w.tool_calls / w.episodes, 2),
        "tool_errors": w.tool_errors,
        "tool_timeouts": w.tool_timeouts,
        "truncated": w.truncated_episodes,
    }


def _paused_why(w: WorkerStatus, settings: dict[tuple[str, str], Any]) -> str:
    """Why a paused worker does not generate, in the terms of the setting that holds it back."""
    if w.paused_reason == "backlog":
        bound = settings["rollout", "max_backlog_samples"]
        return f"backlog: {_n(w.backlog)} unconsumed samples > rollout.max_backlog_samples {_n(bound)}"
    if w.paused_reason == "stale":
        bound = settings["rollout", "max_staleness"]
        return (
            f"stale: serving {version_name(w.weights_version)} (latest {version_name(w.latest_version)}); "
            "counting the versions still to be trained before a new batch is consumed (steps in flight, samples "
            f"queued ahead), it would be more than rollout.max_staleness {_n(bound)} behind"
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
