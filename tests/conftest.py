"""Session-wide fixtures shared by unit and integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
