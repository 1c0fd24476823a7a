"""The hot paths of the shared-storage channel cost the same at step 2,000 as at step 100 (bench/scale.py at small
scale): a run built through the project's own writers, each path counted in a fresh process by strace (or, where
strace is absent, by the bench's instrumented layer).  Counts of file-system calls, never timings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER_CHECK_BOUND = (
    10  # metadata calls (opens, stats, directory reads) of one worker check, whatever the run
)


@pytest.mark.slow
def test_calls_per_check_are_bounded_and_do_not_grow_with_the_run(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--steps", "100", "2000", "--workers", "64"]
    cmd += ["--repeat", "20", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT)  # inside pytest's 900 s
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    small, large = rows["100"], rows["2000"]
    assert large["files"]["shards"] > 15 * small["files"]["shards"]  # the run really is 20 times longer
    assert large["worker_check"]["calls"] <= WORKER_CHECK_BOUND
    for path in ("worker_check", "trainer_poll"):  # the polls: the same calls, to the call
        assert large[path]["calls"] == pytest.approx(small[path]["calls"], abs=0.5), (path, small, large)
    # start-ups list the newest plan bucket, which holds up to 1,000 plans at step 2,000 and 100 at step 100: a few
    # more directory reads, bounded by the bucket's size, whatever the run's length
    for path in ("fresh_worker", "trainer_start"):
        assert large[path]["calls"] <= 1.2 * small[path]["calls"], (path, small, large)
    # the one O(W) cost: the trainer reading each live worker's record once a refresh, whatever the run's length.
    # A refresh lists the buckets that can still change, so a minute's boundary crossed while measuring adds one or
    # two listings to every refresh after it (146.2 against 145.2 in one suite run): up to 2 calls a refresh, the
    # same at any length of run, where reading the run's history would grow with its 20 times as many buckets
    refresh = (small["feed_refresh"], large["feed_refresh"])
    assert large["feed_refresh"]["calls"] == pytest.approx(small["feed_refresh"]["calls"], abs=2.5), refresh
    assert large["feed_refresh"]["calls"] >= 64
    # shardrl audit reads the whole run (its time grows with it), but holds one plan bucket and one shard bucket at
    # a time: its peak memory (tracemalloc's, not the machine's) stays flat from 100 to 2,000 steps
    assert large["audit"]["peak_mib"] <= 1.2 * small["audit"]["peak_mib"], (small["audit"], large["audit"])


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is what the count is checked against")
def test_the_instrumented_count_agrees_with_strace_on_a_worker_check(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import scale  # type: ignore[import-not-found]

    root = scale.build(tmp_path / "run", 60, 4)
    by_strace = scale.measure(root, "worker_check", 20, strace=True)["calls"]
    by_python = scale.measure(root, "worker_check", 20, strace=False)["calls"]
    assert 1 <= by_python <= by_strace <= WORKER_CHECK_BOUND


def test_the_bench_builds_a_run_its_own_fsck_accepts(tmp_path: Path) -> None:
    """The measured run is a valid run: LATEST names a version that exists and verifies, every shard validates."""
    sys.path.insert(0, str(ROOT / "bench"))
    import scale  # type: ignore[import-not-found]

    from buffer.fsck import fsck
    from buffer.run import open_run

    run = open_run(scale.build(tmp_path / "run", 60, 4))
    report = fsck(run.layout, run.config)
    assert report.problems == []
    from buffer.weights import read_latest

    latest = read_latest(run.layout, checksums=True)
    assert latest is not None and latest.version == 60
