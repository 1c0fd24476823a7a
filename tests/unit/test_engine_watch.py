"""A worker exits when its *engine's* process dies, and only then: a reward or tool process that dies is one lost
sample (scorepool.py, envs/sandbox.py), not a lost worker.

Real processes and real signals: a child Python process plays the worker, with two ``sleep`` children, one named
the engine's; the test kills the other one, then the engine's.  The watch's polls are events the child prints (each
pid it checks), so the test waits for polls, not for time: under any load it knows the watch has looked at least
twice after the kill, and which processes it looked at.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rollout_worker.lifecycle import EXIT_CRASH

WORKER = textwrap.dedent(
    """
    import subprocess, sys, threading, time
    import rollout_worker.lifecycle as lc
    from rollout_worker.lifecycle import Lifecycle, child_pids

    checked = lc._is_child

    def spy(pid):  # each pid the watch checks, as a line the test reads
        print("poll", pid, flush=True)
        return checked(pid)

    lc._is_child = spy

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


@pytest.mark.proc
def test_only_the_engines_death_ends_the_worker() -> None:
    w = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout is not None
        engine, reward = w.stdout.readline().split()
        subprocess.run(["kill", "-9", reward], check=True)
        polled: list[str] = []
        while len(polled) < 3:  # three polls: at least two after the reward process died
            line = w.stdout.readline().split()
            assert line, f"the worker exited (code {w.wait()}) when a process that is not its engine died"
            if line[0] == "poll":
                polled.append(line[1])
        assert polled == [engine] * 3, f"the watch checked {polled}, not only the engine {engine}"
        assert _alive(w)
        subprocess.run(["kill", "-9", engine], check=True)
        assert w.wait(timeout=60) == EXIT_CRASH
    finally:
        w.kill()
        w.wait()
