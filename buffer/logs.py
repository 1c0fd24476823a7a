"""The one logging setup of every shardrl process: one format on stderr, loggers named ``shardrl.<component>``.

Each entry point calls ``setup_logging("<component>")`` once in its ``main`` (trainer, supervisor, rollout, eval);
modules take their logger with ``logger("<component>")`` at import time, which configures nothing.  Imports only
the standard library, so every ``--help`` stays light.
"""

from __future__ import annotations

import logging
import sys

ROOT = "shardrl"
# The date too: a run's jobs are requeued over days, and their logs are read side by side.
FORMAT = "%(asctime)s %(name)s: %(message)s"
DATEFMT = "%Y-%m-%d %H:%M:%S"


def logger(component: str) -> logging.Logger:
    """The logger of one component: ``shardrl.<component>``."""
    return logging.getLogger(f"{ROOT}.{component}")


def setup_logging(component: str, *, level: int = logging.INFO) -> logging.Logger:
    """Send every record at ``level`` or above to stderr in the one format, replacing any handler installed before
    (a library's, or an earlier call's); returns the component's logger."""
    logging.basicConfig(level=level, format=FORMAT, datefmt=DATEFMT, stream=sys.stderr, force=True)
    return logger(component)
