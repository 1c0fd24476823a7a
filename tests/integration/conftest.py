"""Fixtures for integration tests: a real Slurm cluster, started once per test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .slurm_cluster import SlurmCluster, ensure_slurm_installed


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Two virtual nodes ``vm1``/``vm2`` in partitions ``cheap`` (default) and ``a100``; see ``slurm_cluster.py``."""
    reason = ensure_slurm_installed()
    if reason is not None:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
