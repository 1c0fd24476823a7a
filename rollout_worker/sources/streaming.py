"""Single-turn groups streamed through the engine (``rollout.streaming``): a group starts whenever the engine has
room and the bounds allow one more, each group is taken as soon as it is scored, and weights change under the
requests in flight (the engine's ``update_weights``, called by the weight follower)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from rollout_worker.engines.base import SamplingSpec, StreamingEngine
from rollout_worker.prompts import derive_seed
from rollout_worker.sources import Admit, Host, Produced, sampling_spec
from rollout_worker.streaming import GroupStream, InlineScorer, LengthDraw, StreamMeter

log = logging.getLogger("shardrl.rollout")

ADMISSION_S = 0.25  # the run's state is read at most 4 times a second (samples started since are added to it)
POLL_S = 0.05  # the engine is asked for finished requests for at most this long at a time
STATUS_S = 0.5  # the status record: at most this often (a record per group would be a write per few ms)
METRICS_S = 5.0  # a metrics line


class StreamingSource:
    admission_every_s = ADMISSION_S

    def __init__(
        self,
        host: Host,
        engine: StreamingEngine,
        scorer: Any,
        *,
        lengths: LengthDraw | None = None,
        model_scorer: Any = None,
    ):
        cfg, r = host.cfg, host.cfg.rollout
        if r.score_processes > 0:
            from rollout_worker.scorepool import ScorePool

            scorer = ScorePool(cfg.reward, processes=r.score_processes, timeout_s=cfg.reward.timeout_s)
        else:
            scorer = InlineScorer(scorer)
        self.host, self.engine = host, engine
        self.groups = GroupStream(
            engine,
            scorer,
            n=r.sampling.n,
            group_prefix=f"{host.worker_id}.{host.incarnation}.s",
            lengths=lengths,
            model_scorer=model_scorer,
            model_weight=cfg.reward.reward_model_weight,
        )
        self.meter = StreamMeter(engine)
        self.aborted = 0
        self.idle_reason: str | None = None

    @property
    def batches(self) -> int:
        return self.groups.started

    def step(self, admit: Admit) -> Produced:
        g = self.groups
        reason = admit()
        started = self._start_groups(admit) if reason is None else 0
        # paused: nothing may start and nothing is generating (a bound holds the engine idle); while requests run
        # the worker is running, whether or not it may start more
        idle = reason is not None and g.generating == 0
        self.meter.tick(paused=idle)
        self.idle_reason = reason if idle else None
        if idle and not g.groups:
            return Produced(paused=reason, started=started)
        scored = g.poll(POLL_S, epoch=self.host.stream.epoch)
        self.meter.add(scored)
        self._abort_doomed()
        return Produced(scored=scored, started=started)

    def _start_groups(self, admit: Admit) -> int:
        """Start groups while there is room in the engine and the bounds hold for each one more."""
        g, r = self.groups, self.host.cfg.rollout
        n, limit, started = r.sampling.n, max_in_flight(self.host.cfg), 0
        while g.generating + n <= limit and admit(started * n, poll=False) is None:
            g.start(self.host.stream.next_batch(1)[0], self._sampling())
            started += 1
        return started * n

    def _sampling(self) -> SamplingSpec:
        h = self.host
        seed = derive_seed(h.cfg.run.seed, "group", h.slot, h.incarnation, self.groups.started)
        return replace(sampling_spec(h.cfg, None), seed=seed)

    def _abort_doomed(self) -> None:
        """Stop the groups the trainer is sure to drop: started before its version - ``trainer.max_staleness`` (a
        group's oldest token is no older than its start).  A long response can outlive the bound that admitted it;
        cut now, its slots go to groups the trainer will take.

        The trainer judges its next plan by the version it will hold then: at least LATEST, or the one it is
        publishing.  (It may be one more, once the step it computes is done; the worker cannot tell for sure from
        a record up to a second old, and stopping a group the trainer would keep would cost what it avoids.)"""
        cfg, weights, view = self.host.cfg, self.host.weights, self.host.view()
        if cfg.algorithm.staleness_mode != "drop" or weights is None:
            return
        judged = weights.newest_known(view.trainer if view is not None and view.live else None)
        if dropped := self.groups.abort_older(judged - cfg.trainer.max_staleness):
            self.aborted += dropped
            log.info(
                "%s: %d samples in flight would be too stale to train on, stopped",
                self.host.worker_id,
                dropped,
            )

    def generating(self) -> int:
        return self.groups.samples

    def counters(self) -> dict[str, int]:
        return {"aborted_stale_samples": self.aborted, "reward_timeouts": self.groups.timed_out}

    def tick(self, force: bool = False) -> None:
        """The status record (and a metrics line every METRICS_S), at most every STATUS_S."""
        m, now = self.meter, time.monotonic()
        if not force and now - m.status_at < STATUS_S:
            return
        m.status_at = now
        stats = self.engine.stats()
        self.host.report(
            state="paused" if self.idle_reason else "running",
            paused_reason=self.idle_reason,
            in_flight=self.host.pending_samples + self.groups.samples,
            requests_in_flight=stats.in_flight,
            engine_busy=m.busy_fraction(),
            reloads_in_flight=stats.updates,
            batches=self.batches,
            reward_mean=m.reward_mean(),
            tokens_per_s=round(m.tokens_per_s(), 1),
        )
        if now - m.metrics_at >= METRICS_S:
            self.host.metrics(**m.interval(), aborted_stale_samples=self.aborted)

    def drain(self, take: Any, keep_going: Any) -> None:
        """Stopping: no new group; the ones in flight finish and are scored until the drain's time is half gone,
        then the rest are dropped (never published in part)."""
        g = self.groups
        deadline = time.monotonic() + self.host.cfg.rollout.drain_deadline_s / 2
        while g.groups and time.monotonic() < deadline and keep_going():
            scored = g.poll(POLL_S, epoch=self.host.stream.epoch)
            self.meter.add(scored)
            take(Produced(scored=scored))
        if dropped := g.abort_all():
            log.info(
                "%s: %d samples still generating at the drain's deadline, dropped",
                self.host.worker_id,
                dropped,
            )
        self.idle_reason = None
        self.tick(force=True)

    def close(self) -> None:
        self.groups.scorer.close()


def max_in_flight(cfg: Any) -> int:
    """Samples a streaming worker keeps in its engine (``rollout.max_in_flight``, default a batch's worth)."""
    r = cfg.rollout
    return max(r.max_in_flight or r.prompts_per_batch * r.sampling.n, r.sampling.n)
