"""The trainer's loop: plan or replay a step, train it, publish weights, checkpoint, report.

Reads like a table of contents; the pieces live in ``data`` (planning), ``step`` (losses), ``publish`` and
``checkpoint``.  Run by ``python -m trainer`` under torchrun (or as one process).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from buffer import heartbeats, weights
from buffer.plans import PlanLog
from buffer.run import Run
from trainer import checkpoint as ckpt
from trainer import dist as tdist
from trainer.data import Planner, Sample
from trainer.metrics import MetricSink, setup_logging, step_line
from trainer.model import build_actor, build_optimizer, build_reference, build_scheduler
from trainer.publish import publish_weights
from trainer.step import Models, train_step

log = logging.getLogger("trainer")


@dataclass
class TrainState:
    step: int = 0  # last trained step
    version: int = 0  # weight version the trainer's weights were last published as
    samples_trained: int = 0
    dropped_stale: int = 0


class StopFlag:
    """SIGTERM/SIGINT (Slurm time limit, preemption, Ctrl-C): finish the step, checkpoint, exit."""

    def __init__(self) -> None:
        self.set = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.set = True

    def agreed(self) -> bool:
        return tdist.all_reduce_max(1.0 if self.set else 0.0) > 0


def build_models(run: Run) -> Models:
    cfg = run.config
    device = tdist.current_device()
    t = cfg.trainer
    actor = build_actor(
        run.model_dir, device, param_dtype=t.param_dtype, activation_checkpointing=t.activation_checkpointing
    )
    opt = build_optimizer(actor, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    sched = build_scheduler(opt, warmup_steps=t.warmup_steps, schedule=t.schedule, total_steps=t.total_steps)
    ref = (
        build_reference(run.model_dir, device, param_dtype=t.param_dtype)
        if cfg.algorithm.kl_coef > 0
        else None
    )
    return Models(actor, opt, sched, reference=ref)


def resume(run: Run, models: Models) -> TrainState:
    state = TrainState()
    step = ckpt.latest_complete_checkpoint(run.layout)
    if step is not None:
        extra = ckpt.load_checkpoint(run.layout, step, models.actor, models.optimizer, models.scheduler)
        state = TrainState(**extra["train_state"])
        log.info("resumed from checkpoint step %d (weights v%d)", state.step, state.version)
    # a trainer that died after publishing but before checkpointing: never reuse a version number
    state.version = max(state.version, weights.latest_version(run.layout))
    return state


class Feeder:
    """Rank 0 plans or replays each step; every rank gets the step's samples. Waits while too few exist."""

    def __init__(self, run: Run, state: TrainState, stop: StopFlag):
        self.run, self.stop = run, stop
        self.planner: Planner | None = None
        self.replay: dict[int, Any] = {}
        if tdist.is_main():
            plan_log = PlanLog.claim(run.layout)
            self.planner = Planner(run.layout, plan_log, run.config.model.vocab_size)
            self.replay = {p.step: p for p in plan_log.replay(after_step=state.step)}
            if self.replay:
                log.info("replaying recorded plans of steps %s", sorted(self.replay))

    def _rank0_try(self, step: int, version: int) -> list[Sample] | None:
        assert self.planner is not None
        if step in self.replay:
            return self.planner.replay(self.replay.pop(step))
        t, a = self.run.config.trainer, self.run.config.algorithm
        got = self.planner.try_plan(
            step, t.samples_per_step, version, t.max_staleness, a.staleness_mode == "drop"
        )
        return None if got is None else got[1]

    def next(self, step: int, version: int, status: Any) -> tuple[list[Sample] | None, float]:
        """The samples of ``step`` (None when stopping) and the seconds spent waiting for them."""
        t0 = time.monotonic()
        timeout = self.run.config.trainer.step_wait_timeout_s
        while True:
            if self.stop.agreed():
                return None, time.monotonic() - t0
            samples = self._rank0_try(step, version) if tdist.is_main() else None
            samples = tdist.broadcast_object(samples)
            if samples is not None:
                return samples, time.monotonic() - t0
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(
                    f"step {step}: no {self.run.config.trainer.samples_per_step} samples after {timeout}s"
                )
            if status is not None:
                status.update(state="waiting", step=step - 1, **self.counts())
            time.sleep(self.run.config.trainer.poll_interval_s)

    def counts(self) -> dict[str, int]:
        if self.planner is None:
            return {}
        return {
            "consumed_samples": len(self.planner.consumed),
            "unconsumed_samples": self.planner.unconsumed_count(),
            "quarantined": self.planner.cache.quarantined,
        }


def publish(run: Run, models: Models, state: TrainState) -> float:
    t0 = time.monotonic()
    cfg = run.config
    version = state.version + 1
    tied = bool(getattr(models.actor.config, "tie_word_embeddings", False))
    publish_weights(
        models.actor,
        run.layout,
        version,
        state.step,
        dtype=cfg.model.dtype,
        tied=tied,
        src_model_dir=run.model_dir,
    )
    state.version = version
    if tdist.is_main():
        weights.garbage_collect(
            run.layout, cfg.run.keep_weight_versions, heartbeats.versions_in_use(run.layout)
        )
    return time.monotonic() - t0


def save(run: Run, models: Models, state: TrainState) -> None:
    ckpt.save_checkpoint(
        run.layout,
        state.step,
        models.actor,
        models.optimizer,
        models.scheduler,
        {"train_state": asdict(state)},
        keep=run.config.trainer.keep_checkpoints,
    )


def _step_metrics(
    samples: list[Sample], m: dict[str, float], version: int, wait_s: float, step_s: float
) -> dict[str, float]:
    stale = [version - s.policy_version for s in samples]
    tokens = sum(s.length for s in samples)
    return {
        **m,
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "reward_max_frac": sum(1 for s in samples if s.reward >= 1.0) / len(samples),
        "samples": len(samples),
        "staleness_mean": sum(stale) / len(stale),
        "staleness_max": max(stale),
        "tokens_per_s": tokens / max(step_s, 1e-9),
        "wait_s": wait_s,
        "wait_frac": wait_s / max(wait_s + step_s, 1e-9),
        "version": version,
    }


def train(run: Run) -> TrainState:
    tdist.init()
    setup_logging(tdist.rank())
    cfg = run.config
    stop = StopFlag()
    models = build_models(run)
    state = resume(run, models)
    feeder = Feeder(run, state, stop)
    status = heartbeats.trainer_status(run.layout) if tdist.is_main() else None
    sink = (
        MetricSink(
            run.layout.metrics_file("trainer"),
            run.layout.root / "tensorboard" if cfg.trainer.tensorboard else None,
        )
        if tdist.is_main()
        else None
    )
    pad_id = int(getattr(models.actor.config, "pad_token_id", None) or 0)
    done = 0
    last_saved = state.step
    while cfg.trainer.max_steps is None or done < cfg.trainer.max_steps:
        step = state.step + 1
        samples, wait_s = feeder.next(step, state.version, status)
        if samples is None:
            break
        if status is not None:
            status.update(
                state="training", step=state.step, published_version=state.version, **feeder.counts()
            )
        t0, version = time.monotonic(), state.version
        m = train_step(cfg, models, samples, pad_id)
        state.step, state.samples_trained, done = step, state.samples_trained + len(samples), done + 1
        step_s = time.monotonic() - t0
        if step % cfg.trainer.publish_every == 0:
            m["publish_s"] = publish(run, models, state)
        if step % cfg.trainer.save_every == 0:
            save(run, models, state)
            last_saved = step
        metrics = _step_metrics(samples, m, version, wait_s, step_s)
        if sink is not None and status is not None:
            sink.log(metrics, step)
            log.info(step_line(step, metrics))
            status.update(state="training", step=step, published_version=state.version, **feeder.counts())
    if state.step != last_saved:
        save(run, models, state)
    if status is not None:
        status.update(state="stopped", step=state.step, published_version=state.version, **feeder.counts())
    if sink is not None:
        sink.close()
    tdist.teardown()
    return state


def run_trainer(run: Run) -> int:
    torch.manual_seed(run.config.run.seed)
    train(run)
    return 0
