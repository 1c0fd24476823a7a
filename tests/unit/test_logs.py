"""The one logging setup: loggers named shardrl.<component>, one format on stderr, rank-style levels."""

from __future__ import annotations

import logging
import re

import pytest

from buffer.logs import logger, setup_logging


@pytest.fixture(autouse=True)
def _restore_root_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_setup_logs_every_component_in_one_format(capsys: pytest.CaptureFixture[str]) -> None:
    log = setup_logging("supervisor")
    assert log is logger("supervisor") and log.name == "shardrl.supervisor"
    log.info("slot %d up", 3)
    logger("rollout").warning("w0: paused")
    lines = capsys.readouterr().err.splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(stamp + r" shardrl\.supervisor: slot 3 up", lines[0]), lines
    assert re.fullmatch(stamp + r" shardrl\.rollout: w0: paused", lines[1]), lines


def test_a_second_setup_replaces_the_first_and_sets_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("trainer")
    setup_logging("trainer", level=logging.WARNING)  # a trainer rank other than 0
    logger("trainer").info("step 1 | reward 0.4")
    logger("trainer").warning("slow storage")
    err = capsys.readouterr().err
    assert "step 1" not in err and err.count("slow storage") == 1
