"""What a unit test is: no process of its own (enforced here) and a few seconds on two cores (reported here).

A unit test that starts a process (``subprocess``, ``multiprocessing``, ``os.fork``) fails unless it is marked
``proc``: the ones that must (a reward pool's processes, a watchdog's target) say so, and the rest stay cheap to run
anywhere. The 5 s budget is reported, not asserted: a test's time depends on the machine's load, and an assertion on
it would fail a loaded CI run for nothing. ``make test`` prints every unit test over the budget at the end
(``tests/conftest.py``).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


class StartedAProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _no_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.node.get_closest_marker("proc") is not None:
        yield
        return

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise StartedAProcess(f"{request.node.nodeid} starts a process: mark it @pytest.mark.proc")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    yield
