"""Weight versions from the trainer's loop: their numbers, one asynchronous publish in flight, and retries.

Numbers.  A restarted trainer publishes after the highest version that exists as a directory (committed or not: a
number on disk is never reused) or that its checkpoint knows of.  LATEST is not trusted for this: one that points
at a missing or damaged version is reported and ignored, and the trainer's next commit replaces it.

Asynchronous publish.  After a step, every rank copies its share of the weights to host memory (``stage_weights``:
the only part the step waits for), then a thread writes the files and rank 0 commits the version (manifest last,
LATEST atomic), over a gloo process group of its own, while the next step computes.  At most one version is in
flight: the next publish, a checkpoint, the end of the run, or a wait for samples first settles it.

Full and delta versions.  With ``trainer.publish_full_every`` = N > 1, a full version is followed by up to N - 1
versions published as deltas against it (``trainer/publish.py``, ``buffer/deltas.py``): a few percent of the bytes
for bf16 weights after a small step.  The first publish of a trainer process, the one after a failed publish, and
every LoRA version are full; retention (``buffer.weights.garbage_collect``) keeps the base of every delta it keeps.

Failures (a full disk on any rank).  The staging directory is removed and the error goes into the trainer status
(``last_error``).  Publishing is required for progress: rollout workers can only follow published weights, so a
trainer that trained on would make every later sample more off-policy than ``trainer.max_staleness`` admits,
without bound.  So the trainer stops where it is (the step in flight at most) and publishes its current weights
again, after 1 s, 2 s, 4 s... up to a minute, saying so in the status (``waiting``), until it works or it is asked
to stop.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from buffer import heartbeats, weights
from buffer.config import resolve_dtype
from buffer.layout import RunLayout
from buffer.logs import logger
from buffer.plans import PlanLog
from buffer.records import RecordError
from buffer.run import Run
from trainer import dist as tdist
from trainer.delta_base import DeltaBase
from trainer.feed import on_rank0
from trainer.publish import PublishError, StagedVersion, stage_weights, write_staged
from trainer.step import Models

log = logger("trainer")

_VERSION_DIR = re.compile(r"^v(\d+)$")
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
SLEEP_SLICE_S = 0.5  # how often a retry's sleep checks for a stop request


def highest_version_dir(layout: RunLayout) -> int:
    """The highest N of any ``weights/vN`` directory, complete or not (0 when there is none)."""
    try:
        names = [p.name for p in layout.weights.iterdir()]
    except FileNotFoundError:
        return 0
    return max((int(m.group(1)) for n in names if (m := _VERSION_DIR.match(n))), default=0)


def latest_problem(layout: RunLayout) -> str | None:
    """Why LATEST cannot be believed (unreadable, or naming a version that is missing or does not verify)."""
    try:
        v = weights.latest_version(layout)
        if v > 0:
            weights.verify_version(layout, v, checksums=False)
    except (RecordError, OSError, weights.WeightsError) as e:
        return f"{layout.latest_pointer} is not followed: {e}"
    return None


def starting_version(layout: RunLayout, checkpoint_version: int) -> int:
    """The version the trainer's weights count as at start; it publishes the next one (``latest_problem`` says
    whether LATEST was worth reading at all)."""
    return max(checkpoint_version, highest_version_dir(layout))


@dataclass
class Settled:
    """The outcome of a publish: its version, the seconds its write took, the error (None when committed)."""

    version: int
    write_s: float
    error: str | None = None
    merged: bool = False  # LoRA: merged full weights (a retry must publish the same kind)


class Publisher:
    """Publishes weight versions with at most one in flight.  Every method is collective (call on every rank)."""

    def __init__(self, run: Run, plan_log: PlanLog | None):
        self.run, self.plan_log = run, plan_log
        # The thread's collectives need a group of their own: the main thread's run at the same time.
        self.group: Any = dist.new_group(backend="gloo") if tdist.world() > 1 else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self.inflight: tuple[int, bool, Future[float]] | None = None
        self.staged: StagedVersion | None = None  # the version in flight
        self.write_s = 0.0  # the write time of the last version settled
        self.base = (
            DeltaBase()
        )  # the full version deltas are made against: its number here, its bytes per rank

    def start(self, models: Models, version: int, step: int, merged: bool) -> None:
        """Stage ``version`` (the caller's step waits for this) and write it in the background."""
        assert self.inflight is None, "a version is still in flight"
        cfg = self.run.config
        lora = cfg.model.lora if cfg.model.lora.enabled else None
        full_every = cfg.trainer.publish_full_every
        deltas_on = full_every > 1 and lora is None
        held = self.base.version
        delta_base = held if deltas_on and held and version - held < full_every else None
        staged = stage_weights(
            models.actor,
            self.run.layout,
            version,
            step,
            dtype=resolve_dtype(cfg.model.dtype, cuda=tdist.current_device().type == "cuda"),
            tied=bool(getattr(models.actor.config, "tie_word_embeddings", False)),
            src_model_dir=self.run.model_dir,
            lora=lora,
            merged=merged,
            delta_base=delta_base,
            base=self.base if deltas_on else None,
        )
        self.staged = staged
        self.inflight = (version, merged, self.pool.submit(self._write, staged))

    def _write(self, staged: StagedVersion) -> float:
        t0 = time.monotonic()
        guard = self.plan_log.check_not_fenced if self.plan_log is not None else None
        write_staged(staged, self.group, before_commit=guard)
        if tdist.is_main():
            self._collect_garbage()
        return time.monotonic() - t0

    def _collect_garbage(self) -> None:
        layout = self.run.layout
        try:
            r = self.run.config.run
            weights.garbage_collect(
                layout, r.keep_weight_versions, heartbeats.versions_in_use(layout), every=r.keep_weight_every
            )
        except (OSError, RecordError) as e:  # old versions stay a while longer: nothing is lost
            log.warning("weights garbage collection skipped: %s", e)

    def settle(self) -> Settled | None:
        """Wait for the version in flight (None when there is none).  FencedError is raised; any other failure is
        returned, the same on every rank (write_staged agrees on it before it returns)."""
        if self.inflight is None:
            return None
        version, merged, future = self.inflight
        self.inflight, self.staged = None, None
        try:
            self.write_s = future.result()  # a full version committed is kept in self.base by write_staged
        except PublishError as e:
            self.base.forget()  # the retry publishes in full: whatever failed may have been the base
            return Settled(version, 0.0, str(e), merged)
        return Settled(version, self.write_s, None, merged)

    def publish_now(self, models: Models, version: int, step: int, merged: bool) -> Settled:
        """Stage, write and commit ``version`` before returning (a retry, or a stage that failed)."""
        try:
            self.start(models, version, step, merged)
        except (
            OSError,
            weights.WeightsError,
        ) as e:  # staging failed (a full disk: broadcast, so on every rank)
            return Settled(version, 0.0, str(e), merged)
        settled = self.settle()
        assert settled is not None
        return settled

    def retry(
        self,
        failed: Settled,
        models: Models,
        step: int,
        waiting: Callable[[str, str], None],
        stop: Callable[[], bool],
    ) -> bool:
        """Publish ``failed.version`` again (current weights) with backoff until it is committed (True) or a stop is
        asked for (False).  ``waiting(what, error)`` reports each wait; ``stop()`` is collective."""
        delay, attempt, error = RETRY_FIRST_S, 1, failed.error or ""
        while True:
            log.error("publishing v%d failed: %s; retry %d in %.0f s", failed.version, error, attempt, delay)
            waiting(f"publish of v{failed.version} failed; retry {attempt} in {delay:.0f} s", error)
            for _ in range(max(1, round(delay / SLEEP_SLICE_S))):
                if stop():
                    return False
                time.sleep(SLEEP_SLICE_S)
            settled = self.publish_now(models, failed.version, step, failed.merged)
            if settled.error is None:
                log.info("published v%d after %d retries", failed.version, attempt)
                return True
            delay, attempt, error = min(2 * delay, RETRY_MAX_S), attempt + 1, settled.error

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def check_fence(plan_log: PlanLog | None) -> None:
    """Raise FencedError on every rank once a newer trainer incarnation has claimed the run."""
    on_rank0(lambda: plan_log.check_not_fenced() if plan_log is not None else None)


class Reports(Protocol):
    """What publishing tells the trainer's status record (``loop.Reporter``)."""

    publishing: int | None
    last_error: str | None

    def error(self, message: str) -> None: ...
    def status(self, what: str, state: Any, counts: dict[str, Any], waiting: str | None = ...) -> None: ...


class Versions:
    """The loop's side of publishing: which step publishes, the version in flight, and what a failure does.
    ``state`` arguments are the loop's ``TrainState`` (``step``, ``version``, ``merged_step``); ``stop`` the loop's
    collective stop flag."""

    def __init__(self, run: Run, plan_log: PlanLog | None, report: Reports, stop: Any):
        self.run, self.plan_log, self.report, self.stop = run, plan_log, report, stop
        self.publisher = Publisher(run, plan_log)

    def due(self, step: int, batch: Any) -> bool:
        return bool(batch.samples) and step % self.run.config.trainer.publish_every == 0

    def version_after(self, step: int, state: Any, batch: Any) -> int:
        """The version the weights will carry once ``step`` is done (what the next step's staleness is judged by)."""
        return state.version + int(self.due(step, batch))

    def publish(self, models: Models, state: Any, final: bool = False) -> dict[str, float]:
        """Settle the version in flight, then stage the next one (the step waits for the copy only)."""
        t0 = time.monotonic()
        out = self.settle(models, state)
        check_fence(self.plan_log)
        version, merged = state.version + 1, self._merged(state.version + 1, final)
        try:
            self.publisher.start(models, version, state.step, merged)
        except (
            OSError,
            weights.WeightsError,
        ) as e:  # staging failed (on every rank: _fresh_staging broadcasts it)
            self._retry(Settled(version, 0.0, str(e), merged), models, state)
        else:
            state.version = version
            state.merged_step = state.step if merged else state.merged_step
            self.report.publishing = version  # workers judge staleness by it (rollout_worker/following.py)
        out["publish"] = time.monotonic() - t0
        return out

    def settle(self, models: Models, state: Any) -> dict[str, float]:
        """Wait for the version in flight; a failed one is published again (current weights) until it works."""
        settled = self.publisher.settle()
        self.report.publishing = None
        if settled is None:
            return {}
        if settled.error is None:
            return {"publish_write": settled.write_s}
        state.version = settled.version - 1  # never committed: its number is free again
        self._retry(settled, models, state)
        return {}

    def _merged(self, version: int, final: bool) -> bool:
        lora = self.run.config.model.lora
        return lora.enabled and (final or (lora.merge_every > 0 and version % lora.merge_every == 0))

    def _retry(self, failed: Settled, models: Models, state: Any) -> None:
        self.report.error(f"publishing v{failed.version} failed: {failed.error}")

        def waiting(what: str, error: str) -> None:
            self.report.last_error = error
            self.report.status("waiting", state, {}, waiting=what)

        if self.publisher.retry(failed, models, state.step, waiting, self.stop.agreed):
            state.version = failed.version
            state.merged_step = state.step if failed.merged else state.merged_step

    def close(self) -> None:
        self.publisher.close()
