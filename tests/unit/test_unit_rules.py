"""The rule tests/unit/conftest.py enforces: a unit test not marked ``proc`` cannot start a process."""

from __future__ import annotations

import multiprocessing
import subprocess

import pytest

from .conftest import StartedAProcess


def test_an_unmarked_unit_test_cannot_start_a_process() -> None:
    with pytest.raises(StartedAProcess, match=r"mark it @pytest\.mark\.proc"):
        subprocess.run(["true"], check=False)
    with pytest.raises(StartedAProcess):
        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.proc
def test_a_marked_one_can() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0
