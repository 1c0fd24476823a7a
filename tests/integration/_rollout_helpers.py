"""Shared pieces of the rollout worker and supervisor tests: runs, processes, shards, reference logprobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa

from buffer import heartbeats, procs, shards
from buffer.config import ShardRLConfig
from buffer.run import Run
from shardrl.runs import init_run

from ._common import ROOT, wait_for

__all__ = ["ROOT", "wait_for"]

T = TypeVar("T")


def make_run(root: Path, model_dir: Path, **sections: dict[str, Any]) -> Run:
    """A run on ``model_dir`` (the digit task's reward unless given) whose config is the defaults updated section by
    section (one level deep)."""
    data: dict[str, Any] = {"model": {"path": str(model_dir)}, "reward": {"function": "max_digit"}}
    for name, values in sections.items():
        sub = dict(values)
        for k, v in list(sub.items()):
            if isinstance(v, dict):
                sub[k] = dict(v)
        data.setdefault(name, {}).update(sub)
    return init_run(root, ShardRLConfig.model_validate(data))


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A rollout process (``python -m ...``) from the repository root in its own process group, output in ``log``.

    The repository root is on PYTHONPATH, so that workers (started in safe-path mode) can import the tests' reward
    functions, as a user's own reward module must be importable on the rollout nodes.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return procs.start_group(
        [sys.executable, "-m", *args],
        log,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})},
    )


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, which only awaits its parent's wait(), counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the direct children of ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append((int(d.name), cmd))
    return out


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """Stop a test's process if it still runs (SIGTERM to it, SIGKILL to its group at the deadline).

    Only the leader gets the SIGTERM, as from a person's ``kill``: a supervisor drains its workers itself.
    """
    return procs.stop_groups([proc], timeout, leader_only=True)[0]


def worker(run: Run, worker_id: str) -> dict[str, Any]:
    return next((w for w in heartbeats.read_workers(run.layout) if w.get("id") == worker_id), {})


def ready_rows(run: Run) -> list[dict[str, Any]]:
    """Every sample of every ready shard, each shard fully validated on the way."""
    rows: list[dict[str, Any]] = []
    for s in shards.list_ready(run.layout):
        table: pa.Table = shards.read_shard(run.layout.ready_shard(s.name), run.config.model.vocab_size)
        rows.extend(table.to_pylist())
    return rows


def assert_ready_shards_valid(run: Run, group_size: int) -> int:
    """Every file in shards/ready is a valid shard of whole groups; returns the sample count."""
    names = sorted(s.name for s in shards.list_ready(run.layout))
    total = 0
    for name in names:
        table = shards.read_shard(run.layout.ready_shard(name), run.config.model.vocab_size)
        groups: dict[str, int] = {}
        for gid in table.column("group_id").to_pylist():
            groups[gid] = groups.get(gid, 0) + 1
        assert set(groups.values()) == {group_size}, f"{name}: partial group {groups}"
        total += table.num_rows
    return total
