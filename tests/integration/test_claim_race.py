"""``fsio.claim_next`` under real concurrency: racing processes never get the same number."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
from pathlib import Path

from buffer import fsio, plans
from buffer.layout import RunLayout

PROCS = 4
CLAIMS = 25
GEN = re.compile(r"^gen-(\d{8})\.json$")


def _claim_many(directory: str, start: mp.synchronize.Barrier, out: mp.Queue) -> None:
    d = Path(directory)
    start.wait()  # all at once, so the first numbers are contended
    got = []
    for i in range(CLAIMS):
        n = fsio.claim_next(
            lambda n: d / f"gen-{n:08d}.json",
            lambda n, i=i: fsio.json_bytes({"n": n, "pid": os.getpid(), "i": i}),
            first=max(fsio.numbered(d, GEN), default=0) + 1,
        )
        got.append(n)
    out.put((os.getpid(), got))


def _claim_epoch(root: str, start: mp.synchronize.Barrier, out: mp.Queue) -> None:
    layout = RunLayout.of(root)
    start.wait()
    out.put((os.getpid(), [plans.PlanLog.claim(layout).epoch]))


def _race(target, arg: str) -> list[tuple[int, list[int]]]:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(PROCS), ctx.Queue()
    procs = [ctx.Process(target=target, args=(arg, start, out)) for _ in range(PROCS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_four_racing_processes_claim_distinct_numbers(tmp_path: Path) -> None:
    results = _race(_claim_many, str(tmp_path))
    claimed = [n for _, got in results for n in got]
    assert sorted(claimed) == list(range(1, PROCS * CLAIMS + 1))  # distinct, and no number skipped
    for pid, got in results:  # each file holds the record of the process that was told it won
        for n in got:
            assert json.loads((tmp_path / f"gen-{n:08d}.json").read_text())["pid"] == pid


def test_four_racing_trainers_claim_distinct_epochs(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    results = _race(_claim_epoch, str(layout.root))
    assert sorted(e for _, got in results for e in got) == [1, 2, 3, 4]
    assert len(list(layout.epochs.iterdir())) == PROCS
