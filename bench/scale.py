"""The cost of the shared-storage channel at cluster scale: a run directory built to look like S steps of W
workers, and the hot paths timed and their file-system calls counted in fresh processes.

    python bench/scale.py [--steps 100 1000 10000] [--workers 512] [--nodes 64] [--repeat 200]
    python bench/scale.py --build DIR --steps 10000 --workers 512      # only build, for real processes to use
    python bench/scale.py --steps 100 --workers 4096 --nodes 512 --latency-ms 1   # through a slow file system

The run is written through the project's own writers: real plans (``PlanLog.write_plan``, 16 shards of 64 samples
a step, one step a second of wall clock), their summaries, worker status records, the trainer's record with its feed
(``trainer.feed.FeedKeeper``), and real unconsumed shards for the backlog (two steps' worth).  The consumed shards
of the history are hard links of one real shard under the names and buckets they would have had: no hot path reads
them.  While building, ``fsync`` is skipped (the measurements are of reads).

Measured, each in a fresh process (the page cache warm, as on a busy node):
- a worker's check: what a rollout worker does before each batch and about twice a second while paused
  (``rollout_worker.admission.Admission.view`` and a read of ``weights/LATEST``);
- a trainer's poll: rank 0 looking for a step's samples with none new (``Planner.try_plan``), and one refresh of
  its feed (``FeedKeeper.refresh``, once a second: with ``--nodes N`` it reads N node supervisors' records, each
  listing W / N workers; without, each live worker's record);
- a fresh worker's first view, with no live trainer (it counts the backlog itself from the consumption log);
- a resumed trainer's start-up: claiming an epoch, loading the consumption log, finding the plans to replay; with
  the memory of its consumed-row state;
- ``shardrl audit``'s ledger (``buffer.audit.audit``), once: not a hot path (it reads every plan and shard name, so
  its time grows with the run), but its peak memory must not.
With ``--latency-ms T`` the run is built on the local disk and measured through the FUSE passthrough of the storage
tests (``tests/integration/faultfs.py``), which adds T ms to every metadata call (open, create, rename, link,
unlink, mkdir, getattr, readdir), as a Lustre or NFS round trip would; the kernel's attribute and entry caches are
off there, so each call reaches it.  File-system calls are counted with ``strace -f -c`` (opens, stats and directory reads), the difference between a
process that runs the path N times and one that runs it 0 times, divided by N; without strace, by an instrumented
layer over ``os`` and ``open`` in the measuring process.  Printed: the table for each S, and the ratio of the
largest S to the smallest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer import heartbeats, plans, shards
from buffer.config import ShardRLConfig
from buffer.layout import BUCKET_S
from buffer.plans import Consumption, PlanLog
from buffer.run import Run, open_run
from buffer.weights import commit_version, staging_dir

SAMPLES_PER_STEP = 1024
SHARD_SAMPLES = 64
GROUP = 8
BACKLOG_STEPS = 2
LINKS_PER_FILE = 60_000  # ext4 allows 65,000 links to one inode
METADATA = {"open", "openat", "stat", "lstat", "newfstatat", "statx", "fstat", "getdents64", "getdents"}


# ---------------------------------------------------------------------------------------------------- build


@contextlib.contextmanager
def _no_fsync() -> Iterator[None]:
    real = os.fsync
    os.fsync = lambda fd: None  # the build only: what is measured afterwards is reads
    try:
        yield
    finally:
        os.fsync = real


def _rows(worker: str, seq: int, n: int, version: int) -> list[dict[str, Any]]:
    return [
        {
            "sample_id": f"{worker}.{seq}.{i}",
            "group_id": f"{worker}.{seq}.g{i // GROUP}",
            "prompt_ids": [1, 2, 3, 4],
            "response_ids": [5, 6, 7, 8, 9, 10],
            "response_logprobs": [-0.5] * 6,
            "reward": float(i % 2),
            "policy_version": version,
            "finish_reason": "stop",
        }
        for i in range(n)
    ]


def _init(root: Path) -> Run:
    from shardrl.runs import init_run

    cfg = ShardRLConfig.model_validate(
        {
            "model": {"path": "tiny"},
            "reward": {"function": "max_digit"},
            "trainer": {"samples_per_step": SAMPLES_PER_STEP},
            "rollout": {"shard_samples": SHARD_SAMPLES, "sampling": {"n": GROUP}},
        }
    )
    return init_run(root, cfg)


def build(root: Path, steps: int, workers: int, nodes: int = 0) -> Path:
    """A run directory that looks like ``steps`` trained steps of ``workers`` workers (under ``nodes`` node
    supervisors, worker ``i`` on node ``i % nodes``; 0: none); returns its root."""
    run = _init(root)
    layout = run.layout
    with _no_fsync():
        log = PlanLog.claim(layout)
        template = shards.ShardWriter(layout, run.run_id, "template")
        for r in _rows("template", 0, SHARD_SAMPLES, 0):
            template.add(r)
        tpath = template.flush()
        assert tpath is not None
        tname = shards.ShardName.parse(tpath.name)
        assert tname is not None
        per_step = SAMPLES_PER_STEP // SHARD_SAMPLES
        # the history ends sealed: its last bucket is past the grace before the backlog's
        start = time.time() - steps - shards.SEAL_GRACE_S - 3 * BUCKET_S
        consumption = Consumption(open_from=shards.bucket_at(start) - 1)
        seqs = [0] * workers
        source, links = tpath, 0
        for step in range(1, steps + 1):
            bucket = shards.bucket_at(start + step)
            os.makedirs(layout.ready_bucket(bucket), exist_ok=True)
            names = []
            for k in range(per_step):
                w = (step * per_step + k) % workers
                name = shards.ShardName(bucket, f"w{w}", "h1st0ry", seqs[w], SHARD_SAMPLES, tname.crc).name
                seqs[w] += 1
                if links == LINKS_PER_FILE:  # a file system's limit on hard links to one file
                    copy = tpath.with_name(f".copy-{step}-{tpath.name}")
                    shutil.copyfile(tpath, copy)
                    source, links = copy, 0
                os.link(source, layout.ready_shard(name))
                links += 1
                names.append(name)
            plan = log.write_plan(step, names, [(n, r) for n in names for r in range(SHARD_SAMPLES)])
            consumption.add(plan)
            # as the trainer's planner does: every shard of an older bucket is consumed
            consumption.advance(bucket, lambda n: p.bucket if (p := shards.ShardName.parse(n)) else None)
            if step % plans.SUMMARY_EVERY == 0:
                if step == steps - steps % plans.SUMMARY_EVERY:
                    # as a trainer caught up on the history has it: every sealed, consumed bucket is behind
                    consumption.advance(
                        bucket + 1, lambda n: p.bucket if (p := shards.ShardName.parse(n)) else None
                    )
                log.write_summary(consumption)
        for leftover in tpath.parent.glob(f"*{tpath.name}"):
            os.unlink(leftover)
        for i in range(BACKLOG_STEPS * per_step):  # the backlog: real, unconsumed shards of now
            w = f"w{i % workers}"
            writer = shards.ShardWriter(layout, run.run_id, w)
            for r in _rows(w, i, SHARD_SAMPLES, steps):
                writer.add(r)
            writer.flush()
        for i in range(workers):
            heartbeats.worker_status(layout, f"w{i}", slot=i, incarnation="now").update(
                state="running",
                in_flight=SHARD_SAMPLES,
                published_samples=SHARD_SAMPLES,
                weights_version=steps,
            )
        for n in range(nodes):
            mine = [i for i in range(workers) if i % nodes == n]
            heartbeats.supervisor_status(layout, f"node{n}", capacity=len(mine)).update(
                state="running", slots=mine, desired=workers, workers={str(i): _slot(i, steps) for i in mine}
            )
        with contextlib.suppress(OSError):  # the template's bucket, when nothing else was published there
            tpath.parent.rmdir()
        _publish_version(run, steps)
        _write_trainer_record(run, log, steps)
    return layout.root


def _slot(i: int, steps: int) -> dict[str, Any]:
    """Worker ``i`` as its supervisor lists it (the copy of its own record that the trainer's feed reads)."""
    return {
        "worker_id": f"w{i}",
        "pid": 10_000 + i,
        "state": "running",
        "restarts": 0,
        "device": "cpu",
        "incarnation": "now",
        "in_flight": SHARD_SAMPLES,
        "published_samples": SHARD_SAMPLES,
    }


def _publish_version(run: Run, version: int) -> None:
    """Version ``version`` committed the way the trainer commits it (staging, manifest, LATEST), so the run is one
    ``shardrl fsck`` accepts: the base model's config and weights, which the workers' status records name."""
    st = staging_dir(run.layout, version)
    for f in run.model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, st / f.name)
    dtype = run.config.model.dtype if run.config.model.dtype != "auto" else "float32"
    commit_version(run.layout, version, st, step=version, dtype=dtype)


def _write_trainer_record(run: Run, log: PlanLog, steps: int) -> None:
    from trainer.data import Limits, Planner
    from trainer.feed import FeedKeeper

    planner = Planner(run.layout, log, Limits())
    writer = heartbeats.trainer_status(run.layout, epoch=log.epoch)
    writer.update(state="waiting", step=steps, published_version=steps, waiting="samples of the next step")
    FeedKeeper(run, planner, lambda fields: writer.update(**fields)).refresh()


def _keep_trainer_fresh(root: Path) -> None:
    """The trainer record's feed as a live trainer keeps it (fresh): measured paths see a live trainer."""
    path = root / "status" / "trainer.json"
    rec = json.loads(path.read_text())
    rec["feed_at"] = rec["updated_at"] = time.time()
    path.write_text(json.dumps(rec))
    # and the node supervisors' records as live supervisors keep them (each rewritten once a second), for the whole
    # measurement: dated an hour ahead, they stay younger than a record's live age however slow the file system,
    # where the feed would otherwise fall back to reading each worker's record
    for sup in (root / "status" / "supervisors").glob("*.json"):
        rec = json.loads(sup.read_text())
        rec["updated_at"] = time.time() + 3600
        sup.write_text(json.dumps(rec))


def _stop_trainer(root: Path) -> None:
    path = root / "status" / "trainer.json"
    rec = json.loads(path.read_text())
    rec["feed_at"] = time.time() - 3600  # no live trainer: a fresh worker counts the backlog itself
    path.write_text(json.dumps(rec))


# -------------------------------------------------------------------------------------------------- measure


def _worker_check(run: Run) -> Callable[[], Any]:
    """The judgement a worker makes before each batch (``RolloutWorker._loop``): the view, then the weights."""
    from rollout_worker.admission import Admission
    from rollout_worker.following import WeightFollower

    node = "node0" if run.layout.supervisor_status("node0").exists() else None
    adm = Admission(run.layout, "w0", "now", max_age_s=1e9, fallback_every_s=1.0, supervisor=node)
    follower = WeightFollower(
        run.layout, None, name="w0", poll_s=1.0, max_staleness=1, report=lambda **_: None, on_error=print
    )  # type: ignore[arg-type]  # no engine: it serves the newest version already, nothing is loaded
    rec = adm.view(0, 0).trainer
    follower.version = follower.latest = rec.published_version if rec else 0

    def check() -> Any:
        view = adm.view(SHARD_SAMPLES, 0)
        t = view.trainer
        newest = t.published_version if view.live and t is not None and t.publishing is None else None
        return follower.catch_up(view.coming // SAMPLES_PER_STEP, view.planned_step, t, newest)

    return check


def _fresh_worker(run: Run) -> Callable[[], Any]:
    from rollout_worker.admission import Admission

    def first_view() -> Any:  # a new worker: nothing remembered, no live trainer
        return Admission(run.layout, "w-new", "new", max_age_s=1.0, fallback_every_s=1.0).view(0, 0)

    return first_view


def _trainer_poll(run: Run) -> Callable[[], Any]:
    from trainer.data import Limits, Planner

    planner = Planner(run.layout, PlanLog(run.layout, 1), Limits())
    planner.try_plan(10**8, 10**9, 0, 10**6, False)  # the first look loads the backlog's shards
    return lambda: planner.try_plan(10**8, 10**9, 0, 10**6, False)


def _feed_refresh(run: Run) -> Callable[[], Any]:
    from trainer.data import Limits, Planner
    from trainer.feed import FeedKeeper

    keeper = FeedKeeper(run, Planner(run.layout, PlanLog(run.layout, 1), Limits()), None)
    return keeper.refresh


def _trainer_start(run: Run) -> Callable[[], Any]:
    from trainer.data import Limits, Planner

    def start() -> Any:
        log = PlanLog(run.layout, 1)  # as a claim's: the plans a resumed trainer reads on start
        planner = Planner(run.layout, log, Limits())
        log.replay(after_step=planner.consumption.step - 1)
        return planner

    return start


def _audit(run: Run) -> Callable[[], Any]:
    from buffer.audit import audit

    return lambda: audit(run.layout)


PATHS: dict[str, Callable[[Run], Callable[[], Any]]] = {
    "worker_check": _worker_check,
    "trainer_poll": _trainer_poll,
    "feed_refresh": _feed_refresh,
    "fresh_worker": _fresh_worker,
    "trainer_start": _trainer_start,
    "audit": _audit,  # not a hot path: it reads every plan; its memory is what must not grow with the run
}


def _child(root: Path, what: str, repeat: int) -> None:
    """Runs inside the measuring process: set up, then the path ``repeat`` times; prints seconds a call."""
    run = open_run(root)
    fn = PATHS[what](run)
    counter = _Counter() if os.environ.get("SCALE_COUNT") == "python" else None
    tracemalloc.start()
    t0 = time.perf_counter()
    with counter or contextlib.nullcontext():
        for _ in range(repeat):
            fn()
    seconds = (time.perf_counter() - t0) / max(repeat, 1)
    peak = tracemalloc.get_traced_memory()[1]
    out: dict[str, Any] = {"seconds": seconds, "peak_bytes": peak}
    if counter is not None:
        out["calls"] = counter.calls
    print("SCALE " + json.dumps(out), flush=True)


class _Counter:
    """Counts metadata calls made through Python's ``os`` and ``open`` (where strace is absent)."""

    NAMES = ("open", "stat", "lstat", "listdir", "scandir", "fstat")

    def __init__(self) -> None:
        self.calls = 0
        self._real: dict[str, Any] = {}

    def __enter__(self) -> _Counter:
        import builtins

        for name in self.NAMES:
            self._real[name] = getattr(os, name)
            setattr(os, name, self._counted(self._real[name]))
        self._real["builtins.open"] = builtins.open
        builtins.open = self._counted(builtins.open)  # type: ignore[assignment]
        return self

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*a: Any, **k: Any) -> Any:
            self.calls += 1
            return fn(*a, **k)

        return counted

    def __exit__(self, *exc: object) -> None:
        import builtins

        for name in self.NAMES:
            setattr(os, name, self._real[name])
        builtins.open = self._real["builtins.open"]


def _run_child(root: Path, what: str, repeat: int, strace: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(root), what, str(repeat)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with tempfile.NamedTemporaryFile(suffix=".strace") as trace:
        if strace:
            cmd = ["strace", "-f", "-c", "-o", trace.name, *cmd]
        else:
            env["SCALE_COUNT"] = "python"
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SCALE ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(
                f"{what}: measuring process failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            )
        out = json.loads(line[6:])
        if strace:
            out["calls"] = _strace_calls(Path(trace.name).read_text())
    return out


def _strace_calls(summary: str) -> int:
    """Metadata calls in an ``strace -c`` summary (opens, stats, directory reads)."""
    total = 0
    for ln in summary.splitlines():
        parts = ln.split()
        if len(parts) >= 5 and parts[-1] in METADATA and parts[3].isdigit():
            total += int(parts[3])
    return total


def measure(root: Path, what: str, repeat: int, strace: bool) -> dict[str, float]:
    """Seconds and metadata calls per call of ``what``: a run of ``repeat`` calls less a run of none."""
    if what == "fresh_worker":
        _stop_trainer(root)
    else:
        _keep_trainer_fresh(root)
    base = _run_child(root, what, 0, strace)
    full = _run_child(root, what, repeat, strace)
    return {
        "seconds": full["seconds"],
        "calls": (full["calls"] - base["calls"]) / repeat,
        "peak_mib": full["peak_bytes"] / 2**20,
    }


def measure_run(root: Path, repeat: int, strace: bool) -> dict[str, dict[str, float]]:
    # a refresh lists the buckets that can still change: crossing a minute's boundary mid-measurement adds one or
    # two listings to each refresh after it (tests/integration/test_scale.py allows for it)
    reps = {"worker_check": repeat, "trainer_poll": repeat, "feed_refresh": max(10, repeat // 2)}
    reps |= {"fresh_worker": max(3, repeat // 20), "trainer_start": 3, "audit": 1}
    return {what: measure(root, what, n, strace) for what, n in reps.items()}


def _files(root: Path) -> dict[str, int]:
    ready = sum(len(os.listdir(root / "shards" / "ready" / b)) for b in os.listdir(root / "shards" / "ready"))
    plan_bytes = sum(p.stat().st_size for p in (root / "plans").glob("s[0-9]*/step-*.json"))
    record = (root / "status" / "trainer.json").stat().st_size
    return {"shards": ready, "plan_bytes": plan_bytes, "trainer_record_bytes": record}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--workers", type=int, default=512)
    p.add_argument("--nodes", type=int, default=0, help="node supervisors the workers run under (0: none)")
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="measure through a FUSE mount adding this to each metadata call",
    )
    p.add_argument("--repeat", type=int, default=200, help="calls of each hot path in its measuring process")
    p.add_argument(
        "--build", type=Path, help="only build the run here (one --steps value), for real processes"
    )
    p.add_argument("--dir", type=Path, help="where to build the runs (default: a temporary directory)")
    p.add_argument("--no-strace", action="store_true", help="count calls in Python even where strace exists")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _child(Path(a.child[0]), a.child[1], int(a.child[2]))
        return 0
    if a.build:
        t0 = time.monotonic()
        build(a.build, a.steps[0], a.workers, a.nodes)
        print(
            f"built {a.build}: {a.steps[0]} steps, {a.workers} workers, {_files(a.build)} in {time.monotonic() - t0:.0f}s"
        )
        return 0
    strace = shutil.which("strace") is not None and not a.no_strace
    base = a.dir or Path(tempfile.mkdtemp(prefix="shardrl-scale-"))
    rows: dict[int, dict[str, Any]] = {}
    with _slow_fs(base, a.latency_ms) as (backing, measured):
        for steps in a.steps:
            name = f"run-{steps}-{a.workers}-{a.nodes}"
            if not (backing / name / "run.json").exists():
                build(backing / name, steps, a.workers, a.nodes)
            rows[steps] = {"files": _files(backing / name), **measure_run(measured / name, a.repeat, strace)}
            _print_row(steps, a.workers, rows[steps])
    lo, hi = min(rows), max(rows)
    print(f"\nratio {hi} / {lo} steps ({'strace' if strace else 'python-level counts'}):")
    for what in PATHS:
        r_t = rows[hi][what]["seconds"] / max(rows[lo][what]["seconds"], 1e-12)
        r_c = rows[hi][what]["calls"] / max(rows[lo][what]["calls"], 1e-12)
        print(
            f"  {what:13s} time {r_t:5.2f}x   calls {r_c:5.2f}x   ({rows[hi][what]['calls']:.1f} calls a call)"
        )
    if a.json:
        a.json.write_text(json.dumps({"workers": a.workers, "strace": strace, "rows": rows}, indent=1))
    return 0


@contextlib.contextmanager
def _slow_fs(base: Path, latency_ms: float) -> Iterator[tuple[Path, Path]]:
    """(where runs are built, where they are measured): the same directory, or with a latency a FUSE mount of it."""
    if latency_ms <= 0:
        yield base, base
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    import faultfs  # the storage tests' passthrough file system

    with faultfs.mounted(base / "slowfs") as fs:
        fs.set({"kind": "latency", "path": "*", "seconds": latency_ms / 1000})
        print(f"measuring through {fs.mount}: +{latency_ms:g} ms a metadata call", flush=True)
        yield fs.backing, fs.mount


def _print_row(steps: int, workers: int, row: dict[str, Any]) -> None:
    f = row["files"]
    print(
        f"\n{steps} steps, {workers} workers: {f['shards']} shard files, {f['plan_bytes'] / 1e6:.1f} MB of plans, "
        f"trainer record {f['trainer_record_bytes'] / 1e3:.1f} kB"
    )
    for what in PATHS:
        m = row[what]
        print(
            f"  {what:13s} {m['seconds'] * 1e3:9.2f} ms  {m['calls']:8.1f} calls  peak {m['peak_mib']:.1f} MiB"
        )


if __name__ == "__main__":
    sys.exit(main())
