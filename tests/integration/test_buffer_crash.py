"""The run-directory contract under real crashes and races: SIGKILLed writers and publishers, racing supervisors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffer import SCHEMA_VERSION, control, shards, weights
from buffer.layout import RunLayout

ROOT = Path(__file__).resolve().parents[2]


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration._buffer_procs", *args], cwd=ROOT)


def _kill_at_random(args: list[str], rounds: int, rng: random.Random) -> None:
    for _ in range(rounds):
        p = _spawn(*args)
        time.sleep(rng.uniform(0.3, 1.2))  # interpreter start + a random point inside the write loop
        p.send_signal(signal.SIGKILL)
        p.wait()


def test_sigkilled_shard_writer_never_leaves_a_partial_ready_shard(tmp_path):
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    _kill_at_random(["shards", str(layout.root)], rounds=8, rng=random.Random(1))
    ready = shards.list_ready(layout)
    assert len(ready) >= 8, "the writer should have published shards before being killed"
    for s in ready:  # every visible shard is complete and valid
        shards.read_shard(layout.ready_shard(s.name))
    in_buckets = [n for b in shards.ready_buckets(layout) for n in os.listdir(layout.ready_bucket(b))]
    assert sorted(in_buckets) == sorted(s.name for s in ready)
    # the killed writers' temporaries: fsck finds them, --repair removes them, then fsck is clean
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (layout.run_json).write_text(
        json.dumps({"run_id": "r", "schema_version": SCHEMA_VERSION, "created_at": 0})
    )
    from buffer.config import ShardRLConfig

    cfg = ShardRLConfig.model_validate({"reward": {"function": "max_digit"}})  # every run names its reward
    layout.config_json.write_text(cfg.model_dump_json())
    leftovers = list(layout.shards_tmp.iterdir())
    check = subprocess.run(
        [sys.executable, "-m", "shardrl.cli", "fsck", str(layout.root)],
        env=env,
        capture_output=True,
        text=True,
    )
    if leftovers:
        assert check.returncode == 1 and "abandoned temporary" in check.stdout
    rep = subprocess.run(
        [sys.executable, "-m", "shardrl.cli", "fsck", str(layout.root), "--repair"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert list(layout.shards_tmp.iterdir()) == []
    again = subprocess.run(
        [sys.executable, "-m", "shardrl.cli", "fsck", str(layout.root)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stdout + rep.stdout


def test_killed_publisher_never_makes_latest_point_to_an_incomplete_version(tmp_path):
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    rng = random.Random(2)
    for _ in range(6):
        p = _spawn("publish", str(layout.root))
        time.sleep(rng.uniform(0.4, 1.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
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
    procs = [_spawn("control", str(layout.root), f"sup{i}", "12") for i in range(4)]
    time.sleep(1.5)  # interpreters up and polling
    commands = [("add", 2), ("add", 2), ("remove", 1), ("set", 5), ("add", 3), ("remove", 2)]
    expected = 0
    for action, count in commands:
        _echo_slowly(layout.control_file, json.dumps({"action": action, "count": count}))
        expected = {"add": expected + count, "remove": expected - count, "set": count}[action]
        deadline = time.monotonic() + 5
        while control.read_state(layout).desired != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert control.read_state(layout).desired == expected
        time.sleep(0.3)  # let every supervisor see it (a second application would show up here)
    for p in procs:
        p.wait(timeout=20)
    st = control.read_state(layout)
    assert st.desired == expected == 6
    assert st.generation == len(commands)  # one generation per command: none applied twice
    appliers = {
        json.loads(layout.control_generation(g).read_text())["last_applied"]["by"] for g in range(1, 7)
    }
    assert appliers <= {f"sup{i}" for i in range(4)}
