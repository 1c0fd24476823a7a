"""A worker exits when its *engine's* process dies, and only then: a reward or tool process that dies is one lost
sample (scorepool.py, envs/sandbox.py), not a lost worker.

Real processes and real signals: a child Python process plays the worker, with two ``sleep`` children, one named
the engine's; the test kills the other one, then the engine's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from rollout_worker.lifecycle import EXIT_CRASH

WORKER = textwrap.dedent(
    """
    import subprocess, sys, threading, time
    from rollout_worker.lifecycle import Lifecycle, child_pids

    before = child_pids()
    engine = subprocess.Popen(["sleep", "600"])
    engine_pids = child_pids() - before
    reward = subprocess.Popen(["sleep", "600"])  # started after the engine, as the reward processes are
    life = Lifecycle("w0", threading.RLock())
    life.phase = "running"
    assert engine_pids == {engine.pid}, engine_pids
    life.watch_engine(engine_pids)
    print(engine.pid, reward.pid, flush=True)
    time.sleep(600)
    """
)


def _alive(p: subprocess.Popen) -> bool:
    return p.poll() is None


def test_only_the_engines_death_ends_the_worker() -> None:
    w = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout is not None
        engine, reward = w.stdout.readline().split()
        subprocess.run(["kill", "-9", reward], check=True)
        time.sleep(8.0)  # the watch polls each second and gives the main thread 5 s to report first
        assert _alive(w), "the worker exited when a process that is not its engine died"
        subprocess.run(["kill", "-9", engine], check=True)
        assert w.wait(timeout=30) == EXIT_CRASH
    finally:
        w.kill()
        w.wait()
