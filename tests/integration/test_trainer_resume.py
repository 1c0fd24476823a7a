"""Crash safety of the trainer: SIGKILL at random moments, restarts at 1 and 2 ranks, and a fenced zombie.

The audit after the last restart, from the run directory alone:
- the valid plans are steps 1..N, and no sample is in two of them (trained or dropped);
- every sample of the shards ended up in a plan (nothing lost);
- the final checkpoint's lineage ([epoch, first, last] per incarnation) covers 1..N exactly once, each segment's
  incarnation logged training those steps, the last incarnation trained every step after its resume checkpoint,
  and the optimizer took exactly N steps (a step trained twice into the same weights would show as more);
- LATEST only ever increased, also across changes of world size, and the last version holds step N.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from buffer import shards
from buffer.layout import RunLayout
from buffer.plans import sample_ids_of, valid_plan_files, valid_plans
from buffer.weights import latest_version, verify_version
from trainer.checkpoint import latest_complete_checkpoint

from ._trainer_helpers import (
    adam_steps,
    checkpoint_tensors,
    command,
    env,
    kill_tree,
    make_run,
    metrics,
    run_ok,
    start,
    synth,
    tail,
    trainer_args,
    trainer_state,
    wait_for,
)

SAMPLES_PER_STEP = 32
N_STEPS = 20


class Harness:
    """Feeds shards like rollout workers would (one step's worth ahead of the planned steps, so trainers keep
    alternating between waiting and training), and checks on every poll that LATEST never goes back."""

    def __init__(self, layout: RunLayout, held: Path):
        self.layout, self.held = layout, held
        held.mkdir()
        for sh in shards.list_ready(layout):
            os.rename(layout.ready_shard(sh.name), held / sh.name)
        self.waiting = sorted(held.iterdir())  # in the writer's sequence order
        self.seen = [latest_version(layout)]

    def release(self, n: int = 1) -> None:
        for path in self.waiting[:n]:
            os.rename(path, self.layout.ready_shard(path.name))
        self.waiting = self.waiting[n:]

    def poll(self) -> None:
        v = latest_version(self.layout)
        assert v >= self.seen[-1], f"LATEST went back from {self.seen[-1]} to {v}"
        if v != self.seen[-1]:
            self.seen.append(v)
        released = N_STEPS - len(self.waiting)
        if released <= max(valid_plans(self.layout), default=0):
            self.release()

    def until(self, cond: Any, timeout_s: float, what: str) -> None:
        def check() -> bool:
            self.poll()
            return bool(cond())

        wait_for(what, check, timeout_s, every=0.1)


def _records_now(layout: RunLayout) -> int:
    return len(metrics(layout))


def _incarnation(
    layout: RunLayout, watch: Harness, rng: random.Random, nproc: int, log: Path, kill: str, **kw: Any
) -> None:
    """One trainer incarnation.  kill = "after-step": SIGKILL at a random moment after its first logged step;
    "anytime": at a random moment from its start (start-up, resume, replay...); "never": run to its max steps."""
    before = _records_now(layout)
    args = trainer_args(layout, *kw.get("args", []))
    proc = start(command(nproc, *args), log)
    try:
        if kill == "never":
            watch.until(lambda: proc.poll() is not None, 240, f"trainer x{nproc} to finish")
            assert proc.returncode == 0, tail(log)
            return
        if kill == "after-step":
            watch.until(
                lambda: _records_now(layout) > before, 120, f"a step of trainer x{nproc}\n{tail(log)}"
            )
            delay = rng.uniform(0.0, 1.5)
        else:
            delay = rng.uniform(1.0, 14.0)
        deadline = time.monotonic() + delay
        watch.until(
            lambda: time.monotonic() > deadline or proc.poll() is not None, delay + 5, "the kill time"
        )
        assert proc.poll() is None, f"trainer x{nproc} exited before the kill:\n{tail(log)}"
    finally:
        kill_tree(proc)
        watch.poll()


def _checkpoint_world(layout: RunLayout) -> tuple[int, int]:
    step = latest_complete_checkpoint(layout)
    assert step is not None
    return step, int(trainer_state(layout, step)["world_size"])


def _audit(layout: RunLayout, tmp: Path) -> None:
    valid = valid_plans(layout)
    assert sorted(valid) == list(range(1, N_STEPS + 1))
    planned = [
        s for p in valid.values() for s in sample_ids_of(layout, p) + sample_ids_of(layout, p, "drops")
    ]
    assert len(planned) == len(set(planned)), "a sample is in two plans"
    assert all(sample_ids_of(layout, p, "drops") == [] for p in valid.values())
    everything = {s for sh in shards.list_ready(layout) for s in shards.sample_ids(layout, sh.name)}
    assert set(planned) == everything, "samples lost or invented"

    final = latest_complete_checkpoint(layout)
    assert final == N_STEPS
    lineage = trainer_state(layout, final)["extra"]["train_state"]["lineage"]
    segments = [seg for seg in lineage if seg[1] <= seg[2]]
    covered = [s for _, first, last in segments for s in range(first, last + 1)]
    assert covered == list(range(1, N_STEPS + 1)), lineage
    recs = metrics(layout)
    for epoch, first, last in segments:
        logged = {r["step"] for r in recs if r["epoch"] == epoch}
        assert set(range(first, last + 1)) <= logged, (epoch, first, last, sorted(logged))
    last_epoch = max(r["epoch"] for r in recs)
    mine = [r for r in recs if r["epoch"] == last_epoch]
    resumed = mine[0]["resumed_from"]
    assert [r["step"] for r in mine] == list(range(resumed + 1, N_STEPS + 1))
    assert segments[-1] == [last_epoch, resumed + 1, N_STEPS]
    assert adam_steps(checkpoint_tensors(layout, final, tmp), "actor") == {N_STEPS}

    latest = latest_version(layout)
    assert verify_version(layout, latest, checksums=True).step == N_STEPS


@pytest.mark.slow
def test_sigkill_restarts_across_world_sizes_lose_and_duplicate_nothing(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    seed = random.randrange(1 << 30)
    print(f"kill schedule seed {seed}")
    rng = random.Random(seed)
    layout = make_run(
        tmp_path / "run",
        tiny_model_tied,
        trainer__samples_per_step=SAMPLES_PER_STEP,
        trainer__save_every=3,
        trainer__keep_checkpoints=2,
        run__keep_weight_versions=2,
    )
    synth(layout, shards=N_STEPS, samples=SAMPLES_PER_STEP)
    watch = Harness(layout, tmp_path / "held")
    logs = iter(tmp_path / f"inc{i}.log" for i in range(100))

    # A clean 1-rank start, then a 2-rank incarnation that resumes from the 1-rank checkpoint and is killed.
    _incarnation(layout, watch, rng, 1, next(logs), "never", args=["--max-steps", 2])
    assert _checkpoint_world(layout) == (2, 1)
    _incarnation(layout, watch, rng, 2, next(logs), "after-step")
    assert [r["resumed_from"] for r in metrics(layout) if r["epoch"] == 2][:1] == [2]
    # Kills at any moment (start-up, replay, publish, checkpoint...), at both sizes.
    _incarnation(layout, watch, rng, 1, next(logs), "anytime")
    _incarnation(layout, watch, rng, 2, next(logs), "anytime")
    _incarnation(layout, watch, rng, 1, next(logs), "after-step")
    # A clean 2-rank stretch, then a 1-rank incarnation that resumes from the 2-rank checkpoint and is killed.
    _incarnation(layout, watch, rng, 2, next(logs), "never", args=["--max-steps", 1])
    step, world = _checkpoint_world(layout)
    assert world == 2
    before = _records_now(layout)
    _incarnation(layout, watch, rng, 1, next(logs), "after-step")
    assert metrics(layout)[before]["resumed_from"] == step

    # The last incarnation finishes the data: it replays what was planned after its checkpoint, then plans on.
    watch.release(N_STEPS)
    step = latest_complete_checkpoint(layout) or 0
    assert step < N_STEPS, "the kill schedule left nothing for the final incarnation"
    _incarnation(layout, watch, rng, 2, next(logs), "never", args=["--max-steps", N_STEPS - step])
    assert len(watch.seen) > 3
    _audit(layout, tmp_path)


@pytest.mark.slow
def test_a_second_incarnation_fences_out_the_first(tmp_path: Path, tiny_model_tied: Path) -> None:
    layout = make_run(tmp_path / "run", tiny_model_tied, trainer__samples_per_step=16, trainer__save_every=2)
    synth(layout, shards=60, samples=16)  # more than the first incarnation can use before it is fenced
    zombie_log = tmp_path / "zombie.log"
    zombie = start(command(2, *trainer_args(layout)), zombie_log)
    try:
        wait_for(
            f"the first incarnation to train\n{tail(zombie_log)}", lambda: _records_now(layout) >= 1, 120
        )
        refused = subprocess.run(
            command(1, *trainer_args(layout, "--max-steps", 2)),
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert refused.returncode == 2 and "pass --takeover" in refused.stderr, refused.stderr[-3000:]
        run_ok(command(1, *trainer_args(layout, "--max-steps", 2, "--takeover")), tmp_path / "second.log")
        rc = zombie.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the fenced incarnation kept running:\n{tail(zombie_log)}") from None
    finally:
        kill_tree(zombie)
    out = zombie_log.read_text()
    assert rc == 0, out[-3000:]  # a clean stop: torchrun prints no traceback
    assert "Traceback" not in out, out[-3000:]
    ours = [line for line in out.splitlines() if line.startswith("trainer: ")]
    assert len(ours) == 1 and "newer trainer incarnation (epoch 2) took over from epoch 1" in ours[0], out[
        -3000:
    ]
    assert 'File "' + str(Path(__file__).resolve().parents[2] / "trainer") not in out  # no traceback of ours

    claim = json.loads(layout.epoch(2).read_text())
    zombie_plans = sorted(int(p.name[5:13]) for p in layout.plans.glob("s*/step-*.e1.json"))
    assert zombie_plans, "the first incarnation planned nothing"
    # The zombie announces a step, checks its fence, then creates that step's plan: a claim landing inside that
    # window leaves one plan past the claim's max_step (the fence refuses every later one). Such a plan is never
    # valid, whatever the timing: that is the guarantee, so it is what is checked.
    late = [s for s in zombie_plans if s > claim["max_step"]]
    assert len(late) <= 1, (
        f"the fenced incarnation planned steps {late} after the claim (max_step {claim['max_step']})"
    )
    valid_files = valid_plan_files(layout)
    assert all(valid_files[s].epoch == 2 for s in late if s in valid_files), "a fenced plan counts as valid"
    valid = valid_plans(layout)
    assert sorted(valid) == list(range(1, max(valid) + 1))
    planned = [
        s for p in valid.values() for s in sample_ids_of(layout, p) + sample_ids_of(layout, p, "drops")
    ]
    assert len(planned) == len(set(planned))
    second = [r for r in metrics(layout) if r["epoch"] == 2]
    assert [r["step"] for r in second] == [second[0]["resumed_from"] + 1, second[0]["resumed_from"] + 2]
