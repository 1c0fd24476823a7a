"""Tools the environment tests call: stdlib only, because each call imports this module in a fresh child process
under a memory limit."""

from __future__ import annotations

import os
import sys
import time


def lookup(key: str) -> str:
    """The value stored under a key.

    Args:
        key: which entry to read
    """
    return {"alpha": "7", "beta": "3"}.get(key, "missing")


def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


def hang(seconds: float = 60.0) -> str:
    """Never answers in time."""
    time.sleep(seconds)
    return "late"


def boom() -> str:
    """Always raises."""
    raise ValueError("the tool failed on purpose")


def flood() -> str:
    """Prints and returns megabytes."""
    sys.stdout.write("p" * 5_000_000)
    os.write(1, b"q" * 1_000_000)
    return "r" * 5_000_000


def hog() -> int:
    """Allocates far beyond the tool memory limit."""
    return len(bytearray(8 << 30))


def vanish() -> str:
    """Kills its own interpreter."""
    os._exit(7)
