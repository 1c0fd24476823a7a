"""The trainer's step line and time split (trainer/metrics.py, trainer/loop.py) and the numbering of weight versions
at start (trainer/versions.py): LATEST is believed only when it names a version that is there."""

from __future__ import annotations

from pathlib import Path

from buffer.heartbeats import load_trainer
from buffer.layout import RunLayout
from buffer.run import init_run
from buffer.weights import commit_version, staging_dir, write_latest
from trainer.feed import StepBatch
from trainer.loop import PHASES, Reporter, TrainState, step_metrics
from trainer.metrics import step_line
from trainer.versions import highest_version_dir, latest_problem, starting_version

from .buffer_helpers import make_layout, stub_config


def test_step_line_shows_loss_grad_norm_lr_time_and_memory() -> None:
    m = {
        "samples": 32,
        "loss": -0.0474,
        "grad_norm": 3.354,
        "lr": 1e-3,
        "reward_mean": 0.5,
        "step_s": 1.25,
        "wait_frac": 0.2,
        "compute_frac": 0.7,
        "publish_frac": 0.1,
        "peak_mem_gib": 0.62,
    }
    line = step_line(7, m)
    for part in (
        "step 7",
        "loss -0.0474",
        "grad-norm 3.354",
        "lr 1.00e-03",
        "1.25 s (wait 20%, publish 10%)",
    ):
        assert part in line, (part, line)
    assert line.endswith("peak 0.62 GiB")
    assert step_line(8, {"samples": 0, "dropped_stale": 48, "step_s": 0.01}).startswith(
        "step 8 | no samples: dropped 48 stale"
    )


def test_step_metrics_split_the_wall_time_into_parts_that_sum_to_it() -> None:
    batch = StepBatch([], dropped=16, replayed=False)
    times = {"wait": 3.0, "plan": 0.5, "load": 0.5, "checkpoint": 1.0, "prefetch": 9.0}
    out = step_metrics(batch, {}, version=2, times=times)
    assert out["step_s"] == 5.0 and out["wait_frac"] == 0.6 and out["compute_s"] == 0.0
    assert abs(sum(out[f"{p}_frac"] for p in PHASES) - 1) < 1e-12
    assert out["prefetch_s"] == 9.0  # off the step's path: not part of step_s
    assert out["samples"] == 0 and out["dropped_stale"] == 16 and "reward_mean" not in out


def _commit(layout: RunLayout, version: int) -> None:
    staging = staging_dir(layout, version)
    (staging / "model.safetensors").write_bytes(b"\0" * 8)
    commit_version(layout, version, staging, step=version, dtype="float32")


def test_a_latest_naming_a_missing_version_is_not_adopted(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    assert starting_version(layout, 0) == 0 and latest_problem(layout) is None
    _commit(layout, 1)
    _commit(layout, 2)
    assert latest_problem(layout) is None and starting_version(layout, 0) == 2
    write_latest(layout, 99, step=0)
    problem = latest_problem(layout)
    assert problem is not None and "v000099" in problem
    assert starting_version(layout, 0) == 2  # publishes v3, not v100
    assert starting_version(layout, 5) == 5  # a checkpoint that knows of a later version wins
    (layout.weights / "v000004").mkdir()  # a version directory without a manifest: its number is still taken
    assert highest_version_dir(layout) == 4 and starting_version(layout, 0) == 4
    layout.latest_pointer.write_text("{garbage")
    problem = latest_problem(layout)
    assert problem is not None and "LATEST" in problem


def test_after_a_step_the_trainer_record_says_no_step_is_on_its_way(tmp_path: Path) -> None:
    """A synchronous worker waits while the record says "training"; once a step's metrics are logged none is
    computing, and the record must say so at once, not at the feeder's first status round a second later."""
    run = init_run(tmp_path / "run", stub_config(tmp_path, trainer={"tensorboard": False}))
    state = TrainState(step=3, version=3)
    report = Reporter(run, epoch=1, state=state)
    report.status("training", state, {})
    rec = load_trainer(run.layout)
    assert rec is not None and rec.state == "training"

    report.step(3, {"samples": 8, "loss": 0.1}, state, {}, "checkpoint of step 3")
    rec = load_trainer(run.layout)
    assert rec is not None and (rec.state, rec.step, rec.waiting) == ("waiting", 3, "checkpoint of step 3")
