"""Fixtures for integration tests: a real Slurm cluster, started once per test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .slurm_cluster import SlurmCluster, ensure_slurm_installed


@pytest.fixture(scope="session")
def _slurm_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = ensure_slurm_installed()
    if reason is not None:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture()
def slurm_cluster(_slurm_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """Two virtual nodes ``vm1``/``vm2`` in partitions ``cheap`` (default) and ``a100``; see ``slurm_cluster.py``.
    Started once per session; every job a test leaves behind (a failed test's) is cancelled after it, so that the
    next test finds the nodes free."""
    yield _slurm_session
    _slurm_session.cancel_all_jobs()
