"""bench/e2e.py end to end at its smallest: the real supervisor, worker (hf engine) and trainer, in sync mode and
with staleness 1, two steps each; the JSON it writes is checked for shape and for what the staleness bounds imply
(never for timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 32  # two prompts x n = 16


@pytest.mark.slow
def test_e2e_bench_writes_both_modes_and_their_ratio(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "e2e.py"),
        "--engine",
        "hf",
        "--modes",
        "sync,1",
        "--steps",
        "2",
        "--samples-per-step",
        str(SAMPLES),
        "--dir",
        str(tmp_path),
        "--timeout-s",
        "400",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())

    assert set(result["modes"]) == {"sync", "1"}
    for name, mode in result["modes"].items():
        assert "error" not in mode, mode
        assert mode["engine"] == "hf"
        assert mode["trained_steps"] == 1  # two steps, the first one the warm-up
        assert mode["samples_consumed"] == SAMPLES
        assert mode["samples_per_s"] > 0
        assert 0 <= mode["trainer_idle_frac"] <= 1
        assert 0 <= mode["worker_paused_frac"] <= 1
        assert mode["trainer_idle_source"] == "trainer metrics wait_s"
        assert sum(mode["staleness_hist"].values()) == SAMPLES, name
        # the response tokens consumed: the samples' mean length (at least a token) over the window
        assert mode["consumed_response_len_mean"] >= 1
        assert mode["consumed_tokens_per_s"] == pytest.approx(
            mode["consumed_response_len_mean"] * SAMPLES / mode["window_s"]
        )
        # the workers' own rate inside the window, at the consumed samples' mean length
        assert mode["generated_samples_per_s"] == pytest.approx(
            mode["worker_tokens_per_s"] * len(mode["workers_seen"]) / mode["consumed_response_len_mean"]
        )
    # sync consumes only samples of the trainer's newest weights; staleness 1 never anything older
    assert set(result["modes"]["sync"]["staleness_hist"]) == {"0"}
    assert set(result["modes"]["1"]["staleness_hist"]) <= {"0", "1"}
    assert result["ratio"] == pytest.approx(
        result["modes"]["1"]["samples_per_s"] / result["modes"]["sync"]["samples_per_s"]
    )
    assert set(result["ratio_vs_sync_generated"]) <= {"1"}
    assert "sync" in done.stdout and "samples/s" in done.stdout  # the table was printed
    assert not any(p.is_dir() for p in tmp_path.iterdir()), "run directories are removed without --keep"
