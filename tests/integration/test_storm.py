"""The kill storm (tests/integration/storm.py): two node supervisors, two workers and a trainer on one run under
random SIGKILL/SIGTERM and rescaling, then an audit of the run directory; once with a one-process trainer and
streaming workers (``rollout.streaming``), once with a two-rank torchrun trainer (gloo on the CPU) and batch
workers.  Then the audit itself is shown to fail: the stormed run is damaged in each way the audit checks, and each
damage must be reported.

The seed is printed first (``-s`` shows it, and a failure message repeats it); ``SHARDRL_STORM_SEED`` replays one,
``python bench/chaos.py --seed S --ranks R`` runs the same storm outside pytest, as long as asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from buffer import control, plans, shards, weights
from buffer.control import Leases
from buffer.layout import RunLayout
from buffer.records import Plan, WeightsManifest, create_record, write_record

from ._common import wait_for
from .storm import (
    Audit,
    Storm,
    StormSpec,
    audit,
    check_version_steps,
    make_storm_run,
    run_storm,
    supervisor_role,
)

pytestmark = pytest.mark.slow


def _storm(ranks: int, root: Path, *, streaming: bool = False) -> tuple[Storm, Audit]:
    seed = int(os.environ.get("SHARDRL_STORM_SEED", 1000 + ranks))
    storm, result = run_storm(StormSpec(seed=seed, root=root, ranks=ranks, streaming=streaming))
    print(json.dumps(result.figures))
    return storm, result


@pytest.fixture(scope="module")
def one_process_storm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Storm, Audit]:
    # the streaming workers (rollout.streaming) take this storm: their groups in flight, scoring processes and
    # in-flight weight updates must keep every guarantee the audit checks, as the batch workers of the other do
    return _storm(1, tmp_path_factory.mktemp("storm") / "run", streaming=True)


def _assert_clean(result: Audit) -> None:
    f = result.figures
    figures = json.dumps(f)
    head = f"seed {f['seed']}, ranks {f['ranks']}: "
    assert not result.problems, head + "\n".join(result.problems) + "\n" + figures
    # the storm did hit, and the run still went somewhere
    assert sum(f["kills"].values()) >= 5, figures
    assert f["samples_consumed"] >= 32 * f["steps_trained"] > 0, figures
    assert f["latest_verified"] > 0 and f["latest_version"] > 0, figures


def test_kill_storm_with_a_one_process_trainer(one_process_storm: tuple[Storm, Audit]) -> None:
    _assert_clean(one_process_storm[1])


def test_kill_storm_with_a_torchrun_trainer(tmp_path: Path) -> None:
    _assert_clean(_storm(2, tmp_path / "run")[1])


@pytest.fixture()
def stray(one_process_storm: tuple[Storm, Audit]) -> Iterator[subprocess.Popen]:
    """A process left behind whose command line names the run directory."""
    p = subprocess.Popen(["sh", "-c", "sleep 300", str(one_process_storm[0].spec.root)])
    yield p
    p.kill()
    p.wait()


def test_a_dead_supervisors_lease_above_the_desired_count_is_given_back(tmp_path: Path) -> None:
    """Found by the storm: a supervisor holding slot 0 is SIGKILLed, then the run scales to 0.  A live supervisor
    must give the dead one's lease back once it is stale (run.lease_timeout_s), so that the run ends consistent."""
    root = make_storm_run(tmp_path / "run", {"run.lease_timeout_s": "2", "run.initial_workers": "0"})
    layout = RunLayout.of(root)
    assert Leases(layout, "vm-1-dead", 2.0).try_acquire(0)  # what the killed supervisor left
    live = supervisor_role(root, "node-a")
    live.start()
    try:
        # the event itself: the lease given back, once the live supervisor has seen it stand still for its timeout
        wait_for("the dead supervisor's lease given back", lambda: control.all_leases(layout) == {}, 60.0)
    finally:
        assert live.stop(30.0) == 0
    fsck = subprocess.run(
        [sys.executable, "-m", "shardrl.cli", "fsck", str(root)], capture_output=True, text=True, check=False
    )
    assert control.all_leases(layout) == {}, fsck.stdout
    assert fsck.returncode == 0, fsck.stdout


def _published(layout: RunLayout, version: int, step: int) -> None:
    d = layout.weight_version(version)
    d.mkdir(parents=True)
    record = {"version": version, "step": step, "dtype": "float32", "created_at": 0.0, "files": {}}
    write_record(d / weights.MANIFEST, WeightsManifest.validated(record, d / weights.MANIFEST))


def test_a_version_may_go_back_a_step_only_where_a_restart_replayed_it(tmp_path: Path) -> None:
    """Found by the storm (seed 1002, two ranks): a trainer published v2 at step 4 past its checkpoint of step 2,
    was killed, and its successor replayed step 3 as v3.  That is a replay, not disorder; the same numbers without
    the replay in the metrics are."""
    layout = RunLayout.of(tmp_path / "run")
    for version, step in ((1, 3), (2, 4), (3, 3), (4, 4)):
        _published(layout, version, step)
    metrics = layout.metrics_file("trainer")
    metrics.parent.mkdir(parents=True, exist_ok=True)
    records = [{"step": s, "epoch": 1, "replayed": 0} for s in (1, 2, 3, 4)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    unexplained = Audit()
    check_version_steps(layout, unexplained)
    assert unexplained.problems == [
        "published version v3 (step 3) follows v2 (step 4) and step 3 is no replay"
    ]
    with metrics.open("a") as f:
        for s in (3, 4):
            f.write(json.dumps({"step": s, "epoch": 2, "replayed": 1}) + "\n")
    replayed = Audit()
    check_version_steps(layout, replayed)
    assert replayed.problems == []


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_audit_reports_each_kind_of_damage(
    one_process_storm: tuple[Storm, Audit], stray: subprocess.Popen
) -> None:
    """Runs after the storm tests (it damages their run): a check that cannot fail would prove nothing."""
    storm, _ = one_process_storm
    layout = storm.layout
    valid = plans.valid_plans(layout)
    last = valid[max(valid)]
    # a sample consumed twice, and one planned that no shard holds
    first, rows = last.takes[0], shards.ShardName.parse(last.shards[last.takes[0][0]])
    assert rows is not None
    extra = Plan(
        step=last.step + 1,
        epoch=last.epoch,
        shards=last.shards,
        takes=[
            [first[0], first[1], first[1] + 1],
            [first[0], rows.rows, rows.rows + 1],
        ],  # the second: a ghost
        samples=2,
    )
    assert create_record(layout.plan(extra.step, extra.epoch), extra)
    # a damaged ready shard, and a quarantined one without its reason
    ready = shards.list_ready(layout)
    _flip_last_byte(layout.ready_shard(ready[0].name))
    (layout.shards_quarantine / ready[1].name).write_bytes(layout.ready_shard(ready[1].name).read_bytes())
    # a step trained anew, and a lineage that trains a step twice
    with layout.metrics_file("trainer").open("a") as f:
        f.write(json.dumps({"step": 1, "epoch": 99, "replayed": 0}) + "\n")
    ckpt = max(p.parent for p in layout.checkpoints.glob("step-*/COMMITTED"))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["extra"]["train_state"]["lineage"].append(state["extra"]["train_state"]["lineage"][-1])
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    # LATEST on a damaged version, then moved back to an older one
    latest = weights.latest_version(layout)
    # a full version's safetensors, or a delta version's XOR files: a weight file its manifest seals either way
    _flip_last_byte(
        next(
            p for p in sorted(layout.weight_version(latest).iterdir()) if p.suffix in (".safetensors", ".zst")
        )
    )
    storm.sampler.sample()
    weights.write_latest(layout, weights.published_versions(layout)[0], 0)
    storm.sampler.sample()
    # the newest version stamped with a step before its predecessor's, one no restart replayed
    newest = layout.weight_version(weights.published_versions(layout)[-1]) / weights.MANIFEST
    manifest = json.loads(newest.read_text())
    manifest["step"] = 0
    newest.write_text(json.dumps(manifest))
    # a command nobody applied
    storm.commands.written.append(("never-applied", {"action": "set", "count": 1}))

    problems = "\n".join(audit(storm, orphan_grace_s=1.0).problems)
    for expected in (
        "samples in more than one valid plan",
        "planned samples in no shard",
        f"ready shard {ready[0].name} is not valid",
        f"quarantined shard {ready[1].name} has no reason file",
        "sample ids in more than one shard",
        "step 1 trained anew by epoch 99",
        "lineage",
        f"LATEST -> v{latest} does not verify",
        "LATEST went back",
        "(step 0) follows",
        "applied 0 times",
        "desired workers",
        f"orphan process {stray.pid}",
        "shardrl fsck exit 1",
    ):
        assert expected in problems, f"{expected!r} not reported:\n{problems}"
