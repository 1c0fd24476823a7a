"""The storage protocols of ``buffer`` on a file system that fails the way NFS and Lustre do (``faultfs.py``).

Every protocol that crosses a process boundary (shard publish and read, plans, weight publish and LATEST, control
commands, slot leases) runs over a real FUSE mount while faults are injected per path: EIO on read and write,
ENOSPC on write, ESTALE on open, ENOENT right after a rename, names that become visible late (a lookup cache), and
stale attributes.  What is checked: nothing partial is ever visible, nothing is lost, transient errors are retried,
persistent ones are raised naming the file, temporaries do not outlive an ENOSPC, and work resumes once the fault
is gone.

The kernel retries a few calls once by itself (an open that got ESTALE, a failed read-ahead, a dentry whose
revalidation failed), so a fault the application sees once is configured to fire twice (``ONE_VISIBLE``);
``test_fault_reaches_the_application`` checks that calibration, so that no test here passes because its fault
never reached the code under test.  Shard reads that fail with EIO run in a child process: were a shard ever
memory-mapped again, a failed page-in would be SIGBUS, which would kill the test process instead of failing it.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from buffer import plans, shards, weights
from buffer.control import ControlWatcher, Leases, init_state, lease_generations, read_state, write_command
from buffer.layout import RunLayout
from buffer.shards import ShardWriter
from tests.unit.buffer_helpers import sample

from .faultfs import FaultFS, fuse_unavailable, mounted

pytestmark = pytest.mark.skipif(fuse_unavailable() is not None, reason=f"FUSE: {fuse_unavailable()}")

ONE_VISIBLE = 2  # firings that make the application see one error (the kernel retries once by itself)
RUN_ID = "run-faultfs"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ffs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    with mounted(tmp_path_factory.mktemp("faultfs")) as fs:
        yield fs


@pytest.fixture
def layout(ffs: FaultFS) -> Iterator[RunLayout]:
    ffs.clear()
    layout = RunLayout.of(ffs.mount / f"run-{uuid.uuid4().hex[:8]}")
    layout.create()
    yield layout
    ffs.clear()


def _consumed_rows(layout: RunLayout) -> set[tuple[str, int]]:
    """(shard, row) of every sample a valid plan consumed."""
    return {row for p in plans.valid_plans(layout).values() for row in p.rows(p.takes) + p.rows(p.drops)}


def under(layout: RunLayout, sub: str) -> str:
    """A rule pattern for ``sub`` inside the run directory (rule paths are relative to the mount root)."""
    return f"{layout.root.name}/{sub}"


def wait_for(cond: Callable[[], Any], timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(0.1)
    return value


def writer_with(layout: RunLayout, n: int = 4, worker: str = "w0") -> ShardWriter:
    w = ShardWriter(layout, RUN_ID, worker)
    for i in range(n):
        w.add(sample(i, group=f"g{i // 2}"))
    return w


def temporaries(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".tmp."))


_CHILD_READ = """
import json, sys
from buffer.layout import RunLayout
from buffer.shards import load_or_quarantine
layout = RunLayout.of(sys.argv[1])
try:
    table = load_or_quarantine(layout, sys.argv[2])
    print(json.dumps({"rows": None if table is None else table.num_rows}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
"""


def read_in_child(layout: RunLayout, name: str) -> tuple[int, dict[str, Any]]:
    """``load_or_quarantine`` in a child process: (exit status, what it printed)."""
    r = subprocess.run(
        [sys.executable, "-c", _CHILD_READ, str(layout.root), name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out = r.stdout.strip().splitlines()
    return r.returncode, (json.loads(out[-1]) if out else {"stderr": r.stderr[-500:]})


# ------------------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize(
    "rule",
    [
        {"op": "open", "errno": "ESTALE", "count": ONE_VISIBLE},
        {"op": "read", "errno": "EIO", "count": ONE_VISIBLE},
        {"kind": "enoent_after_rename", "count": ONE_VISIBLE},
    ],
    ids=["estale-open", "eio-read", "enoent-after-rename"],
)
def test_fault_reaches_the_application(ffs: FaultFS, layout: RunLayout, rule: dict[str, Any]) -> None:
    target = layout.root / "probe"
    ffs.set({**rule, "path": under(layout, "probe")})
    (layout.root / "probe.tmp").write_bytes(b"x" * 10000)
    os.replace(layout.root / "probe.tmp", target)
    outcomes = []
    for _ in range(3):
        try:
            target.read_bytes()
            outcomes.append("ok")
        except OSError as e:
            outcomes.append(errno.errorcode.get(e.errno or 0, str(e)))
    expected = {"ESTALE": "ESTALE", "EIO": "EIO"}.get(rule.get("errno", ""), "ENOENT")
    assert outcomes == [expected, "ok", "ok"]


def test_late_names_and_stale_attributes_reach_the_application(ffs: FaultFS, layout: RunLayout) -> None:
    ffs.set(
        {"kind": "late_names", "path": under(layout, "late"), "seconds": 2.0},
        {"kind": "stale_attr", "path": under(layout, "grows"), "seconds": 60},
    )
    (layout.root / "late").write_bytes(b"x")
    assert "late" not in os.listdir(layout.root) and not (layout.root / "late").exists()
    wait_for(lambda: "late" in os.listdir(layout.root))
    grows = layout.root / "grows"
    grows.write_bytes(b"")
    assert grows.stat().st_size == 0
    with open(grows, "r+b") as f:
        f.write(b"0123456789")
    assert grows.stat().st_size == 0  # a stat alone stays stale
    assert grows.read_bytes() == b"0123456789"  # an open revalidates (close-to-open)
    assert ffs.fired()[1] >= 1


def test_latency_delays_the_metadata_calls_of_matching_paths_only(ffs: FaultFS, layout: RunLayout) -> None:
    """The slow file system of ``bench/scale.py --latency-ms``: every metadata call on a matching path waits, a
    call on another path does not."""
    (layout.root / "slow").write_bytes(b"x" * 10)
    (layout.root / "fast").write_bytes(b"y")
    ffs.set({"kind": "latency", "path": under(layout, "slow"), "seconds": 0.2})
    t0 = time.monotonic()
    assert (layout.root / "slow").stat().st_size == 10
    waited = time.monotonic() - t0
    calls = ffs.fired()[0]
    assert (
        calls >= 1 and waited >= 0.2 * calls
    )  # a sleep is never shorter than asked, however loaded the machine
    assert (layout.root / "fast").stat().st_size == 1
    assert ffs.fired()[0] == calls


def test_enospc_on_write_reaches_the_application(ffs: FaultFS, layout: RunLayout) -> None:
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, "full")})
    with pytest.raises(OSError) as e, open(layout.root / "full", "wb") as f:
        f.write(b"x" * 100)
    assert e.value.errno == errno.ENOSPC


# ------------------------------------------------------------------------------------------------ shards


def test_shard_publish_enospc_publishes_nothing_keeps_samples_and_resumes(
    ffs: FaultFS, layout: RunLayout
) -> None:
    w = writer_with(layout)
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, "shards/tmp/*")})
    with pytest.raises(OSError) as e:
        w.flush()
    assert e.value.errno == errno.ENOSPC
    assert shards.list_ready(layout) == [] and temporaries(layout.shards_tmp) == []
    assert w.pending == 4  # nothing dropped: the same samples go out once there is space
    ffs.clear()
    path = w.flush()
    assert path is not None
    table = shards.read_shard(path)
    assert table.num_rows == 4 and len(set(table.column("sample_id").to_pylist())) == 4


def test_shard_publish_failures_leak_no_threads(ffs: FaultFS, layout: RunLayout) -> None:
    ffs.set({"op": "write", "errno": "EIO", "path": under(layout, "shards/tmp/*")})
    w = writer_with(layout)
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(OSError):
            w.flush()
    assert threading.active_count() == before


def test_shard_publish_retries_a_transient_write_error(ffs: FaultFS, layout: RunLayout) -> None:
    ffs.set({"op": "write", "errno": "EIO", "path": under(layout, "shards/tmp/*"), "count": 1})
    w = writer_with(layout)
    path = w.flush()
    assert ffs.fired() == [1]
    assert path is not None and shards.read_shard(path).num_rows == 4


@pytest.mark.parametrize(
    "rule",
    [
        {"op": "open", "errno": "ESTALE", "count": ONE_VISIBLE},
        {"kind": "enoent_after_rename", "count": ONE_VISIBLE + 1},
        {"kind": "stale_attr", "seconds": 60},
    ],
    ids=["estale-open", "enoent-after-rename-twice", "stale-attr"],
)
def test_shard_read_survives_transient_faults(ffs: FaultFS, layout: RunLayout, rule: dict[str, Any]) -> None:
    ffs.set({**rule, "path": under(layout, "shards/ready/*.arrow")})
    path = writer_with(layout).flush()
    assert path is not None
    table = shards.load_or_quarantine(layout, path.name)
    assert table is not None and table.num_rows == 4
    assert shards.quarantined(layout) == [] and path.exists()
    if rule.get("kind") != "stale_attr":  # a fresh publish has no older attributes to be stale with
        assert ffs.fired()[0] >= 1


def test_shard_read_survives_one_eio(ffs: FaultFS, layout: RunLayout) -> None:
    path = writer_with(layout).flush()
    assert path is not None
    ffs.set(
        {"op": "read", "errno": "EIO", "path": under(layout, "shards/ready/*.arrow"), "count": ONE_VISIBLE}
    )
    rc, out = read_in_child(layout, path.name)
    assert ffs.fired() == [ONE_VISIBLE]
    assert (rc, out) == (0, {"rows": 4})
    assert shards.quarantined(layout) == []


def test_shard_read_persistent_eio_is_an_error_not_a_crash(ffs: FaultFS, layout: RunLayout) -> None:
    path = writer_with(layout).flush()
    assert path is not None
    ffs.set({"op": "read", "errno": "EIO", "path": under(layout, "shards/ready/*.arrow")})
    rc, out = read_in_child(layout, path.name)
    assert rc == 0, f"the reader died (exit {rc})"
    assert path.name in out.get("error", "")
    ffs.clear()
    assert shards.load_or_quarantine(layout, path.name) is not None


def test_shard_unreadable_for_a_while_is_not_quarantined(ffs: FaultFS, layout: RunLayout) -> None:
    path = writer_with(layout).flush()
    assert path is not None
    ffs.set({"op": "open", "errno": "ESTALE", "path": under(layout, "shards/ready/*.arrow")})
    with pytest.raises(OSError) as e:
        shards.load_or_quarantine(layout, path.name)
    assert path.name in str(e.value)
    ffs.clear()
    assert shards.quarantined(layout) == [] and shards.load_or_quarantine(layout, path.name) is not None


def test_shard_visible_late_is_read_once_visible(ffs: FaultFS, layout: RunLayout) -> None:
    ffs.set({"kind": "late_names", "path": under(layout, "shards/ready/*.arrow"), "seconds": 2.0})
    path = writer_with(layout).flush()
    assert path is not None
    assert shards.list_ready(layout) == []  # the lookup cache hides it: only latency
    names = wait_for(lambda: shards.list_ready(layout))
    assert [s.name for s in names] == [path.name]
    table = shards.load_or_quarantine(layout, path.name)
    assert table is not None
    assert len(set(table.column("sample_id").to_pylist())) == 4 and shards.quarantined(layout) == []


# ------------------------------------------------------------------------------------------------- plans


def test_plan_write_enospc_raises_and_resumes(ffs: FaultFS, layout: RunLayout) -> None:
    log = plans.PlanLog.claim(layout)
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, "plans/*")})
    with pytest.raises(OSError) as e:
        log.write_plan(1, ["s"], [("s", 0), ("s", 1)])
    assert e.value.errno == errno.ENOSPC
    assert plans.valid_plans(layout) == {}
    ffs.clear()
    log.write_plan(1, ["s"], [("s", 0), ("s", 1)])
    plan = plans.valid_plans(layout)[1]
    assert plan.rows(plan.takes) == [("s", 0), ("s", 1)]


@pytest.mark.parametrize(
    "rule",
    [
        {"op": "open", "errno": "ESTALE", "count": ONE_VISIBLE},
        {"op": "read", "errno": "EIO", "count": ONE_VISIBLE},
    ],
    ids=["estale-open", "eio-read"],
)
def test_plan_read_retries_transient_errors(ffs: FaultFS, layout: RunLayout, rule: dict[str, Any]) -> None:
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, ["s"], [("s", 0)])
    ffs.set({**rule, "path": under(layout, "plans/*/step-*")})
    assert _consumed_rows(layout) == {("s", 0)}
    assert ffs.fired() == [ONE_VISIBLE]


def test_plan_read_persistent_error_is_raised_not_skipped(ffs: FaultFS, layout: RunLayout) -> None:
    log = plans.PlanLog.claim(layout)
    log.write_plan(1, ["s"], [("s", 0)])
    ffs.set({"op": "read", "errno": "EIO", "path": under(layout, "plans/*/step-*")})
    # a plan that cannot be read must stop the trainer, never make its samples look unconsumed
    with pytest.raises(OSError) as e:
        plans.valid_plans(layout)
    assert e.value.errno == errno.EIO


def test_claim_does_not_fence_out_a_plan_it_cannot_see_yet(ffs: FaultFS, layout: RunLayout) -> None:
    old = plans.PlanLog.claim(layout)
    old.write_plan(1, ["s"], [("s", 0)])
    ffs.set({"kind": "late_names", "path": under(layout, "plans/*/step-*"), "seconds": 3.0})
    old.write_plan(2, ["s"], [("s", 1)])  # recorded (and maybe trained and checkpointed) before the crash
    assert 2 not in plans.valid_plans(layout)  # the restarted trainer's node does not see it yet
    plans.PlanLog.claim(layout)
    wait_for(lambda: len(os.listdir(layout.plan_bucket(0))) >= 2)
    assert _consumed_rows(layout) == {("s", 0), ("s", 1)}


# ----------------------------------------------------------------------------------------------- weights


def stage(layout: RunLayout, version: int, payload: bytes = b"w" * 4096) -> Path:
    d = weights.staging_dir(layout, version)
    (d / "model.safetensors").write_bytes(payload)
    (d / "config.json").write_text("{}")
    return d


def test_latest_enospc_keeps_the_previous_version_and_resumes(ffs: FaultFS, layout: RunLayout) -> None:
    weights.commit_version(layout, 1, stage(layout, 1), step=1, dtype="float32")
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, "weights/.tmp.LATEST*")})
    with pytest.raises(OSError) as e:
        weights.commit_version(layout, 2, stage(layout, 2), step=2, dtype="float32")
    assert e.value.errno == errno.ENOSPC
    assert weights.latest_version(layout) == 1
    assert weights.verify_version(layout, 1, checksums=True).version == 1
    ffs.clear()
    weights.commit_version(layout, 3, stage(layout, 3), step=3, dtype="float32")
    latest = weights.read_latest(layout, checksums=True)
    assert latest is not None and latest.version == 3


def test_manifest_enospc_publishes_nothing_and_the_same_staging_commits_later(
    ffs: FaultFS, layout: RunLayout
) -> None:
    staging = stage(layout, 1)
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, "weights/.staging-*/.tmp.manifest*")})
    with pytest.raises(OSError):
        weights.commit_version(layout, 1, staging, step=1, dtype="float32")
    assert weights.latest_version(layout) == 0 and weights.published_versions(layout) == []
    ffs.clear()
    weights.commit_version(layout, 1, staging, step=1, dtype="float32")
    assert weights.latest_version(layout) == 1 and weights.verify_version(layout, 1, checksums=True)


@pytest.mark.parametrize(
    "rule",
    [
        {"kind": "enoent_after_rename", "count": ONE_VISIBLE},
        {"op": "open", "errno": "ESTALE", "count": ONE_VISIBLE},
        {"op": "read", "errno": "EIO", "count": ONE_VISIBLE},
    ],
    ids=["enoent-after-rename", "estale-open", "eio-read"],
)
def test_latest_read_retries_transient_errors(ffs: FaultFS, layout: RunLayout, rule: dict[str, Any]) -> None:
    weights.commit_version(layout, 1, stage(layout, 1), step=1, dtype="float32")
    ffs.set({**rule, "path": under(layout, "weights/LATEST")})
    weights.commit_version(layout, 2, stage(layout, 2), step=2, dtype="float32")
    assert weights.latest_version(layout) == 2
    assert ffs.fired() == [ONE_VISIBLE]


def test_latest_persistently_unreadable_is_an_error_not_version_0(ffs: FaultFS, layout: RunLayout) -> None:
    weights.commit_version(layout, 1, stage(layout, 1), step=1, dtype="float32")
    ffs.set({"op": "read", "errno": "EIO", "path": under(layout, "weights/LATEST")})
    with pytest.raises(OSError) as e:
        weights.latest_version(layout)
    assert e.value.errno == errno.EIO


def test_version_visible_late_is_refused_then_loaded(ffs: FaultFS, layout: RunLayout) -> None:
    ffs.set({"kind": "late_names", "path": under(layout, "weights/v*"), "seconds": 2.0})
    weights.commit_version(layout, 1, stage(layout, 1), step=1, dtype="float32")
    assert weights.latest_version(layout) == 1  # LATEST is seen before the directory it names
    with pytest.raises(weights.WeightsError) as e:
        weights.verify_version(layout, 1)
    assert "v000001" in str(e.value)  # one clear line: the worker keeps its version and retries
    assert wait_for(lambda: _verifies(layout, 1))


def _verifies(layout: RunLayout, version: int) -> bool:
    try:
        return weights.verify_version(layout, version, checksums=True).version == version
    except weights.WeightsError:
        return False


def test_weights_stale_attributes_never_fail_verification(ffs: FaultFS, layout: RunLayout) -> None:
    ffs.set({"kind": "stale_attr", "path": under(layout, "weights/*"), "seconds": 60})
    for v in (1, 2, 3):
        weights.commit_version(layout, v, stage(layout, v, b"w" * (4096 * v)), step=v, dtype="float32")
        assert weights.verify_version(layout, weights.latest_version(layout), checksums=True).version == v


# ----------------------------------------------------------------------------------------------- control


def watcher(layout: RunLayout, who: str = "sup-a", settle_s: float = 0.0) -> ControlWatcher:
    return ControlWatcher(layout, max_workers=16, settle_s=settle_s, who=who)


def control_layout(layout: RunLayout, desired: int = 1) -> RunLayout:
    init_state(layout, desired)
    return layout


@pytest.mark.parametrize(
    "rule",
    [
        {"kind": "enoent_after_rename", "count": ONE_VISIBLE + 1},
        {"op": "open", "errno": "ESTALE", "count": ONE_VISIBLE},
        {"op": "read", "errno": "EIO", "count": ONE_VISIBLE},
    ],
    ids=["enoent-after-rename-twice", "estale-open", "eio-read"],
)
def test_control_command_applied_once_through_transient_errors(
    ffs: FaultFS, layout: RunLayout, rule: dict[str, Any]
) -> None:
    control_layout(layout)
    w = watcher(layout)
    ffs.set({**rule, "path": under(layout, "control.json")})
    write_command(layout, "add", 2)
    wait_for(lambda: w.poll().desired == 3)
    for _ in range(3):
        w.poll()
    state = read_state(layout)
    assert (state.desired, state.generation, len(state.history)) == (3, 1, 1)
    assert ffs.fired()[0] >= 1


def test_control_persistently_unreadable_says_so(ffs: FaultFS, layout: RunLayout) -> None:
    control_layout(layout)
    write_command(layout, "add", 2)
    ffs.set({"op": "open", "errno": "EIO", "path": under(layout, "control.json")})
    w = watcher(layout)
    state = w.poll()
    state = w.poll()
    said = f"{state.problem or ''} {json.dumps(state.last_rejection)}"
    assert "control.json" in said and state.desired == 1


def test_control_generation_enospc_raises_then_applies_once(ffs: FaultFS, layout: RunLayout) -> None:
    control_layout(layout)
    w = watcher(layout)
    write_command(layout, "add", 2)
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, "control/*")})
    with pytest.raises(OSError) as e:
        w.poll()
    assert e.value.errno == errno.ENOSPC
    assert read_state(layout).desired == 1
    ffs.clear()
    assert w.poll().desired == 3 and w.poll().desired == 3
    assert read_state(layout).generation == 1


def test_control_generation_visible_late_is_applied_once_across_supervisors(
    ffs: FaultFS, layout: RunLayout
) -> None:
    control_layout(layout)
    a, b = watcher(layout, "sup-a"), watcher(layout, "sup-b")
    ffs.set({"kind": "late_names", "path": under(layout, "control/gen-*"), "seconds": 2.5})
    write_command(layout, "add", 2)
    assert a.poll().desired == 3
    b.poll()  # b's node cannot see generation 1 yet: it must not apply the command a second time
    wait_for(lambda: b.poll().generation == 1)
    for w in (a, b, a, b):
        w.poll()
    state = read_state(layout)
    assert (state.desired, state.generation) == (3, 1)
    assert ffs.fired()[0] >= 1


def test_control_echo_with_stale_attributes_is_applied_once(ffs: FaultFS, layout: RunLayout) -> None:
    control_layout(layout)
    w = watcher(layout, settle_s=0.5)
    # a stat answered from the attribute cache until an open revalidates it, as NFS does between two polls
    ffs.set({"kind": "stale_attr", "path": under(layout, "control.json"), "seconds": 60})
    with open(layout.control_file, "wb") as f:  # what `echo ... > control.json` does: rewrite in place
        f.write(b'{"action":"add","count":1}\n')
    wait_for(lambda: w.poll().desired == 2)
    for _ in range(3):
        w.poll()
    state = read_state(layout)
    assert (state.desired, state.generation) == (2, 1)


# ------------------------------------------------------------------------------------------------ leases


def test_lease_renew_survives_transient_errors(ffs: FaultFS, layout: RunLayout) -> None:
    a = Leases(layout, "sup-a", timeout_s=60)
    assert a.try_acquire(0)
    ffs.set(
        {"op": "open", "errno": "ESTALE", "path": under(layout, "leases/*"), "count": ONE_VISIBLE},
        {"kind": "enoent_after_rename", "path": under(layout, "leases/*"), "count": ONE_VISIBLE},
    )
    for _ in range(3):
        assert a.renew(0)
    b = Leases(layout, "sup-b", timeout_s=60)
    assert not b.try_acquire(0)
    assert a.held() == [0] and b.held() == []


def test_lease_visible_late_is_not_taken_twice(ffs: FaultFS, layout: RunLayout) -> None:
    # the generation files, not the slot directory: a node sees the directories it made itself
    ffs.set({"kind": "late_names", "path": under(layout, "leases/*/0*.json"), "seconds": 2.0})
    a, b = Leases(layout, "sup-a", timeout_s=60), Leases(layout, "sup-b", timeout_s=60)
    assert a.try_acquire(0)
    assert not b.try_acquire(0)  # b cannot see a's lease yet: the exclusive create still stops it
    wait_for(lambda: lease_generations(layout, 0))
    assert a.renew(0) and not b.try_acquire(0)
    assert a.held() == [0] and b.held() == []


def test_lease_renew_enospc_raises_and_resumes(ffs: FaultFS, layout: RunLayout) -> None:
    a = Leases(layout, "sup-a", timeout_s=60)
    assert a.try_acquire(0)
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, "leases/*")})
    with pytest.raises(OSError) as e:
        a.renew(0)
    assert e.value.errno == errno.ENOSPC
    ffs.clear()
    assert a.renew(0) and a.held() == [0]


# ------------------------------------------------------------------------------------------- temporaries


def _publish_shard(layout: RunLayout) -> None:
    writer_with(layout).flush()


def _write_plan(layout: RunLayout) -> None:
    plans.PlanLog(layout, 1).write_plan(1, ["s"], [("s", 0)])


def _write_latest(layout: RunLayout) -> None:
    weights.commit_version(layout, 1, stage(layout, 1), step=1, dtype="float32")


def _apply_command(layout: RunLayout) -> None:
    control_layout(layout)
    write_command(layout, "add", 1)
    watcher(layout).poll()


@pytest.mark.parametrize(
    "protocol, directory, pattern",
    [
        pytest.param(_publish_shard, "shards/tmp", "shards/tmp/*", id="shard"),
        pytest.param(_write_plan, "plans", "plans/*", id="plan"),
        pytest.param(_write_latest, "weights", "weights/.tmp.LATEST*", id="latest"),
        pytest.param(_apply_command, "control", "control/.tmp.*", id="control"),
    ],
)
def test_enospc_leaves_no_temporaries(
    ffs: FaultFS, layout: RunLayout, protocol: Callable[[RunLayout], None], directory: str, pattern: str
) -> None:
    (layout.plans / "epochs").mkdir(parents=True, exist_ok=True)
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, pattern)})
    with pytest.raises(OSError):
        protocol(layout)
    assert ffs.fired()[0] >= 1
    assert temporaries(layout.root / directory) == []


def test_lease_enospc_leaves_no_temporaries(ffs: FaultFS, layout: RunLayout) -> None:
    a = Leases(layout, "sup-a", timeout_s=60)
    assert a.try_acquire(0)
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, "leases/*")})
    with pytest.raises(OSError):
        a.renew(0)
    assert [p for p in layout.leases.rglob(".tmp.*")] == []


def _renew_lease(layout: RunLayout) -> None:
    a = Leases(layout, "sup-a", timeout_s=60)
    if a.try_acquire(0):
        a.renew(0)


@pytest.mark.parametrize(
    "protocol, pattern, name",
    [
        pytest.param(_publish_shard, "shards/tmp/*", "shards/tmp", id="shard"),
        pytest.param(_write_plan, "plans/*/.tmp.step-*", "step-00000001", id="plan"),
        pytest.param(_write_latest, "weights/.tmp.LATEST*", "LATEST", id="latest"),
        pytest.param(_apply_command, "control/.tmp.*", "control/gen-", id="control"),
        pytest.param(_renew_lease, "leases/*/.tmp.*", "slot-0000", id="lease"),
    ],
)
def test_write_errors_name_the_file(
    ffs: FaultFS, layout: RunLayout, protocol: Callable[[RunLayout], None], pattern: str, name: str
) -> None:
    """ENOSPC on a shared file system must say where: the run directory may span several."""
    (layout.plans / "epochs").mkdir(parents=True, exist_ok=True)
    ffs.set({"op": "write", "errno": "ENOSPC", "path": under(layout, pattern)})
    with pytest.raises(OSError) as e:
        protocol(layout)
    assert e.value.errno == errno.ENOSPC and name in str(e.value)


def _read_plans(layout: RunLayout) -> None:
    plans.PlanLog.claim(layout).write_plan(1, ["s"], [("s", 0)])
    plans.valid_plans(layout)


def _read_latest(layout: RunLayout) -> None:
    weights.commit_version(layout, 1, stage(layout, 1), step=1, dtype="float32")
    weights.latest_version(layout)


def _verify_version(layout: RunLayout) -> None:
    weights.commit_version(layout, 1, stage(layout, 1), step=1, dtype="float32")
    weights.verify_version(layout, 1)


@pytest.mark.parametrize(
    "protocol, pattern, name",
    [
        pytest.param(_read_plans, "plans/*/step-*", "step-00000001", id="plan"),
        pytest.param(_read_latest, "weights/LATEST", "LATEST", id="latest"),
        pytest.param(_verify_version, "weights/v*/manifest.json", "manifest.json", id="manifest"),
    ],
)
def test_read_errors_name_the_file(
    ffs: FaultFS, layout: RunLayout, protocol: Callable[[RunLayout], None], pattern: str, name: str
) -> None:
    ffs.set({"op": "read", "errno": "EIO", "path": under(layout, pattern)})
    with pytest.raises(OSError) as e:
        protocol(layout)
    assert e.value.errno == errno.EIO and name in str(e.value)
