"""Session-wide fixtures shared by unit and integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen2 (separate LM head), built once per session; treat as read-only."""
    from buffer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "untied", tied=False)


@pytest.fixture(scope="session")
def tiny_model_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen2 with the LM head tied to the input embedding; treat as read-only."""
    from buffer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tied", tied=True)
