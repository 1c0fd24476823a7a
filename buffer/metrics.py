"""Metrics files (``RUN/metrics/*.jsonl``): append a record, read them all, read the last few; and the sinks behind
one ``log(metrics, step)`` interface (JSONL always; TensorBoard and Weights & Biases when asked for and installed).

Each metrics file has one writer (the trainer's rank 0, one rollout worker, the evaluator).  A record is one
line written by one ``write`` on an O_APPEND descriptor, so a reader sees whole lines plus at most one line still
being written; readers skip a line that does not parse.  A writer killed mid-line leaves a torn line behind: the next
append starts a new line, so only the torn record is lost.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .logs import logger

if TYPE_CHECKING:
    from .run import Run

log = logger("metrics")

TAIL_BLOCK = 1 << 16


def append(path: Path, record: Mapping[str, Any]) -> None:
    """Append ``record`` as one JSON line (creating the file and its directory)."""
    line = (json.dumps(dict(record)) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # the previous writer died mid-line
        os.write(fd, line)
    finally:
        os.close(fd)


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None  # a line being written, or torn by a crash
    return rec if isinstance(rec, dict) else None


def read_all(path: Path) -> list[dict[str, Any]]:
    """Every complete record of ``path``, in order; [] when it does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [rec for line in data.split(b"\n") if (rec := _parse(line)) is not None]


def tail(path: Path, n: int, block: int = TAIL_BLOCK) -> list[dict[str, Any]]:
    """The last ``n`` complete records of ``path``, in order, reading backwards from the end only as far as needed
    (live views poll this; the file grows with the run)."""
    if n <= 0:
        return []
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return []
    newest_first: list[dict[str, Any]] = []
    try:
        pos, carry = os.fstat(fd).st_size, b""
        while pos > 0 and len(newest_first) < n:
            start = max(0, pos - block)
            lines = (os.pread(fd, pos - start, start) + carry).split(b"\n")
            pos = start
            # the first piece may continue further back: keep it for the next block
            carry, complete = (lines[0], lines[1:]) if pos > 0 else (b"", lines)
            for line in reversed(complete):
                if (rec := _parse(line)) is not None:
                    newest_first.append(rec)
                    if len(newest_first) == n:
                        break
    finally:
        os.close(fd)
    return newest_first[::-1]


def one_per_step(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One record per ``step``, the last one written, in step order (records without a step are left out).

    A trainer that resumes from a checkpoint replays the steps after it and logs them again; the replay is what its
    weights carry, so its record replaces the earlier one."""
    by_step: dict[int, dict[str, Any]] = {}
    for rec in records:
        step = rec.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            by_step[step] = dict(rec)
    return [by_step[k] for k in sorted(by_step)]


def last(path: Path) -> dict[str, Any] | None:
    """The last complete record of ``path``; None when it has none."""
    recs = tail(path, 1)
    return recs[0] if recs else None


# ---------------------------------------------------------------------------------------------- sinks


class Sink(Protocol):
    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``{"step": step, "time": wall clock, **metrics}`` per line."""

    def __init__(self, path: Path):
        self.path = path

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        append(self.path, {"step": step, "time": time.time(), **metrics})

    def close(self) -> None:
        pass


class TensorBoardSink:
    """The numeric metrics as TensorBoard scalars."""

    def __init__(self, writer: Any):
        self.writer = writer

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for k, v in metrics.items():
            if isinstance(v, int | float):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


def tensorboard_sink(log_dir: Path) -> TensorBoardSink | None:
    """A TensorBoard sink writing into ``log_dir``, or None (and one log line) when TensorBoard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        log.info("metrics: TensorBoard sink off (%s; `pip install tensorboard` turns it on)", e)
        return None
    return TensorBoardSink(SummaryWriter(str(log_dir)))


@dataclass(frozen=True)
class WandbTarget:
    """Where one process logs in W&B.  Every process of a run (trainer, each worker, the evaluator, started by
    separate jobs) is its own W&B run in the group ``group`` (the run id), so they land together; ``name`` tells
    them apart and also makes the W&B run id, so a restarted process continues its own W&B run."""

    project: str
    group: str
    name: str
    dir: Path
    config: Mapping[str, Any] = field(default_factory=dict)
    # Steps at or below this were logged already (by an earlier incarnation of the trainer): W&B cannot replace a
    # row, so a replayed step is not logged twice.
    logged_through: int = 0


class WandbSink:
    """The numeric metrics of each record, plotted against ``step`` (trainer step, or the worker's own count)."""

    def __init__(self, run: Any, logged_through: int = 0):
        self.run = run
        self.logged_through = logged_through
        run.define_metric("step")
        run.define_metric("*", step_metric="step")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if step <= self.logged_through:
            return
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        # no step= argument: W&B refuses a step below one it has seen, and a restarted process may repeat steps
        self.run.log({**numbers, "step": step})

    def close(self) -> None:
        self.run.finish()


def wandb_target(run: Run, name: str) -> WandbTarget | None:
    """Process ``name``'s W&B target when the run asks for W&B (``run.wandb``), else None."""
    if not run.config.run.wandb:
        return None
    logged = 0
    if name == "trainer":  # trainer steps count across incarnations; a worker's own count restarts with it
        logged = max(
            (int(r["step"]) for r in one_per_step(read_all(run.layout.metrics_file(name)))), default=0
        )
    return WandbTarget(
        project=run.config.run.wandb_project,
        group=run.run_id,
        name=name,
        dir=run.layout.logs,
        config=run.config.model_dump(mode="json"),
        logged_through=logged,
    )


def wandb_sink(target: WandbTarget) -> WandbSink | None:
    """A W&B sink for ``target``, or None (and one log line) when wandb is not installed."""
    try:
        import wandb
    except ImportError as e:
        log.info("metrics: W&B sink off (%s; `pip install shardrl[wandb]` turns it on)", e)
        return None
    target.dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=target.project,
        group=target.group,
        name=f"{target.group}-{target.name}",
        id=f"{target.group}-{target.name}",
        job_type=target.name.split("-")[0],
        dir=str(target.dir),
        config=dict(target.config),
        resume="allow",
    )
    return WandbSink(run, target.logged_through)


class Sinks:
    """Several sinks behind the one ``log(metrics, step)``."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks = list(sinks)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for s in self.sinks:
            s.log(metrics, step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_sinks(jsonl: Path, tensorboard_dir: Path | None = None, wandb: WandbTarget | None = None) -> Sinks:
    """JSONL into ``jsonl``; TensorBoard too when ``tensorboard_dir`` is given and TensorBoard is installed; W&B
    too when ``wandb`` is given and wandb is installed."""
    sinks: list[Sink] = [JsonlSink(jsonl)]
    if tensorboard_dir is None:
        log.info("metrics: TensorBoard sink off (not asked for)")
    elif (tb := tensorboard_sink(tensorboard_dir)) is not None:
        sinks.append(tb)
    if wandb is not None and (wb := wandb_sink(wandb)) is not None:
        sinks.append(wb)
    return Sinks(sinks)


def wandb_sinks(run: Run, name: str) -> Sinks:
    """Process ``name``'s W&B sink when the run asks for W&B and wandb is installed; no sink otherwise (for a
    process that writes its JSONL records itself)."""
    target = wandb_target(run, name)
    sink = wandb_sink(target) if target is not None else None
    return Sinks([sink] if sink is not None else [])
