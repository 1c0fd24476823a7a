"""The run-directory contract under real crashes and races: SIGKILLed writers and publishers, racing supervisors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from buffer import SCHEMA_VERSION, control, shards, weights
from buffer.layout import RunLayout

from ._common import ROOT, shardrl, wait_for


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration._buffer_procs", *args], cwd=ROOT)


def _kill_at_random(
    args: list[str], rounds: int, rng: random.Random, progress: Callable[[], int], most_s: float
) -> None:
    """Start the child ``rounds`` times; each time, once ``progress()`` shows it has published (its interpreter is
    up and inside the write loop), SIGKILL it at a random point up to ``most_s`` later."""
    for _ in range(rounds):
        before = progress()
        p = _spawn(*args)
        wait_for(
            "the child's first publish",
            lambda b=before: progress() > b,
            timeout=60,
            every=0.01,
            alive=lambda p=p: p.poll() is None,
        )
        time.sleep(rng.uniform(0.0, most_s))
        p.send_signal(signal.SIGKILL)
        p.wait()


def test_sigkilled_shard_writer_never_leaves_a_partial_ready_shard(tmp_path):
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    _kill_at_random(
        ["shards", str(layout.root)], 8, random.Random(1), lambda: len(shards.list_ready(layout)), most_s=0.9
    )
    ready = shards.list_ready(layout)
    assert len(ready) >= 8, "the writer should have published shards before being killed"
    for s in ready:  # every visible shard is complete and valid
        shards.read_shard(layout.ready_shard(s.name))
    in_buckets = [n for b in shards.ready_buckets(layout) for n in os.listdir(layout.ready_bucket(b))]
    assert sorted(in_buckets) == sorted(s.name for s in ready)
    # the killed writers' temporaries: fsck finds them, --repair removes them, then fsck is clean
    (layout.run_json).write_text(
        json.dumps({"run_id": "r", "schema_version": SCHEMA_VERSION, "created_at": 0})
    )
    from buffer.config import ShardRLConfig

    cfg = ShardRLConfig.model_validate({"reward": {"function": "max_digit"}})  # every run names its reward
    layout.config_json.write_text(cfg.model_dump_json())
    leftovers = list(layout.shards_tmp.iterdir())
    check = shardrl("fsck", layout.root)
    if leftovers:
        assert check.returncode == 1 and "abandoned temporary" in check.stdout
    rep = shardrl("fsck", layout.root, "--repair")
    assert list(layout.shards_tmp.iterdir()) == []
    again = shardrl("fsck", layout.root)
    assert again.returncode == 0, again.stdout + rep.stdout


def test_killed_publisher_never_makes_latest_point_to_an_incomplete_version(tmp_path):
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    rng = random.Random(2)
    for _ in range(6):
        _kill_at_random(
            ["publish", str(layout.root)], 1, rng, lambda: weights.latest_version(layout), most_s=1.1
        )
        v = weights.read_latest(layout, checksums=True)  # raises if LATEST points at anything incomplete
        if v is not None:
            assert v.version == weights.latest_version(layout)
    assert weights.latest_version(layout) >= 3
    for v in weights.published_versions(layout):
        weights.verify_version(layout, v, checksums=True)


def _echo_slowly(path: Path, text: str) -> None:
    """Like a shell `echo TEXT > control.json`, but with the truncate/write gap widened."""
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])
        f.flush()
        time.sleep(0.02)
        f.write(text[len(text) // 2 :] + "\n")


@pytest.mark.slow
def test_racing_supervisors_apply_each_command_exactly_once(tmp_path):
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    control.init_state(layout, 0)
    seen = [tmp_path / f"sup{i}.seen" for i in range(4)]
    stop = tmp_path / "stop"
    procs = [_spawn("control", str(layout.root), f"sup{i}", str(stop), str(seen[i])) for i in range(4)]
    try:
        _race(layout, seen, stop, procs)
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _race(layout: RunLayout, seen: list[Path], stop: Path, procs: list[subprocess.Popen]) -> None:
    """Send six commands through four polling supervisors; each must be applied once, whoever applies it."""

    def seen_by_all(generation: int) -> bool:
        """Every supervisor has polled and seen at least ``generation`` (each writes what it saw)."""
        return all(s.exists() and int(s.read_text()) >= generation for s in seen)

    def all_alive() -> bool:
        return all(p.poll() is None for p in procs)

    # the bounds are generous because they only decide how long a broken run takes to fail: a command is applied
    # within one poll plus the 0.5 s settle when the machine is idle
    wait_for("every supervisor polling", lambda: seen_by_all(0), timeout=120, every=0.02, alive=all_alive)
    commands = [("add", 2), ("add", 2), ("remove", 1), ("set", 5), ("add", 3), ("remove", 2)]
    expected = 0
    for generation, (action, count) in enumerate(commands, start=1):
        _echo_slowly(layout.control_file, json.dumps({"action": action, "count": count}))
        expected = {"add": expected + count, "remove": expected - count, "set": count}[action]
        wait_for(
            f"desired {expected}",
            lambda e=expected: control.read_state(layout).desired == e,
            120,
            0.05,
            alive=all_alive,
        )
        assert control.read_state(layout).desired == expected
        # every supervisor has seen this command's outcome: from here a second application would show as an extra
        # generation in the count below
        wait_for(
            f"every supervisor at generation {generation}",
            lambda g=generation: seen_by_all(g),
            120,
            0.02,
            alive=all_alive,
        )
    stop.touch()
    for p in procs:
        assert p.wait(timeout=60) == 0
    st = control.read_state(layout)
    assert st.desired == expected == 6
    assert st.generation == len(commands)  # one generation per command: none applied twice
    appliers = {
        json.loads(layout.control_generation(g).read_text())["last_applied"]["by"] for g in range(1, 7)
    }
    assert appliers <= {f"sup{i}" for i in range(4)}
