"""The helpers every integration test shares: where the repository is, waiting for a condition, a log's tail.

The run builders live beside the processes they serve (``_rollout_helpers.make_run`` for rollout runs,
``_trainer_helpers.make_run`` for trainer runs); both build through ``shardrl.runs.init_run``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_for(what: str, fn: Callable[[], T | None], timeout: float, every: float = 0.2) -> T:
    """``fn()`` once it is truthy; an AssertionError naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)
