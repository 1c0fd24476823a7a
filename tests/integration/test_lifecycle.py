"""The run's lifecycle with real processes (a node supervisor with one transformers-engine worker on the tiny model,
and trainer processes): trainer.total_steps is the run's budget over every trainer incarnation.

A trainer started with --max-steps 2 stops at step 2; restarted with --max-steps 5 it stops at step 3, the budget,
and writes RUN/finished.json; the supervisor sees it and exits 0 by itself, its worker drained; a trainer started
again on the finished run exits 0 at once with one line; `shardrl status` says the run is finished.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from buffer import heartbeats, plans
from buffer.status import read_finished

from . import _trainer_helpers as th
from ._rollout_helpers import ROOT, alive, make_run, spawn, stop, tail

TOTAL_STEPS = 3


@pytest.fixture(scope="module")
def model(tiny_model_untied: Path) -> Path:
    return Path(tiny_model_untied)


def _trainer(layout, log: Path, max_steps: int) -> subprocess.CompletedProcess[str]:
    cmd = th.command(1, *th.trainer_args(layout, "--max-steps", max_steps))
    th.run_ok(cmd, log, timeout_s=150)
    return subprocess.CompletedProcess(cmd, 0, log.read_text(errors="replace"), "")


def _status(run_dir: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "shardrl.cli", "status", str(run_dir), *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=th.env(), timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_budget_spans_incarnations_and_ends_the_run(tmp_path, model):
    run = make_run(
        tmp_path / "run",
        model,
        run={
            "heartbeat_interval_s": 0.5,
            "control_poll_s": 0.3,
            "lease_timeout_s": 5.0,
            "initial_workers": 1,
        },
        rollout={
            "engine": "hf",
            "prompts_per_batch": 4,
            "shard_samples": 8,
            "flush_interval_s": 0.5,
            "weights_poll_s": 0.5,
            "threads_per_worker": 1,
            "drain_deadline_s": 20.0,
            "max_backlog_samples": 16,
            "sampling": {"n": 2, "max_response_length": 4},
        },
        trainer={
            "total_steps": TOTAL_STEPS,
            "samples_per_step": 8,
            "max_staleness": 1000,
            "tensorboard": False,
        },
    )
    layout = run.layout
    sup_log = tmp_path / "supervisor.log"
    sup = spawn(["rollout_worker", "--run", str(layout.root), "--max-local-workers", "1"], sup_log)
    try:
        first = _trainer(layout, tmp_path / "trainer1.log", max_steps=2)
        assert heartbeats.load_trainer(layout).step == 2, first.stdout[-2000:]
        assert read_finished(layout) is None
        assert sup.poll() is None, f"supervisor exited before the run finished:\n{tail(sup_log)}"

        _trainer(layout, tmp_path / "trainer2.log", max_steps=5)
        assert heartbeats.load_trainer(layout).step == TOTAL_STEPS
        assert max(plans.valid_plan_files(layout)) == TOTAL_STEPS  # nothing planned past the budget
        done = read_finished(layout)
        assert done is not None and (done.step, done.total_steps) == (TOTAL_STEPS, TOTAL_STEPS)

        rc = sup.wait(timeout=60)  # by itself: nobody signals it
        assert rc == 0, tail(sup_log)
        assert "the run is finished: draining" in sup_log.read_text()
        (w,) = heartbeats.load_workers(layout).records
        assert w.state == "stopped" and not alive(w.pid)
    finally:
        stop(sup)

    again = _trainer(layout, tmp_path / "trainer3.log", max_steps=5)
    lines = [ln for ln in again.stdout.splitlines() if ln.strip()]
    assert lines == [
        f"trainer: run already finished at step {TOTAL_STEPS} (trainer.total_steps = {TOTAL_STEPS}); nothing to do"
    ]
    assert max(plans.valid_plan_files(layout)) == TOTAL_STEPS

    snap = json.loads(_status(layout.root, "--json"))
    assert snap["finished"]["step"] == TOTAL_STEPS and snap["trainer"]["state"] == "stopped"
    assert not snap["trainer"]["heartbeat_stale"]
    text = _status(layout.root)
    assert f"finished: trained step {TOTAL_STEPS} of trainer.total_steps {TOTAL_STEPS}" in text
    assert "vNone" not in text
