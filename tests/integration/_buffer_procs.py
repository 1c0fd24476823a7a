"""Child processes for the buffer crash tests: run as ``python -m tests.integration._buffer_procs MODE RUN ...``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from buffer import control, shards, weights
from buffer.layout import RunLayout


def write_shards_forever(layout: RunLayout) -> None:
    """Publish shards of varying size as fast as possible until killed."""
    w = shards.ShardWriter(layout, "run", "writer")
    i = 0
    while True:
        for j in range(50 + (i * 37) % 400):
            n = 1 + (j % 7)
            w.add(
                {
                    "group_id": f"g{i}",
                    "prompt_ids": list(range(1, 200)),
                    "response_ids": [j % 50] * n,
                    "response_logprobs": [-0.25] * n,
                    "reward": 1.0,
                    "policy_version": 0,
                    "finish_reason": "stop",
                }
            )
        w.flush()
        i += 1


def publish_forever(layout: RunLayout) -> None:
    """Publish weight versions of a few MiB each until killed."""
    # as the trainer does (``starting_version``): a version renamed in place before a kill, but never pointed at by
    # LATEST, keeps its number
    v = max([weights.latest_version(layout), *weights.published_versions(layout)]) + 1
    while True:
        st = weights.staging_dir(layout, v)
        for k in range(3):
            (st / f"model-{k}.safetensors").write_bytes(bytes([v % 251]) * (2 << 20))
        (st / "config.json").write_text("{}")
        weights.commit_version(layout, v, st, step=v, dtype="float32")
        v += 1


def supervisor_control_loop(layout: RunLayout, who: str, stop: Path, seen: Path) -> None:
    """Stand-in for a node supervisor's control polling (the real supervisor uses the same watcher).

    After each poll whose control generation differs from the last, the generation is written to ``seen`` (tmp ->
    rename), so the test knows when this supervisor is polling and when it has seen a command's outcome.  It polls
    until the test creates ``stop``: a fixed lifetime would end the race early on a loaded machine, where starting
    four interpreters alone can take most of it.  The hour is only a bound on an orphan.
    """
    w = control.ControlWatcher(layout, max_workers=64, settle_s=0.5, who=who)
    end, reported = time.monotonic() + 3600, None
    while time.monotonic() < end and not stop.exists():
        generation = w.poll().generation
        if generation != reported:
            tmp = seen.with_name(f".tmp.{seen.name}")
            tmp.write_text(f"{generation}\n")
            os.replace(tmp, seen)
            reported = generation
        time.sleep(0.005)


if __name__ == "__main__":
    mode, run = sys.argv[1], RunLayout.of(sys.argv[2])
    if mode == "shards":
        write_shards_forever(run)
    elif mode == "publish":
        publish_forever(run)
    elif mode == "control":
        supervisor_control_loop(run, sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))
    else:
        raise SystemExit(f"unknown mode {mode}")
