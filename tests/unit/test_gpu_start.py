"""One vLLM engine start at a time per GPU (``rollout_worker/engines/gpu_start.py``), with real processes, real
``flock`` files and a real SIGKILL.  No GPU is needed: the lock is about the GPU's name, and what it prevents (two
engines profiling one GPU's memory at once) is described in the module."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout_worker.engines.gpu_start import engine_gpus, engine_start, named_gpus, one_start_per_gpu

ROOT = Path(__file__).resolve().parents[2]
# A process that takes GPU "0"'s start lock, says so in a file, and holds it until a file appears.
HOLDER = """
import sys, time
from pathlib import Path
from rollout_worker.engines.gpu_start import one_start_per_gpu
where, log, release = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
with one_start_per_gpu(["0"], where=where):
    with log.open("a") as f:
        f.write("holder in\\n")
    while not release.exists():
        time.sleep(0.02)
    with log.open("a") as f:
        f.write("holder out\\n")
"""


def _start_holder(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    log, release = tmp_path / "order.log", tmp_path / "release"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "locks"), str(log), str(release)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 60
    while not (log.exists() and "holder in" in log.read_text()):
        assert proc.poll() is None, "the holder died before taking the lock"
        assert time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.02)
    return proc, log, release


def test_the_gpus_an_engine_uses_are_the_first_ones_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_gpus(1, "3,1,2") == ["3"]
    assert engine_gpus(2, "3,1,2") == ["3", "1"]
    assert engine_gpus(1, "GPU-8f2c,GPU-77aa") == ["GPU-8f2c"]
    # as CUDA reads the variable: nothing after an entry that names no device
    assert named_gpus(" 2, 0 ,-1,3") == ["2", "0"]
    assert named_gpus("") == [] and named_gpus("-1") == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_gpus(2) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert engine_gpus(1) == ["5"]


@pytest.mark.proc
def test_a_second_start_on_the_same_gpu_waits_for_the_first(tmp_path: Path) -> None:
    proc, log, release = _start_holder(tmp_path)
    try:
        # the holder lets go only after this process has started waiting
        threading.Timer(0.5, release.touch).start()
        with one_start_per_gpu(["0"], where=tmp_path / "locks"), log.open("a") as f:
            f.write("second in\n")
    finally:
        release.touch()
        proc.wait(timeout=60)
    assert log.read_text().splitlines() == ["holder in", "holder out", "second in"]


@pytest.mark.proc
def test_another_gpu_does_not_wait_and_a_stuck_start_is_waited_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc, log, release = _start_holder(tmp_path)
    try:
        with caplog.at_level(logging.WARNING), one_start_per_gpu(["1"], wait_s=0, where=tmp_path / "locks"):
            assert not caplog.records, "GPU 1's lock is free while GPU 0's is held"
        with (
            caplog.at_level(logging.WARNING),
            one_start_per_gpu(["1", "0"], wait_s=0.2, where=tmp_path / "locks"),
        ):
            assert "holder out" not in log.read_text(), "went ahead beside the start it waited for"
        assert [r.getMessage().split(":")[0] for r in caplog.records] == ["GPU 0"]
        assert "starting beside it" in caplog.records[0].getMessage()
    finally:
        release.touch()
        proc.wait(timeout=60)


@pytest.mark.proc
def test_a_killed_holder_leaves_no_lock_behind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proc, _, _ = _start_holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    with caplog.at_level(logging.WARNING), one_start_per_gpu(["0"], wait_s=0, where=tmp_path / "locks"):
        pass
    assert not caplog.records


def test_the_cpu_build_takes_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDRL_GPU_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with engine_start({"tensor_parallel_size": 1}, cpu=True):
        pass
    assert not (tmp_path / "locks").exists()
    with engine_start({"tensor_parallel_size": 2}, cpu=False):
        assert sorted(p.name for p in (tmp_path / "locks").glob("gpu-*")) == [
            "gpu-4.start.lock",
            "gpu-5.start.lock",
        ]
