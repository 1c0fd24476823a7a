"""The deploy scripts, unmodified, on a real Slurm (two virtual nodes, partitions `cheap` and `a100`).

A rollout job on two nodes and a trainer job run together against one run directory: weights get published and
shards consumed; `echo` into control.json adds a worker on the second node; `scancel` of the rollout job leaves no
partial shard and no orphan process; a resubmitted rollout job continues; a requeued trainer job resumes from its
checkpoint without consuming any sample twice.  CPU config, tiny model, the transformers engine (lighter than
starting two vLLM engines on a 2-core machine; the vLLM worker path has its own tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from buffer import control, plans, shards, weights
from buffer.config import load_toml
from buffer.heartbeats import LIVE_STATES, read_trainer, read_workers
from buffer.layout import RunLayout
from shardrl.runs import init_run

from .slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _wait(
    cond: Callable[[], bool], what: str, timeout: float, logs: Path, alive: Callable[[], bool] = lambda: True
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        if cond():
            return
        time.sleep(1.0)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))
    why = "a job ended" if not alive() else f"timed out after {timeout:.0f}s"
    raise AssertionError(f"{why} while waiting for {what}\n{tails}")


def _rollout_pids(run: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"rollout_worker.*{run}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _all_ready_shards_valid(layout: RunLayout) -> int:
    ready = shards.list_ready(layout)
    for s in ready:
        shards.read_shard(layout.ready_shard(s.name))
    return len(ready)


def _consumed_once(layout: RunLayout) -> int:
    seen: set[str] = set()
    for p in plans.valid_plans(layout).values():
        ids = [*plans.sample_ids_of(layout, p), *plans.sample_ids_of(layout, p, "drops")]
        assert not seen.intersection(ids), f"plan step {p.step} consumes samples another plan consumed"
        seen.update(ids)
    return len(seen)


def _make_run(tmp_path: Path, **extra: str) -> Path:
    cfg = load_toml(
        ROOT / "shardrl" / "configs" / "demo.toml",
        {
            **extra,
            "rollout.engine": "hf",
            "rollout.prompts_per_batch": "8",
            "rollout.shard_samples": "32",
            "rollout.flush_interval_s": "2",
            "rollout.sampling.n": "4",
            "rollout.max_backlog_samples": "64",
            "trainer.samples_per_step": "32",
            "trainer.save_every": "2",
            "trainer.max_staleness": "100",
            "run.lease_timeout_s": "6",
        },
    )
    run = tmp_path / "run"
    init_run(run, cfg)
    return run


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    return _make_run(tmp_path)


def _job_env() -> dict[str, str]:
    return {
        "SHARDRL_PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }


def test_rollout_and_trainer_jobs_together(slurm_cluster: SlurmCluster, run_dir: Path) -> None:
    layout = RunLayout.of(run_dir)
    env = _job_env()
    out = run_dir / "logs"
    trainer = slurm_cluster.sbatch(
        [
            "--partition=a100",
            f"--output={out}/sbatch-train-%j.out",
            str(ROOT / "deploy/trainer_only.sh"),
            str(run_dir),
        ],
        env,
    )
    rollout = slurm_cluster.sbatch(
        [
            "--partition=cheap",
            "--nodes=2",
            f"--output={out}/sbatch-roll-%j.out",
            str(ROOT / "deploy/rollout_only.sh"),
            str(run_dir),
        ],
        env,
    )

    def running() -> bool:
        return all(slurm_cluster.squeue_states(j) in (["RUNNING"], ["PENDING"]) for j in (trainer, rollout))

    # weights get published and shards consumed
    _wait(lambda: weights.latest_version(layout) >= 2, "two published weight versions", 300, out, running)
    assert _consumed_once(layout) >= 64
    # one worker (a worker between batches may be "reloading" the version just published)
    assert {w["id"] for w in read_workers(layout) if w.get("state") in LIVE_STATES} == {"w0"}

    # echo a command: the second worker comes up, on the other node
    (layout.control_file).write_text('{"action":"add","count":1}\n')
    _wait(lambda: control.read_state(layout).desired == 2, "the add command applied", 30, out)
    _wait(
        lambda: (
            len({w["host"] for w in read_workers(layout)} | {w["slot"] for w in read_workers(layout)}) >= 2
            and sum(1 for w in read_workers(layout) if w.get("state") in LIVE_STATES) == 2
        ),
        "two workers running",
        120,
        out,
    )
    sups = json.loads(
        subprocess.run(
            [sys.executable, "-m", "shardrl.cli", "status", str(run_dir), "--json"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout
    )["supervisors"]
    assert len({s["id"] for s in sups}) == 2  # one supervisor per node

    # scancel the rollout job: workers drain, nothing partial, no orphan
    slurm_cluster.scancel(rollout)
    slurm_cluster.wait_state(rollout, DONE, timeout=60)
    _wait(lambda: not _rollout_pids(run_dir), "rollout processes to exit", 30, out)
    before = _all_ready_shards_valid(layout)
    assert not any(layout.shards_tmp.iterdir()), "a drained worker left a temporary shard"

    # resubmitting continues the run
    rollout2 = slurm_cluster.sbatch(
        [
            "--partition=cheap",
            "--nodes=2",
            f"--output={out}/sbatch-roll2-%j.out",
            str(ROOT / "deploy/rollout_only.sh"),
            str(run_dir),
        ],
        env,
    )
    _wait(lambda: len(shards.list_ready(layout)) > before, "new shards from the resubmitted job", 180, out)

    # requeue the trainer: it resumes from its checkpoint and continues, consuming nothing twice
    step_before = int((read_trainer(layout) or {}).get("step", 0))
    _wait(
        lambda: any(layout.checkpoint_commit(s).exists() for s in range(2, 1000, 2)), "a checkpoint", 120, out
    )
    slurm_cluster.run("scontrol", "requeue", str(trainer))
    _wait(
        lambda: "resumed from checkpoint" in "".join(p.read_text() for p in out.glob("trainer-*.log")),
        "the requeued trainer to resume",
        180,
        out,
    )
    _wait(
        lambda: int((read_trainer(layout) or {}).get("step", 0)) > step_before + 1,
        "training to continue",
        180,
        out,
    )
    _consumed_once(layout)
    assert sorted(plans.valid_plans(layout)) == list(range(1, max(plans.valid_plans(layout)) + 1))

    slurm_cluster.scancel(rollout2)
    slurm_cluster.scancel(trainer)
    slurm_cluster.wait_state(rollout2, DONE, timeout=60)
    slurm_cluster.wait_state(trainer, DONE, timeout=60)
    _wait(lambda: not _rollout_pids(run_dir), "rollout processes to exit", 30, out)
    _all_ready_shards_valid(layout)


def test_both_roles_in_one_allocation(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """deploy/train_ppo_slurm.sh: the first node trains, the second rolls out; the job ends with the trainer.

    The step budget is given on the sbatch line: trainer overrides must reach the trainer, rollout ones the fleet."""
    run_dir = _make_run(tmp_path)
    layout = RunLayout.of(run_dir)
    out = run_dir / "logs"
    job = slurm_cluster.sbatch(
        [
            "--partition=cheap",
            "--nodes=2",
            f"--output={out}/sbatch-ppo-%j.out",
            str(ROOT / "deploy/train_ppo_slurm.sh"),
            str(run_dir),
            "--max-steps",
            "3",
            "--rollout.drain_deadline_s=15",
        ],
        _job_env(),
    )
    states = slurm_cluster.wait_state(job, DONE, timeout=400)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(out.glob("*")))
    assert states == ["COMPLETED"], logs
    trainer = read_trainer(layout) or {}
    assert trainer.get("step") == 3 and trainer.get("state") == "stopped", logs
    assert weights.latest_version(layout) == 3
    assert sorted(plans.valid_plans(layout)) == [1, 2, 3]
    _consumed_once(layout)
    assert {w.get("state") for w in read_workers(layout)} <= {"stopped"}, read_workers(layout)
    _wait(lambda: not _rollout_pids(run_dir), "rollout processes to exit", 30, out)
    assert _all_ready_shards_valid(layout) >= 1
    assert not any(layout.shards_tmp.iterdir())
