"""The state of a run as seen from outside: the sample backlog, and one snapshot of everything.

``backlog(layout)`` (or a ``BacklogCounter`` kept across polls) is the one count of ready, consumed, dropped and
unconsumed samples: `shardrl status`, the demo, the trainer's status record and the workers' backpressure all use it.
``snapshot(layout)`` is what `shardrl status --json` prints and the views draw; a record that cannot be read is listed
under ``problems`` instead of stopping the view.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import heartbeats, plans, shards, weights
from .control import all_leases, read_state
from .fsio import HOST
from .layout import RunLayout
from .records import RecordError, RunFinished, TrainerStatus, WorkerStatus, create_record, read_record


@dataclass(frozen=True)
class Backlog:
    """Samples of a run, counted from the shard names in ready/ and the valid plans."""

    ready_samples: int  # rows of the shards in shards/ready (quarantined shards are not there)
    consumed_samples: int  # in a valid plan: trained, or dropped as too stale
    dropped_samples: int  # the part of consumed_samples that was dropped as too stale
    unconsumed_samples: int  # ready and not consumed: what the trainer can still use

    def as_counts(self) -> dict[str, int]:
        return asdict(self)


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
        for f in plans.valid_plan_files(self.layout).values():
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
        return Backlog(ready, consumed, dropped, max(0, ready - consumed))


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


def snapshot(layout: RunLayout) -> dict[str, Any]:
    problems: list[str] = []
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
    trainer = _trainer(layout, problems)
    workers = heartbeats.load_workers(layout)
    supervisors = heartbeats.load_supervisors(layout)
    problems += workers.problems + supervisors.problems
    return {
        "run": str(layout.root),
        "desired_workers": state.desired,
        "control": {
            "generation": state.generation,
            "last_applied": state.last_applied,
            "last_rejection": state.last_rejection,
        },
        "workers": [_worker(w) for w in workers.records],
        "supervisors": [
            {
                "id": s.id,
                "host": s.host,
                "state": s.state,
                "slots": s.slots,
                "capacity": s.capacity,
                "heartbeat_age_s": s.age_s(),
            }
            for s in supervisors.records
        ],
        "leases": {str(k): v.get("holder") for k, v in sorted(all_leases(layout).items())},
        **_weights(layout, problems),
        "trainer": {
            "step": trainer.step if trainer else max(plan_steps, default=0),
            "state": trainer.state if trainer else "absent",
            "published_version": trainer.published_version if trainer else None,
            "heartbeat_age_s": trainer.age_s() if trainer else None,
        },
        "shards": {
            "ready": len(ready),
            "ready_samples": shards.ready_sample_count(ready),
            "consumed_samples": counts.consumed_samples if counts else None,
            "dropped_samples": counts.dropped_samples if counts else None,
            "unconsumed_samples": counts.unconsumed_samples if counts else None,
            "quarantined": len(shards.quarantined(layout)),
        },
        "plans": len(plan_steps),
        "problems": problems,
    }


def _worker(w: WorkerStatus) -> dict[str, Any]:
    return {
        "id": w.id,
        "state": w.state,
        "weights_version": w.weights_version,
        "heartbeat_age_s": w.age_s(),
        "slot": w.slot,
        "host": w.host,
        "samples": w.samples,
        "tokens_per_s": w.tokens_per_s,
        "last_error": w.last_error,
    }


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
