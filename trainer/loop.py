"""The trainer's loop: claim the run, resume, then plan or replay each step, train it, publish, checkpoint, report.

Reads like a table of contents; the pieces live in ``data`` (planning), ``step`` (losses), ``publish`` and
``checkpoint``.  Run by ``python -m trainer`` under torchrun (or as one process).

Decisions that depend on shared storage (which checkpoint to resume, what the next step trains on, whether a newer
incarnation took over) are taken by rank 0 and broadcast, so every rank runs the same sequence of collectives.
A trainer that finds itself fenced out by a newer incarnation stops before it writes a plan, publishes weights or
saves a checkpoint, and exits non-zero.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

from buffer import heartbeats, weights
from buffer.config import resolve_dtype
from buffer.metrics import Sinks, open_sinks
from buffer.plans import FencedError, PlanLog
from buffer.records import TrainerStatus
from buffer.run import Run
from buffer.status import BacklogCounter
from trainer import checkpoint as ckpt
from trainer import dist as tdist
from trainer.data import Planner, Sample
from trainer.lora import AdaptersOff
from trainer.metrics import setup_logging, step_line
from trainer.model import build_actor, build_critic, build_optimizer, build_reference, build_scheduler
from trainer.publish import publish_weights
from trainer.step import Models, kl_controller, train_step

log = logging.getLogger("trainer")
T = TypeVar("T")

EXIT_FENCED = 3
EXIT_TIMEOUT = 4


@dataclass
class TrainState:
    step: int = 0  # last trained step
    version: int = 0  # weight version the trainer's weights were last published as
    samples_trained: int = 0
    dropped_stale: int = 0
    merged_step: int = 0  # LoRA: the step of the last merged full-weight version
    # [epoch, first step, last step] per incarnation whose training these weights carry: an audit trail that
    # shows every step 1..step was trained exactly once on the way to this state.
    lineage: list[list[int]] = field(default_factory=list)

    def begin(self, epoch: int) -> None:
        self.lineage.append([epoch, self.step + 1, self.step])

    def advance(self, step: int, batch: StepBatch) -> None:
        self.step = step
        self.samples_trained += len(batch.samples)
        self.dropped_stale += batch.dropped
        self.lineage[-1][2] = step


@dataclass
class StepBatch:
    samples: list[Sample]
    dropped: int  # samples the step's plan dropped as too stale
    replayed: bool  # the plan was recorded by an earlier incarnation


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


def on_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0, its result on every rank.  An exception there is raised on every rank: rank 0
    raises its own, the others a FencedError alike or a RuntimeError naming it (not every exception unpickles)."""
    result: Any = None
    error: Exception | None = None
    if tdist.is_main():
        try:
            result = fn()
        except Exception as e:
            error = e
    shared: Exception | None = None
    if isinstance(error, FencedError):
        shared = FencedError(str(error))
    elif error is not None:
        shared = RuntimeError(f"rank 0 failed: {type(error).__name__}: {error}")
    result, shared = tdist.broadcast_object((result, shared))
    if error is not None:
        raise error
    if shared is not None:
        raise shared
    return result


# ----------------------------------------------------------------------------------------------------- start-up


def claim(run: Run) -> tuple[PlanLog | None, int]:
    """Rank 0 claims the next trainer epoch (fencing out older incarnations) before anything is loaded."""
    plan_log = PlanLog.claim(run.layout) if tdist.is_main() else None
    return plan_log, tdist.broadcast_object(plan_log.epoch if plan_log is not None else 0)


def build_models(run: Run) -> Models:
    cfg, device, t = run.config, tdist.current_device(), run.config.trainer
    sharding: dict[str, Any] = {
        "param_dtype": t.param_dtype,
        "activation_checkpointing": t.activation_checkpointing,
    }
    schedule: dict[str, Any] = {
        "warmup_steps": t.warmup_steps,
        "schedule": t.schedule,
        "total_steps": t.total_steps,
    }
    actor = build_actor(run.model_dir, device, **sharding, lora=cfg.model.lora)
    opt = build_optimizer(actor, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    models = Models(actor, opt, build_scheduler(opt, **schedule), kl=kl_controller(cfg))
    if cfg.algorithm.kl_coef > 0:  # with LoRA: the actor with its adapters off, no second base
        models.reference = (
            AdaptersOff(actor)
            if cfg.model.lora.enabled
            else build_reference(run.model_dir, device, param_dtype=t.param_dtype)
        )
    if cfg.algorithm.name == "ppo":
        models.critic = build_critic(t.critic_path or run.model_dir, device, **sharding, lora=t.critic_lora)
        models.critic_optimizer = build_optimizer(
            models.critic, lr=t.critic_lr, betas=t.betas, weight_decay=t.weight_decay
        )
        models.critic_scheduler = build_scheduler(models.critic_optimizer, **schedule)
    return models


def _newest_version(run: Run) -> int:
    return max([weights.latest_version(run.layout), *weights.published_versions(run.layout)])


def resume(run: Run, models: Models, epoch: int) -> TrainState:
    state = TrainState()
    step = on_rank0(lambda: ckpt.latest_complete_checkpoint(run.layout))
    if step is not None:
        extra = ckpt.load_checkpoint(run.layout, step, *models.parts())
        state = TrainState(**extra["train_state"])
        models.load_state(extra)
        log.info("resumed from checkpoint step %d (weights v%d)", state.step, state.version)
    # A trainer that died after publishing but before checkpointing: never reuse a version number.
    state.version = max(state.version, on_rank0(lambda: _newest_version(run)))
    state.begin(epoch)
    return state


# ------------------------------------------------------------------------------------------------------ feeding


class Feeder:
    """Rank 0 plans or replays each step; every rank gets the step's samples. Waits while too few exist."""

    def __init__(self, run: Run, state: TrainState, plan_log: PlanLog | None, stop: StopFlag):
        self.run, self.stop = run, stop
        self.timed_out = False
        self.planner: Planner | None = None
        self.backlog: BacklogCounter | None = None
        self.replay: dict[int, Any] = {}
        if plan_log is not None:
            self.planner = Planner(run.layout, plan_log, run.config.model.vocab_size)
            self.backlog = BacklogCounter(run.layout)
            self.replay = {p.step: p for p in plan_log.replay(after_step=state.step)}
            if self.replay:
                log.info("replaying recorded plans of steps %s", sorted(self.replay))

    def _rank0_try(self, step: int, version: int) -> StepBatch | None:
        assert self.planner is not None
        if step in self.replay:
            plan = self.replay.pop(step)
            return StepBatch(self.planner.replay(plan), len(plan.dropped_ids), replayed=True)
        t, a = self.run.config.trainer, self.run.config.algorithm
        got = self.planner.try_plan(
            step, t.samples_per_step, version, t.max_staleness, a.staleness_mode == "drop"
        )
        return None if got is None else StepBatch(got[1], len(got[0].dropped_ids), replayed=False)

    def _rank0_poll(self, step: int, version: int, since: float) -> StepBatch | str | None:
        assert self.planner is not None
        self.planner.log.check_not_fenced()  # also while waiting: a fenced trainer must not linger
        batch = self._rank0_try(step, version)
        timeout = self.run.config.trainer.step_wait_timeout_s
        if batch is None and timeout is not None and time.monotonic() - since > timeout:
            return "timeout"
        return batch

    def next(self, step: int, version: int, report: Reporter) -> tuple[StepBatch | None, float]:
        """The samples of ``step`` (None when stopping) and the seconds spent waiting for them."""
        t0 = time.monotonic()
        while not self.stop.agreed():
            got = on_rank0(lambda: self._rank0_poll(step, version, t0))
            if isinstance(got, StepBatch):
                return got, time.monotonic() - t0
            if got == "timeout":
                self.timed_out = True
                break
            report.status("waiting", step - 1, version, self.counts())
            time.sleep(self.run.config.trainer.poll_interval_s)
        return None, time.monotonic() - t0

    def counts(self) -> dict[str, int]:
        """The run's backlog (``buffer.status.Backlog``) and the shards this trainer quarantined (rank 0)."""
        if self.planner is None or self.backlog is None:
            return {}
        return {**self.backlog.read().as_counts(), "quarantined": self.planner.cache.quarantined}


# ---------------------------------------------------------------------------------------------------- reporting


class Reporter:
    """Rank 0's outputs: metrics (JSONL, TensorBoard), the status record and the step line; no-ops elsewhere."""

    def __init__(self, run: Run, epoch: int, state: TrainState):
        self.epoch, self.resumed_from = epoch, state.step
        self.sink: Sinks | None = None
        self.writer: heartbeats.StatusWriter[TrainerStatus] | None = None
        if tdist.is_main():
            tb = run.layout.root / "tensorboard" if run.config.trainer.tensorboard else None
            self.sink = open_sinks(run.layout.metrics_file("trainer"), tb)
            self.writer = heartbeats.trainer_status(run.layout, epoch=epoch, resumed_from=state.step)

    def status(self, what: str, step: int, version: int, counts: dict[str, int], **extra: Any) -> None:
        if self.writer is not None:
            self.writer.update(state=what, step=step, published_version=version, **counts, **extra)

    def step(self, step: int, metrics: dict[str, float], state: TrainState, counts: dict[str, int]) -> None:
        if self.sink is None:
            return
        self.sink.log({**metrics, "epoch": self.epoch, "resumed_from": self.resumed_from}, step)
        log.info(step_line(step, metrics))
        self.status(
            "training",
            step,
            state.version,
            counts,
            samples_trained=state.samples_trained,
            dropped_stale=state.dropped_stale,
        )

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def step_metrics(
    batch: StepBatch, m: dict[str, float], version: int, wait_s: float, step_s: float
) -> dict[str, float]:
    samples = batch.samples
    stale = [version - s.policy_version for s in samples]
    tokens = sum(s.length for s in samples)
    return {
        **m,
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "reward_max_frac": sum(1 for s in samples if s.reward >= 1.0) / len(samples),
        "samples": len(samples),
        "dropped_stale": batch.dropped,
        "replayed": int(batch.replayed),
        "staleness_mean": sum(stale) / len(stale),
        "staleness_max": max(stale),
        "tokens_per_s": tokens / max(step_s, 1e-9),
        "wait_s": wait_s,
        "wait_frac": wait_s / max(wait_s + step_s, 1e-9),
        "version": version,
    }


# ------------------------------------------------------------------------------------------- publish and save


def check_fence(plan_log: PlanLog | None) -> None:
    """Raise FencedError on every rank once a newer trainer incarnation has claimed the run."""
    on_rank0(lambda: plan_log.check_not_fenced() if plan_log is not None else None)


def publish(run: Run, models: Models, state: TrainState, final: bool = False) -> float:
    """Publish the next version: full weights, or with LoRA the adapter, merged into full weights every
    model.lora.merge_every versions and when ``final`` (the end of this trainer run)."""
    t0 = time.monotonic()
    cfg = run.config
    version = state.version + 1
    tied = bool(getattr(models.actor.config, "tie_word_embeddings", False))
    lora = cfg.model.lora if cfg.model.lora.enabled else None
    merged = lora is not None and (final or (lora.merge_every > 0 and version % lora.merge_every == 0))
    publish_weights(
        models.actor,
        run.layout,
        version,
        state.step,
        dtype=resolve_dtype(cfg.model.dtype, cuda=tdist.current_device().type == "cuda"),
        tied=tied,
        src_model_dir=run.model_dir,
        lora=lora,
        merged=merged,
    )
    state.version = version
    state.merged_step = state.step if merged else state.merged_step
    if tdist.is_main():
        weights.garbage_collect(
            run.layout, cfg.run.keep_weight_versions, heartbeats.versions_in_use(run.layout)
        )
    return time.monotonic() - t0


def save(run: Run, models: Models, state: TrainState) -> None:
    ckpt.save_checkpoint(
        run.layout,
        state.step,
        *models.parts(),
        {"train_state": asdict(state), **models.state()},
        keep=run.config.trainer.keep_checkpoints,
    )


# ---------------------------------------------------------------------------------------------------- the loop


def run_steps(
    run: Run, models: Models, state: TrainState, feeder: Feeder, report: Reporter, plan_log: PlanLog | None
) -> None:
    t = run.config.trainer
    pad_id = int(getattr(models.actor.config, "pad_token_id", None) or 0)
    done, last_saved = 0, state.step
    while t.max_steps is None or done < t.max_steps:
        step = state.step + 1
        batch, wait_s = feeder.next(step, state.version, report)
        if batch is None:
            break
        report.status("training", state.step, state.version, feeder.counts())
        t0, version = time.monotonic(), state.version
        m = train_step(run.config, models, batch.samples, pad_id)
        state.advance(step, batch)
        done, step_s = done + 1, time.monotonic() - t0
        if step % t.publish_every == 0:
            check_fence(plan_log)
            m["publish_s"] = publish(run, models, state, final=done == t.max_steps)
        if step % t.save_every == 0:
            check_fence(plan_log)
            save(run, models, state)
            last_saved = step
        report.step(step, step_metrics(batch, m, version, wait_s, step_s), state, feeder.counts())
    if run.config.model.lora.enabled and done and state.merged_step != state.step:
        check_fence(plan_log)  # a LoRA run ends on merged full weights
        publish(run, models, state, final=True)
    if state.step != last_saved:
        check_fence(plan_log)
        save(run, models, state)


def train(run: Run) -> TrainState:
    """The whole trainer on this rank; raises FencedError / TimeoutError (on every rank alike) to stop early."""
    tdist.init()
    setup_logging(tdist.rank())
    stop = StopFlag()
    plan_log, epoch = claim(run)
    models = build_models(run)
    state = resume(run, models, epoch)
    feeder = Feeder(run, state, plan_log, stop)
    report = Reporter(run, epoch, state)
    try:
        run_steps(run, models, state, feeder, report, plan_log)
        report.status("stopped", state.step, state.version, feeder.counts())
    finally:
        report.close()
    if feeder.timed_out:
        t = run.config.trainer
        raise TimeoutError(
            f"step {state.step + 1}: fewer than trainer.samples_per_step = {t.samples_per_step} usable samples "
            f"after trainer.step_wait_timeout_s = {t.step_wait_timeout_s}s; trained and checkpointed up to step {state.step}"
        )
    return state


def run_trainer(run: Run) -> int:
    """Exit status: 0 done, 3 fenced out by a newer incarnation, 4 gave up waiting for samples (a bad config never
    gets here: the config rules refused it when the run was opened)."""
    torch.manual_seed(run.config.run.seed)
    try:
        train(run)
    except FencedError as e:
        code, msg = EXIT_FENCED, f"trainer: stopped: {e}"
    except TimeoutError as e:
        code, msg = EXIT_TIMEOUT, f"trainer: gave up: {e}"
    else:
        tdist.teardown()
        return 0
    if tdist.is_main():
        print(msg, file=sys.stderr, flush=True)
    tdist.teardown()  # every rank raised at the same point, so the barrier in here is safe
    return code
