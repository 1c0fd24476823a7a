"""Session-wide fixtures shared by unit and integration tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Two pytest processes share the machine's cores with every process they start (trainers, evaluators, demos), and
# torch's default of one intra-op thread per core has each process's threads spinning against the others': the
# tiny-model tests ran 1.8x slower beside two busy cores with the default than with one thread, and no slower with
# one thread on an idle machine.  So one thread each, inherited by the processes the tests start; a process that sets
# its own keeps it (a rollout worker gets OMP_NUM_THREADS from its supervisor's share of the cores), and a value set
# outside the suite stands.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One cache of built tiny bases for the whole run, shared by the two pytest-xdist processes and every process
    they start (the lookup demo's base pretrains for minutes; `shardrl/runs.py`)."""
    from shardrl.runs import CACHE_ENV

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ.setdefault(CACHE_ENV, str(shared / "tiny-cache"))


@pytest.fixture(scope="session")
def tiny_model_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen2 (separate LM head), built once per session; treat as read-only."""
    from shardrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "untied", tied=False)


@pytest.fixture(scope="session")
def tiny_model_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen2 with the LM head tied to the input embedding; treat as read-only."""
    from shardrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tied", tied=True)


@pytest.fixture(scope="session")
def lookup_base(_tiny_cache: None) -> Path:
    """The base `shardrl demo --task lookup` starts from (the packaged lookup.toml's): the tiny model pretrained on the
    tool call's format, so that it calls the tool (and answers at chance); read-only."""
    from buffer.config import load_toml
    from shardrl.demo import TASK_CONFIGS
    from shardrl.runs import CACHE_ENV, cached_base

    return cached_base(Path(os.environ[CACHE_ENV]), load_toml(TASK_CONFIGS["lookup"], {}))


# `make test` spreads the suite over two pytest-xdist processes, a file at a time (a file's module fixtures, an
# engine or a trainer, start once).  The Slurm tests share one cluster per process, and two clusters on one machine
# would fight over slurmd's node names and ports: their files are one unit, so one process runs them all.
TOGETHER = {
    "tests/integration/test_check_env.py": "slurm",
    "tests/integration/test_slurm_e2e.py": "slurm",
    "tests/integration/test_slurm_smoke.py": "slurm",
}
# Files that take minutes go first, so that the two processes end together instead of one waiting on the last of
# these (measured with --durations; the rest keep their collection order).
LONG_FIRST = (
    "tests/integration/test_tool_learning.py",
    "tests/integration/test_first_run.py",
    "tests/integration/test_slurm_e2e.py",
    "tests/integration/test_slurm_smoke.py",
    "tests/integration/test_check_env.py",
)


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Whole files to a process (the Slurm files together), in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return TOGETHER.get(_file(nodeid), _file(nodeid))

    config.option.loadscopereorder = False  # keep LONG_FIRST's order, not the count of tests a file has
    return ByFile(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(_file(item.nodeid), len(rank)))  # stable: the rest keep their order
    _skip_gpu_tests(items)


def _skip_gpu_tests(items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA device; where there is none (CI, this kind of machine) they are skipped."""
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in gpu_items:
        item.add_marker(skip)


UNIT_BUDGET_S = 5.0  # tests/unit/conftest.py: a unit test's budget, reported at the end, never asserted
_over_budget: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > UNIT_BUDGET_S and report.nodeid.startswith("tests/unit/"):
        _over_budget.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _over_budget:
        terminalreporter.section(f"unit tests over their {UNIT_BUDGET_S:.0f} s budget (reported, not failed)")
        for nodeid, seconds in sorted(_over_budget, key=lambda x: -x[1]):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
