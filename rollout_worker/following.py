"""Following the trainer's weight versions: poll ``weights/LATEST``, verify, hot-reload, skip a bad version.

The worker calls ``catch_up`` between batches.  LATEST is read at most every ``rollout.weights_poll_s``; a newer
version is verified against its manifest and loaded into the engine in place.  A version that fails (damaged files,
deleted under us, an engine that refuses it) is skipped with one log line and retried at later polls; meanwhile an
older version that is still newer than ours is tried, because it still helps staleness.  ``catch_up`` says whether
the worker may start a batch: not while it is more than ``rollout.max_staleness`` versions behind.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from buffer.heartbeats import load_trainer
from buffer.layout import RunLayout
from buffer.records import RecordError
from buffer.weights import WeightsError, latest_version, published_versions, verify_version
from rollout_worker.engines.base import Engine, EngineError

log = logging.getLogger("shardrl.rollout")


class WeightFollower:
    """The weight version one engine serves, kept close to the newest one published.

    ``report(**fields)`` receives what goes into the worker's status record (``weights_version``,
    ``latest_version``, ``last_reload_s``, ``last_error``, and ``state="reloading"`` while a load runs);
    ``on_error(line)`` is told about each newly skipped version.
    """

    def __init__(
        self,
        layout: RunLayout,
        engine: Engine,
        *,
        name: str,
        poll_s: float,
        max_staleness: int,
        report: Callable[..., None],
        publish_every: int = 1,
        on_error: Callable[[str], None],
    ):
        self.layout = layout
        self.engine = engine
        self.name = name
        self.poll_s = poll_s
        self.max_staleness = max_staleness
        self.publish_every = publish_every
        self.report = report
        self.on_error = on_error
        self.version = 0  # what the engine serves (0: the base model)
        self.latest = 0  # the newest version LATEST named at the last poll
        self.bad: dict[int, str] = {}  # versions that failed to load, and why
        self._last_poll = -math.inf

    def too_stale(self, step_ready: bool = False) -> bool:
        """Whether a batch started now would be consumed more than ``max_staleness`` versions behind;
        ``step_ready``: a whole trainer step of samples already waits unconsumed (see ``_versions_in_flight``)."""
        # A LATEST that failed to load (damaged, or naming a missing version) does not count: the newest version
        # that loads is the one we serve (``poll`` tried the older ones), and pausing for a version nobody can load
        # would leave the trainer waiting for samples forever; its next publish replaces LATEST.
        latest = self.version if self.latest in self.bad else self.latest
        return latest + self._versions_in_flight(step_ready) - self.version > self.max_staleness

    def _versions_in_flight(self, step_ready: bool = False) -> int:
        """How many versions newer than LATEST exist before a batch started now can be consumed: one being written
        in the background (the trainer's ``publishing``), and one more for the step that comes first: the one the
        trainer computes, or the one a whole step of waiting samples will make (``step_ready``; the trainer may not
        have noticed them yet).

        A batch started now is consumed after that step at the earliest, so it is judged against the version that
        step publishes: with ``max_staleness = 0`` a worker waits for the new weights instead of generating samples
        the trainer would drop (the synchronous mode), and with 1 it may start on the current ones.  Without
        ``publish_every = 1`` that step may not publish, and only a version being written counts.
        """
        try:
            rec = load_trainer(self.layout)
        except (RecordError, OSError):
            rec = None
        newest = max(self.latest, (rec.publishing or 0) if rec is not None else 0)
        next_step = step_ready or (rec is not None and rec.state == "training")
        return newest + int(self.publish_every == 1 and next_step) - self.latest

    def catch_up(self, step_ready: bool = False) -> bool:
        """Poll (rate-limited); True when a batch may start, False while too stale even after a forced poll.
        ``step_ready``: a whole trainer step of samples waits unconsumed (``too_stale``)."""
        self.poll()
        if self.too_stale(step_ready):
            self.poll(force=True)
        return not self.too_stale(step_ready)

    def poll(self, *, force: bool = False) -> None:
        """Load the newest verified version newer than ours."""
        now = time.monotonic()
        if not force and now - self._last_poll < self.poll_s:
            return
        self._last_poll = now
        self.latest = latest_version(self.layout)
        if self.latest <= self.version or self._load(self.latest):
            return
        # LATEST is unusable (damaged, or being deleted): an older version newer than ours still helps staleness
        older = (v for v in published_versions(self.layout) if self.version < v < self.latest)
        for v in sorted(older, reverse=True):
            if self._load(v):
                return

    def _load(self, version: int) -> bool:
        try:
            wv = verify_version(self.layout, version)
            self.report(state="reloading")
            start = time.monotonic()
            self.engine.load_weights(wv.path)
        except (WeightsError, EngineError) as e:
            self._skip(version, e)
            return False
        seconds = time.monotonic() - start
        log.info("%s: loaded weights v%d in %.2fs (was v%d)", self.name, version, seconds, self.version)
        self.version = version
        self.bad.pop(version, None)
        self.report(weights_version=version, latest_version=self.latest, last_reload_s=round(seconds, 3))
        return True

    def _skip(self, version: int, error: Any) -> None:
        if version not in self.bad:
            log.warning(
                "%s: weights v%d skipped (%s); keeping v%d, will retry",
                self.name,
                version,
                error,
                self.version,
            )
            self.on_error(f"weights v{version} skipped: {error}")
        self.bad[version] = str(error)
