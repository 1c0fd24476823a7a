"""The helpers every integration test shares: where the repository is, waiting for a condition, the ``shardrl``
command as a user runs it, a free TCP port, and publishing a model directory as a weight version.

The run builders live beside the processes they serve (``_rollout_helpers.make_run`` for rollout runs,
``_trainer_helpers.make_run`` for trainer runs); both build through ``shardrl.runs.init_run``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from buffer import weights
from buffer.layout import RunLayout

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
# One limit for every `shardrl` command a test runs: the slowest (init building a tiny model) takes seconds, so
# reaching it means a hang, reported with the command's output instead of a stuck test run.
CLI_TIMEOUT_S = 300.0


def wait_for(
    what: str,
    fn: Callable[[], T | None],
    timeout: float,
    every: float = 0.2,
    *,
    alive: Callable[[], bool] | None = None,
    detail: Callable[[], str] | None = None,
) -> T:
    """``fn()`` once it is truthy; an AssertionError naming ``what`` after ``timeout`` seconds, or as soon as
    ``alive()`` says the process that should bring it about has ended.  ``detail()`` (e.g. log tails) is appended
    to the message."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        ended = alive is not None and not alive()
        if ended or time.monotonic() > end:
            why = "the process ended" if ended else f"timed out after {timeout:.0f}s"
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"{why} waiting for {what}{extra}")
        time.sleep(every)


def shardrl(
    *args: str | Path,
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
    check: bool = False,
    timeout: float = CLI_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """``shardrl ARGS`` run from ``cwd`` as a separate process, with ``env`` added to this one's environment.

    ``-P`` and PYTHONPATH make the repository's packages the ones imported whatever ``cwd`` holds.  ``check``: an
    AssertionError with the command's output unless it exits 0.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    p = subprocess.run(
        [sys.executable, "-P", "-m", "shardrl.cli", *map(str, args)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"shardrl {' '.join(map(str, args))} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def free_port() -> int:
    """A TCP port nobody listens on right now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def publish_model(layout: RunLayout, model_dir: Path, version: int, step: int) -> None:
    """``model_dir``'s weights (its ``*.safetensors``) and config.json committed as weight ``version`` at ``step``,
    through the trainer's staging -> manifest -> LATEST path."""
    staging = weights.staging_dir(layout, version)
    for f in [*sorted(model_dir.glob("*.safetensors")), model_dir / "config.json"]:
        shutil.copy(f, staging / f.name)
    weights.commit_version(layout, version, staging, step=step, dtype="float32")


@contextlib.contextmanager
def importable(where: Path) -> Iterator[None]:
    """Modules in ``where`` importable here and in the processes started meanwhile (a tool's sandbox, an MCP server):
    on ``sys.path`` and ``PYTHONPATH``, both restored after."""
    before = os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(where))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(where), before) if p)
    try:
        yield
    finally:
        sys.path.remove(str(where))
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
