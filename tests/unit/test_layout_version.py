"""A run directory of an older layout is refused in one line that says what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from buffer import SCHEMA_VERSION
from buffer.config import ConfigError
from buffer.layout import RunLayout
from buffer.run import read_run_json


def test_an_older_run_layout_is_refused_with_what_to_do(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "old")
    layout.create()
    layout.run_json.write_text(
        json.dumps({"run_id": "r", "schema_version": SCHEMA_VERSION - 1, "created_at": 0})
    )
    with pytest.raises(ConfigError) as e:
        read_run_json(layout)
    line = str(e.value)
    assert "\n" not in line and str(layout.run_json) in line and "schema_version" in line
    assert f"run layout {SCHEMA_VERSION}" in line and "shardrl init" in line


def test_the_current_layout_is_read(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "new")
    layout.create()
    layout.run_json.write_text(json.dumps({"run_id": "r", "schema_version": SCHEMA_VERSION, "created_at": 0}))
    assert read_run_json(layout)["run_id"] == "r"
