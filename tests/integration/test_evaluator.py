"""The evaluator process (`python -m rollout_worker --eval`) on a tiny run with published weight versions: one eval
record per due version with its version and step, a damaged version skipped with one line, a restart resuming, an
end once the run is finished."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from buffer import metrics, weights
from buffer.run import Run
from buffer.status import mark_finished
from rollout_worker.evaluator import is_due, pending, summarize

from ._common import publish_model
from ._rollout_helpers import ROOT, make_run

EVAL = ["--eval", "--eval.every", "1", "--eval.base", "false", "--eval.max_prompts", "20"]


def _evaluate(run: Run, *, once: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-P", "-m", "rollout_worker", "--run-dir", str(run.layout.root), *EVAL]
    cmd += ["--once"] if once else []
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture
def run(tmp_path: Path, tiny_model_tied: Path) -> Run:
    r = make_run(
        tmp_path / "run",
        tiny_model_tied,
        rollout={"engine": "hf", "sampling": {"max_response_length": 2}},
        data={"max_prompt_length": 32},
    )
    for v in (1, 2):
        publish_model(r.layout, tiny_model_tied, v, step=v * 10)
    return r


def test_two_published_versions_make_two_records(run: Run) -> None:
    out = _evaluate(run)
    assert out.returncode == 0, out.stderr
    recs = metrics.read_all(run.layout.metrics_file("eval"))
    assert [(r["version"], r["step"]) for r in recs] == [(1, 10), (2, 20)]
    for r in recs:
        assert r["prompts"] == 20 and 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["reward_mean"] <= 1.0
    # the same weights, greedy: the same score
    assert recs[0]["accuracy"] == recs[1]["accuracy"]
    # the best version is the first that scored it (an equal score does not replace it), kept from retention
    assert weights.best_version(run.layout) == (1, recs[0]["accuracy"])
    # without --once it follows the run until the run is finished; a restart scores nothing twice
    mark_finished(run.layout, step=20, total_steps=20, published_version=2, epoch=None)
    again = _evaluate(run, once=False)
    assert again.returncode == 0, again.stderr
    assert len(metrics.read_all(run.layout.metrics_file("eval"))) == 2


def test_damaged_version_is_skipped_with_one_line(run: Run) -> None:
    (f,) = run.layout.weight_version(1).glob("*.safetensors")
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the checksum tells
    f.write_bytes(bytes(data))
    out = _evaluate(run)
    assert out.returncode == 0, out.stderr
    recs = metrics.read_all(run.layout.metrics_file("eval"))
    assert [r["version"] for r in recs] == [2]
    lines = [line for line in out.stderr.splitlines() if "v1 skipped" in line]
    assert len(lines) == 1 and "sha256" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_due_versions(run: Run) -> None:
    cfg = run.config.model_copy(update={"eval": run.config.eval.model_copy(update={"every": 2})})
    assert [v for v in range(5) if is_due(v, cfg)] == [0, 2, 4]
    assert pending(run, set()) == [0]  # v1, v2 published; default every 5: only the base
    assert pending(run, {0}, latest_too=True) == [2]


def test_summary_accuracy_only_with_a_full_score() -> None:
    assert summarize([1.0, 0.1, 0.0, 1.0], 1.0) == {"reward_mean": 0.525, "accuracy": 0.5}
    assert summarize([0.3, 0.5], None) == {"reward_mean": 0.4}
    assert summarize([], 1.0) == {}
