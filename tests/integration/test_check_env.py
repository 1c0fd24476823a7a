"""deploy/check_env.sh: its storage checks pass on a writable run directory, fail on one that cannot be created, and
under srun on two nodes it compares the nodes' library versions and catches a mismatch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from buffer.layout import RunLayout

from .slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "check_env.sh"
LINE = re.compile(r"^(PASS|FAIL|SKIP) \[(\S+)\] ([a-z-]+): (.*)$")


def _run(run_dir: Path) -> tuple[int, dict[str, tuple[str, str]]]:
    res = subprocess.run(
        [str(SCRIPT), str(run_dir)],
        env={"PATH": "/usr/bin:/bin", "SHARDRL_PYTHON": sys.executable, "CHECK_ENV_WAIT": "5"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = res.stdout.splitlines()
    assert lines, res.stderr
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), f"lines not in the PASS|FAIL|SKIP [node] check: detail format:\n{res.stdout}"
    return res.returncode, {m.group(3): (m.group(1), m.group(4)) for m in parsed if m}


def test_local_run_passes_and_records_versions(tmp_path: Path) -> None:
    rc, checks = _run(tmp_path)

    assert checks["python"][0] == "PASS", checks["python"]
    assert checks["storage"][0] == "PASS", checks["storage"]
    assert checks["versions"][0] == "PASS" and "torch=" in checks["versions"][1]
    assert checks["visibility"][0] == checks["versions-match"][0] == "SKIP"  # one node
    assert not [c for c, (status, _) in checks.items() if status == "FAIL"]
    assert rc == 0
    (record,) = RunLayout.of(tmp_path).logs.glob("check_env/local.*/*.versions")
    assert record.read_text().strip() == checks["versions"][1]


def test_run_dir_that_cannot_be_created_fails(tmp_path: Path) -> None:
    # Root may write anywhere, but nobody can create a directory below a regular file.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    rc, checks = _run(blocker / "run")

    assert checks["storage"][0] == "FAIL" and "Not a directory" in checks["storage"][1]
    assert rc == 1


def _srun_check_env(cluster: SlurmCluster, tmp_path: Path, python: str) -> tuple[str, list[str]]:
    job_script = tmp_path / "job.sh"
    job_script.write_text(f"#!/bin/bash\nsrun --ntasks-per-node=1 {SCRIPT} {tmp_path / 'run'}\n")
    out = tmp_path / "out.txt"
    job = cluster.sbatch(
        ["--nodes=2", f"--chdir={REPO}", f"--output={out}", str(job_script)],
        env={"SHARDRL_PYTHON": python, "CHECK_ENV_WAIT": "30"},
    )
    states = cluster.wait_state(job, ("COMPLETED", "FAILED"), timeout=120)
    return states[0], out.read_text().splitlines()


@pytest.mark.slurm
def test_two_nodes_see_each_other_and_match(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    state, lines = _srun_check_env(slurm_cluster, tmp_path, sys.executable)

    assert state == "COMPLETED", "\n".join(lines)
    assert sorted(line.split(":")[0] for line in lines if " visibility:" in line) == [
        "PASS [vm1] visibility",
        "PASS [vm2] visibility",
    ]
    assert [line for line in lines if " versions-match:" in line and line.startswith("PASS")] == [
        "PASS [vm1] versions-match: identical on 2 nodes"
    ]


@pytest.mark.slurm
def test_version_mismatch_between_nodes_fails(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # vm2's python finds an older transformers first on its path: the kind of drift a stale node image causes.
    fake = tmp_path / "old-site" / "transformers-0.0.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 0.0.1\n")
    (fake / "top_level.txt").write_text("transformers\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'[[ $SLURMD_NODENAME == vm2 ]] && export PYTHONPATH={fake.parent}\nexec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)

    state, lines = _srun_check_env(slurm_cluster, tmp_path, str(wrapper))

    assert state == "FAILED"
    (verdict,) = [line for line in lines if line.startswith("FAIL [vm1] versions-match:")]
    assert "transformers differs: " in verdict and "0.0.1 on vm2" in verdict
    assert "torch differs" not in verdict
