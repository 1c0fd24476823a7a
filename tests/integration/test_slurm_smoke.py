"""The test Slurm cluster behaves like the real clusters the deploy scripts target.

Each test submits a real batch script and checks what it wrote: two virtual nodes run one task each, ``--gres=gpu``
sets ``CUDA_VISIBLE_DEVICES``, ``scancel --signal=TERM --batch`` reaches the batch script's trap (the drain path of the
sbatch scripts), and a plain ``scancel`` ends a job even when it ignores SIGTERM.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\nset -u\n" + body)
    path.chmod(0o755)
    return path


def _wait_for_file(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{path} was not written within {timeout:.0f}s")


def test_two_nodes_run_one_task_each(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = _script(
        tmp_path / "job.sh",
        f"srun --ntasks-per-node=1 bash -c 'echo \"$SLURMD_NODENAME $SLURM_NNODES\" > {tmp_path}/task-$SLURM_PROCID'\n",
    )
    job = slurm_cluster.sbatch(["-p", "cheap", "--nodes=2", "-o", f"{tmp_path}/out.txt", str(script)])
    assert slurm_cluster.wait_state(job, DONE, timeout=60) == ["COMPLETED"], (
        tmp_path / "out.txt"
    ).read_text()

    tasks = sorted(p.read_text().split() for p in tmp_path.glob("task-*"))
    assert tasks == [["vm1", "2"], ["vm2", "2"]]
    info = slurm_cluster.job_info(job)
    assert (info["NodeList"], info["NumNodes"], info["ExitCode"]) == ("vm[1-2]", "2", "0:0")


@pytest.mark.parametrize(("gpus", "expected"), [(1, "0"), (2, "0,1")])
def test_gres_gpu_sets_cuda_visible_devices(
    slurm_cluster: SlurmCluster, tmp_path: Path, gpus: int, expected: str
) -> None:
    out = tmp_path / "cvd"
    script = _script(tmp_path / "job.sh", f'echo "${{CUDA_VISIBLE_DEVICES:-unset}}" > {out}\n')
    job = slurm_cluster.sbatch(["-p", "a100", f"--gres=gpu:{gpus}", str(script)])
    assert slurm_cluster.wait_state(job, DONE, timeout=60) == ["COMPLETED"]
    assert out.read_text().strip() == expected
    assert slurm_cluster.job_info(job)["Partition"] == "a100"


def test_scancel_term_batch_reaches_the_trap(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = _script(
        tmp_path / "job.sh",
        f"trap 'echo drained > {tmp_path}/term; exit 0' TERM\n"
        f"echo $$ > {tmp_path}/started\n"
        "while true; do sleep 0.1; done\n",
    )
    job = slurm_cluster.sbatch([str(script)])
    _wait_for_file(tmp_path / "started")

    slurm_cluster.scancel(job, "--signal=TERM", "--batch")
    assert _wait_for_file(tmp_path / "term", timeout=15).strip() == "drained"
    # The trap's clean exit is the job's result: a signal sent with --signal does not cancel the job by itself.
    assert slurm_cluster.wait_state(job, DONE, timeout=15) == ["COMPLETED"]


def test_plain_scancel_ends_a_job_that_ignores_term(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    beat = tmp_path / "beat"
    script = _script(
        tmp_path / "job.sh",
        f"trap 'echo term >> {tmp_path}/term' TERM\n"  # records SIGTERM and keeps running: SIGKILL must follow
        f"while true; do date +%s.%N > {beat}; sleep 0.1; done\n",
    )
    job = slurm_cluster.sbatch([str(script)])
    _wait_for_file(beat)

    start = time.monotonic()
    slurm_cluster.scancel(job)
    assert slurm_cluster.wait_state(job, "CANCELLED", timeout=30) == ["CANCELLED"]
    # Killed, not just marked cancelled: the heartbeat stops, within KillWait (5 s here) of the SIGTERM.
    last, changed = beat.read_text(), time.monotonic()
    while time.monotonic() - changed < 1.5:
        assert time.monotonic() - start < 20, "the job's script still runs after scancel"
        time.sleep(0.1)
        if beat.read_text() != last:
            last, changed = beat.read_text(), time.monotonic()
    assert (tmp_path / "term").read_text().startswith("term")
