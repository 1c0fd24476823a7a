"""Reward functions the score-pool tests name as ``tests.unit._scorepool_rewards:NAME``; each child imports them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

SLOW = "slow"  # a response that makes a function hang past any test's time limit


def length(prompt: str, response: str, answer: str | None) -> float:
    """The older form."""
    return float(len(response))


def with_extra(response: str, answer: str | None, *, extra: dict[str, Any], sample: Any) -> float:
    return extra["weight"] * len(response) + len(sample.response_ids) / 10


def pid(response: str, answer: str | None, *, extra: dict[str, Any], sample: Any) -> float:
    """Which process scored the sample."""
    return float(os.getpid())


def raises_on_bad(response: str, answer: str | None, *, extra: dict[str, Any], sample: Any) -> float:
    if response == "bad":
        raise ValueError("no good\nat all")
    return 1.0


def nan_on_bad(response: str, answer: str | None, *, extra: dict[str, Any], sample: Any) -> float:
    return float("nan") if response == "bad" else 1.0


def hangs_on_slow(response: str, answer: str | None, *, extra: dict[str, Any], sample: Any) -> float:
    if response == SLOW:
        time.sleep(60)
    return float(len(response))


def exits_on_die(response: str, answer: str | None, *, extra: dict[str, Any], sample: Any) -> float:
    if response == "die":
        os._exit(1)
    return float(len(response))


def hangs_with_a_child(response: str, answer: str | None, *, extra: dict[str, Any], sample: Any) -> float:
    """On ``slow``: start a process of its own, say its pid in ``extra["pid_file"]``, then hang."""
    if response == SLOW:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open(extra["pid_file"], "w") as f:
            f.write(str(proc.pid))
        time.sleep(60)
    return 1.0


def group_size(
    responses: list[str], answers: list[str | None], *, extras: list[Any], samples: list[Any]
) -> list[float]:
    """Batched: every sample gets the number of responses of the call."""
    return [float(len(responses))] * len(responses)


group_size.shardrl_batched = True  # type: ignore[attr-defined]


def batch_hangs_on_slow(
    responses: list[str], answers: list[str | None], *, extras: list[Any], samples: list[Any]
) -> list[float]:
    if SLOW in responses:
        time.sleep(60)
    return [1.0] * len(responses)


batch_hangs_on_slow.shardrl_batched = True  # type: ignore[attr-defined]
