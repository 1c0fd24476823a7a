"""shardrl installed from a wheel, run from a directory that is not the checkout.

The wheel is built from this tree and installed (without dependencies) into a fresh virtual environment whose only
link to the test environment is a .pth line for the already installed third-party packages.  Run from an empty
directory holding decoy `trainer/` and `buffer/` packages, the installed command must find its packaged demo config
and spawn its own modules, never the decoys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    wheels = root / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        cwd=root,
    )
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # Third-party packages only: the test environment's editable shardrl is a finder registered by a .pth file of
    # its own, which a path added this way does not run.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = wheels.glob("shardrl-*.whl")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return venv


def _decoy_cwd(tmp_path: Path) -> Path:
    cwd = tmp_path / "elsewhere"
    for pkg in ("trainer", "buffer", "rollout_worker", "shardrl"):
        (cwd / pkg).mkdir(parents=True)
        (cwd / pkg / "__init__.py").write_text("raise ImportError('decoy package imported')\n")
    return cwd


def test_installed_package_is_not_the_checkout(fresh_venv: Path, tmp_path: Path) -> None:
    code = "import shardrl, buffer, trainer, rollout_worker; print(shardrl.__file__); print(shardrl.init_run)"
    out = subprocess.run(
        [str(fresh_venv / "bin" / "python"), "-P", "-c", code],
        cwd=_decoy_cwd(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(fresh_venv) in out.splitlines()[0] and str(REPO) not in out


def test_demo_from_another_directory_uses_packaged_config(fresh_venv: Path, tmp_path: Path) -> None:
    cwd = _decoy_cwd(tmp_path)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(
        [str(fresh_venv / "bin" / "shardrl"), "demo", "--run", str(run), "--steps", "2", "--engine", "hf"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((run / "demo_summary.json").read_text())
    assert summary["steps"] == 2, summary
    # The run's processes were the installed ones: their logs name no decoy import error.
    logs = "".join(p.read_text(errors="replace") for p in (run / "logs").glob("*.log"))
    assert "decoy package imported" not in logs
