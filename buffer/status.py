"""One snapshot of a run's state as a plain dict: what `shardrl status --json` prints and the views draw."""

from __future__ import annotations

from typing import Any

from . import heartbeats, plans, shards, weights
from .control import all_leases, read_state
from .layout import RunLayout


def snapshot(layout: RunLayout) -> dict[str, Any]:
    state = read_state(layout)
    ready = shards.list_ready(layout)
    valid = plans.valid_plans(layout)
    consumed = sum(len(p.sample_ids) + len(p.dropped_ids) for p in valid.values())
    ready_rows = shards.ready_sample_count(ready)
    latest = weights.latest_version(layout)
    trainer = heartbeats.read_trainer(layout)
    workers = [
        {
            "id": w.get("id"),
            "state": w.get("state"),
            "weights_version": w.get("weights_version"),
            "heartbeat_age_s": heartbeats.age_s(w),
            "slot": w.get("slot"),
            "host": w.get("host"),
            "samples": w.get("samples", 0),
            "tokens_per_s": w.get("tokens_per_s"),
            "last_error": w.get("last_error"),
        }
        for w in heartbeats.read_workers(layout)
    ]
    return {
        "run": str(layout.root),
        "desired_workers": state.desired,
        "control": {
            "generation": state.generation,
            "last_applied": state.last_applied,
            "last_rejection": state.last_rejection,
        },
        "workers": workers,
        "supervisors": [
            {k: s.get(k) for k in ("id", "host", "state", "slots", "capacity")}
            | {"heartbeat_age_s": heartbeats.age_s(s)}
            for s in heartbeats.read_supervisors(layout)
        ],
        "leases": {str(k): v.get("holder") for k, v in sorted(all_leases(layout).items())},
        "latest_weights_version": latest,
        "latest_weights_path": str(layout.weight_version(latest)) if latest > 0 else None,
        "trainer": {
            "step": (trainer or {}).get("step", max(valid, default=0)),
            "state": (trainer or {}).get("state", "absent"),
            "published_version": (trainer or {}).get("published_version"),
            "heartbeat_age_s": heartbeats.age_s(trainer) if trainer else None,
        },
        "shards": {
            "ready": len(ready),
            "ready_samples": ready_rows,
            "consumed_samples": consumed,
            "unconsumed_samples": max(0, ready_rows - consumed),
            "quarantined": len(shards.quarantined(layout)),
        },
        "plans": len(valid),
    }
