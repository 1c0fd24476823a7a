"""The trainer's loop: claim the run, resume, then plan or replay each step, train it, publish, checkpoint, report.

Reads like a table of contents; the pieces live in ``feed`` (planning ahead, waiting, replay), ``step`` (losses),
``versions`` (asynchronous publish and its retries) and ``checkpoint``.  Run by ``python -m trainer`` under torchrun
(or as one process).

Decisions that depend on shared storage (which checkpoint to resume, what the next step trains on, whether a newer
incarnation took over) are taken by rank 0 and broadcast, so every rank runs the same sequence of collectives.
A trainer that finds itself fenced out by a newer incarnation stops before it writes a plan, publishes weights or
saves a checkpoint, and exits non-zero.  A storage error while publishing or checkpointing (a full disk) never ends
the trainer: it is reported in the status record (``last_error``) and retried (``versions``, ``Saver``).

Each step's wall time is split into wait, plan, load, compute, publish and checkpoint (seconds and fractions in
RUN/metrics/trainer.jsonl); with the next step planned during the compute and the weights written during the next
compute, a step with samples ready costs little more than its compute.
"""

from __future__ import annotations

import logging
import resource
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from buffer import heartbeats
from buffer.logs import logger, setup_logging
from buffer.metrics import Sinks, open_sinks, wandb_target
from buffer.plans import FencedError, PlanLog, mark_poisoned
from buffer.records import RecordError, RunFinished, TrainerStatus
from buffer.run import Run
from buffer.status import mark_finished, read_finished
from trainer import checkpoint as ckpt
from trainer import dist as tdist
from trainer.data import Sample
from trainer.feed import Feeder, StepBatch, on_rank0
from trainer.lora import AdaptersOff
from trainer.metrics import step_line
from trainer.model import build_actor, build_critic, build_reference
from trainer.optim import build_optimizer, build_scheduler
from trainer.step import Models, fused_head_applies, kl_controller, train_step
from trainer.versions import Versions, check_fence, latest_problem, starting_version

log = logger("trainer")

# A trainer fenced out by a newer incarnation stops cleanly: the run goes on there, and a non-zero status would make
# torchrun print a traceback of a failure that is none.
EXIT_FENCED = 0
EXIT_STORAGE = 1  # storage failed under the trainer (the last checkpoint could not be saved)
EXIT_TIMEOUT = 4
EXIT_POISONED = 5


class PoisonedStep(RuntimeError):
    """A step's data failed the trainer; the step is marked so that its replay leaves the data out."""


PHASES = ("wait", "plan", "load", "compute", "publish", "checkpoint")
FINAL_SAVE_ATTEMPTS = 4


@dataclass
class TrainState:
    step: int = 0  # last step (a step that only dropped stale samples counts)
    version: int = 0  # weight version the trainer's weights were last published as
    samples_trained: int = 0
    dropped_stale: int = 0
    replay_missing: int = 0  # replayed samples that could not be read back (their shard gone or damaged)
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
        self.replay_missing += len(batch.missing)
        self.lineage[-1][2] = step


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


# ----------------------------------------------------------------------------------------------------- start-up


def claim(run: Run) -> tuple[PlanLog | None, int]:
    """Rank 0 claims the next trainer epoch (fencing out older incarnations) before anything is loaded."""
    resumed = ckpt.latest_complete_checkpoint(run.layout) or 0  # its plans stay valid even if not yet listed
    plan_log = PlanLog.claim(run.layout, resumed_step=resumed) if tdist.is_main() else None
    return plan_log, tdist.broadcast_object(plan_log.epoch if plan_log is not None else 0)


def build_models(run: Run) -> Models:
    cfg, device, t = run.config, tdist.current_device(), run.config.trainer
    sharding: dict[str, Any] = {
        "param_dtype": t.param_dtype,
        "activation_checkpointing": t.activation_checkpointing,
        "activation_offload": t.activation_offload,
        "checkpoint_skip": t.activation_checkpointing_skip,
        "cpu_offload": t.cpu_offload,
        "kernels": t.kernels,
        "prefetch": t.fsdp_prefetch,
    }
    schedule: dict[str, Any] = {
        "warmup_steps": t.warmup_steps,
        "schedule": t.schedule,
        "total_steps": t.total_steps,
    }
    if (t.fused_head or t.compile_head) and not fused_head_applies(cfg) and tdist.is_main():
        why = (
            "is off"
            if not t.fused_head
            else "does not apply (this loss couples tokens, or runs sequence-parallel)"
        )
        unused = "; trainer.compile_head = true has no effect" if t.compile_head else ""
        log.info(f"trainer.fused_head {why}: the LM head recomputes its chunks in backward{unused}")
    actor = build_actor(run.model_dir, device, **sharding, lora=cfg.model.lora)
    opt = build_optimizer(actor, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    models = Models(actor, opt, build_scheduler(opt, **schedule), kl=kl_controller(cfg))
    if cfg.algorithm.kl_coef > 0:  # with LoRA: the actor with its adapters off, no second base
        models.reference = (
            AdaptersOff(actor)
            if cfg.model.lora.enabled
            else build_reference(
                run.model_dir,
                device,
                param_dtype=t.param_dtype,
                cpu_offload=t.cpu_offload,
                kernels=t.kernels,
                prefetch=t.fsdp_prefetch,
            )
        )
    if cfg.algorithm.name == "ppo":
        models.critic = build_critic(t.critic_path or run.model_dir, device, **sharding, lora=t.critic_lora)
        models.critic_optimizer = build_optimizer(
            models.critic, lr=t.critic_lr, betas=t.betas, weight_decay=t.weight_decay
        )
        models.critic_scheduler = build_scheduler(models.critic_optimizer, **schedule)
    return models


def resume(run: Run, models: Models, epoch: int) -> TrainState:
    state = TrainState()
    step = on_rank0(lambda: ckpt.latest_complete_checkpoint(run.layout))
    if step is not None:
        extra = ckpt.load_checkpoint(run.layout, step, *models.parts())
        state = TrainState(**extra["train_state"])
        models.load_state(extra)
        log.info("resumed from checkpoint step %d (weights v%d)", state.step, state.version)
    # A trainer that died after publishing but before checkpointing: never reuse a version number (but never
    # adopt the number of a LATEST that points at nothing either).
    state.version = on_rank0(lambda: starting_version(run.layout, state.version))
    state.begin(epoch)
    return state


# ---------------------------------------------------------------------------------------------------- reporting


class Reporter:
    """Rank 0's outputs: metrics (JSONL, TensorBoard), the status record and the step line; no-ops elsewhere."""

    def __init__(self, run: Run, epoch: int, state: TrainState):
        self.epoch, self.resumed_from = epoch, state.step
        self.sink: Sinks | None = None
        self.writer: heartbeats.StatusWriter[TrainerStatus] | None = None
        self.last_error: str | None = None
        self.publishing: int | None = None  # the version being written in the background
        if tdist.is_main():
            tb = run.layout.tensorboard if run.config.trainer.tensorboard else None
            self.sink = open_sinks(run.layout.metrics_file("trainer"), tb, wandb_target(run, "trainer"))
            self.writer = heartbeats.trainer_status(run.layout, epoch=epoch, resumed_from=state.step)

    def error(self, message: str) -> None:
        """A storage error the trainer keeps going through: logged, and kept in the status record."""
        self.last_error = message
        log.error("%s", message)

    def feed(self, fields: dict[str, Any]) -> None:
        """The feed fields (``feed.FeedKeeper``), merged into the status record from the feed's thread."""
        if self.writer is None:
            return
        try:
            self.writer.update(**fields)
        except OSError as e:
            log.warning("status record not written: %s", e)

    def status(
        self, what: str, state: TrainState, counts: dict[str, Any], waiting: str | None = None
    ) -> None:
        if self.writer is None:
            return
        try:
            self.writer.update(
                state=what,
                step=state.step,
                published_version=state.version,
                publishing=self.publishing,
                samples_trained=state.samples_trained,
                dropped_stale=state.dropped_stale,
                waiting=waiting,
                last_error=self.last_error,
                **counts,
            )
        except OSError as e:  # the status record is for people: a full disk must not stop training
            log.warning("status record not written: %s", e)

    def step(
        self, step: int, metrics: dict[str, Any], state: TrainState, counts: dict[str, Any], next_wait: str
    ) -> None:
        """Log ``step``'s metrics and line; the record then says the trainer waits, for ``next_wait``."""
        if self.sink is None:
            return
        try:
            self.sink.log({**metrics, "epoch": self.epoch, "resumed_from": self.resumed_from}, step)
        except OSError as e:
            self.error(f"metrics not written: {e}")
        log.info(step_line(step, metrics))
        # The step is computed: from here until the next one starts, no step is on its way.  A synchronous worker
        # waits while the record says "training" (rollout_worker/following.py), so saying so any longer would hold
        # every worker back until the feeder's first status round, a second per step.
        self.status("waiting", state, counts, waiting=next_wait)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def peak_memory_gib() -> float:
    """Peak device memory of this step on GPU (then reset); the process's peak resident size on CPU."""
    device = tdist.current_device()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def step_metrics(
    batch: StepBatch, m: dict[str, float], version: int, times: dict[str, float]
) -> dict[str, Any]:
    total = sum(times.get(p, 0.0) for p in PHASES)
    out: dict[str, Any] = {**m, "step_s": total, "version": version}
    for p in PHASES:
        out[f"{p}_s"] = times.get(p, 0.0)
        out[f"{p}_frac"] = times.get(p, 0.0) / max(total, 1e-9)
    out.update(
        samples=len(batch.samples),
        dropped_stale=batch.dropped,
        replayed=int(batch.replayed),
        prefetched=int(batch.prefetched),
        replay_missing=len(batch.missing),
    )
    for k in ("prefetch", "publish_write"):
        if k in times:
            out[f"{k}_s"] = times[k]
    if batch.missing:
        out["replay_missing_ids"] = batch.missing
    samples = batch.samples
    if samples:
        stale = [version - s.policy_version for s in samples]
        out.update(
            reward_mean=sum(s.reward for s in samples) / len(samples),
            reward_max_frac=sum(1 for s in samples if s.reward >= 1.0) / len(samples),
            staleness_mean=sum(stale) / len(stale),
            staleness_max=max(stale),
            **token_staleness(samples, version),
            tokens_per_s=sum(s.length for s in samples) / max(times.get("compute", 0.0), 1e-9),
            peak_mem_gib=peak_memory_gib(),
        )
    return out


def token_staleness(samples: list[Sample], version: int) -> dict[str, float]:
    """Staleness per loss token: ``token_staleness_mean``, the mean of ``version`` less the version that sampled
    each token (a response generated across a weight update has several), and ``mixed_version_samples``, the
    samples whose model tokens come from more than one version.  Staleness rules judge a sample by its oldest
    token (``policy_version``) instead."""
    total, tokens, mixed = 0, 0, 0
    for s in samples:
        if s.token_versions is None:  # the common case, without a list per token
            n = s.loss_tokens
            total += (version - s.policy_version) * n
        else:
            versions = s.model_versions()
            n = len(versions)
            total += version * n - sum(versions)
            mixed += int(len(set(versions)) > 1)
        tokens += n
    return {"token_staleness_mean": total / max(tokens, 1), "mixed_version_samples": mixed}


# ------------------------------------------------------------------------------------------- publish and save


class Saver:
    """Checkpoints every trainer.save_every steps.  A failed save (a full disk) is reported, its incomplete
    directory removed, and tried again 1, 2, 4... steps later while training goes on: checkpoints only shorten a
    replay after a crash, so they are not worth stopping for."""

    def __init__(self, run: Run, state: TrainState, report: Reporter):
        self.run, self.report = run, report
        self.last_saved = state.step
        self.retry_at: int | None = None
        self.backoff = 1

    def due(self, step: int) -> bool:
        return step % self.run.config.trainer.save_every == 0 or (
            self.retry_at is not None and step >= self.retry_at
        )

    def save(self, models: Models, state: TrainState) -> bool:
        """Save ``state.step`` (collective); False when it failed (reported, retried later)."""
        try:
            ckpt.save_checkpoint(
                self.run.layout,
                state.step,
                *models.parts(),
                {"train_state": asdict(state), **models.state()},
                keep=self.run.config.trainer.keep_checkpoints,
            )
        except (OSError, ckpt.CheckpointError, CheckpointException) as e:
            self._failed(state.step, e)
            return False
        self.last_saved, self.retry_at, self.backoff = state.step, None, 1
        return True

    def _failed(self, step: int, e: BaseException) -> None:
        self.report.error(f"checkpoint of step {step} failed: {_cause(e)}")
        if tdist.is_main() and not ckpt.is_complete(self.run.layout, step):
            shutil.rmtree(self.run.layout.checkpoint(step), ignore_errors=True)  # its space back
        tdist.barrier()
        self.retry_at = step + self.backoff
        self.backoff = min(2 * self.backoff, self.run.config.trainer.save_every)

    def final(self, models: Models, state: TrainState, stop: StopFlag) -> None:
        """The last save of this incarnation, tried a few times (1, 2, 4 s apart) before giving up."""
        for attempt in range(FINAL_SAVE_ATTEMPTS):
            if state.step == self.last_saved or self.save(models, state):
                return
            if attempt + 1 < FINAL_SAVE_ATTEMPTS:
                time.sleep(2.0**attempt)
        raise OSError(f"no checkpoint of step {state.step}: {self.report.last_error}")


def _cause(e: BaseException) -> str:
    """One line for a failed save: DCP wraps each rank's error (with its traceback) in a CheckpointException."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------------- the loop


@dataclass
class Loop:
    run: Run
    models: Models
    state: TrainState
    feeder: Feeder
    report: Reporter
    versions: Versions
    saver: Saver
    plan_log: PlanLog | None


def feed(loop: Loop, step: int) -> StepBatch | None:
    """The next step's samples; while waiting, the status says for what, and the publish in flight is settled."""
    state, report = loop.state, loop.report

    def waiting(what: str) -> None:
        report.status("waiting", state, loop.feeder.counts(), waiting=what)

    def idle() -> dict[str, float]:
        return loop.versions.settle(loop.models, state)

    return loop.feeder.next(step, state.version, waiting, idle)


def train_one(
    loop: Loop, step: int, batch: StepBatch, last: bool, pad_id: int
) -> tuple[dict[str, float], float]:
    """Compute ``step`` (rank 0 plans the next one meanwhile); its metrics and compute seconds."""
    if not batch.samples:  # a step of drops only, or a replay whose samples are all gone
        return {}, 0.0
    loop.report.status("training", loop.state, loop.feeder.counts())
    if not last:
        loop.feeder.prefetch(step + 1, loop.versions.version_after(step, loop.state, batch))
    t0 = time.monotonic()
    try:
        m = train_step(loop.run.config, loop.models, batch.samples, pad_id)
    except torch.OutOfMemoryError as e:
        # Its data fails the step (the planner refuses samples past the run's limits, so this is a batch too big
        # for the device): recorded, so that the restart replays the step without it instead of failing again.
        reason = f"out of memory: {str(e).splitlines()[0][:300]}"
        mark_poisoned(loop.run.layout, step, loop.report.epoch, reason)
        raise PoisonedStep(
            f"step {step}: {reason}; marked poisoned, a restart replays it without its samples"
        ) from e
    return m, time.monotonic() - t0


def run_steps(loop: Loop) -> None:
    t, state = loop.run.config.trainer, loop.state
    pad_id = int(getattr(loop.models.actor.config, "pad_token_id", None) or 0)
    done = 0  # steps trained by this invocation (steps of drops only do not count)
    carried: dict[str, float] = {}  # the previous step's checkpoint time, logged with this step
    # trainer.total_steps is the run's budget, over every incarnation; max_steps bounds this one
    while (t.max_steps is None or done < t.max_steps) and state.step < t.total_steps:
        step = state.step + 1
        batch = feed(loop, step)
        if batch is None:
            break
        times = {**batch.timings, **carried}
        carried = {}
        last = (t.max_steps is not None and done + 1 == t.max_steps) or step == t.total_steps
        version = state.version
        m, times["compute"] = train_one(loop, step, batch, last, pad_id)
        done += int(bool(batch.samples))
        state.advance(step, batch)
        if loop.versions.due(step, batch):
            times.update(loop.versions.publish(loop.models, state, final=last))
        # The record goes before the checkpoint: a checkpointed step is never trained again, so a crash between
        # the two would lose its record for good; the checkpoint's time is logged with the next step.
        saving = loop.saver.due(step)
        next_samples = f"samples of step {step + 1}"
        next_wait = f"checkpoint of step {step}" if saving else next_samples
        loop.report.step(step, step_metrics(batch, m, version, times), state, loop.feeder.counts(), next_wait)
        if saving:
            t0 = time.monotonic()
            carried = loop.versions.settle(loop.models, state)  # a checkpoint names committed versions only
            check_fence(loop.plan_log)
            loop.saver.save(loop.models, state)
            carried["checkpoint"] = time.monotonic() - t0
            loop.report.status("waiting", state, loop.feeder.counts(), waiting=next_samples)
    finish(loop, done)


def finish(loop: Loop, done: int) -> None:
    """End on committed weights (merged full weights for LoRA) and a checkpoint of the last step."""
    state = loop.state
    if loop.run.config.model.lora.enabled and done and state.merged_step != state.step:
        loop.versions.publish(loop.models, state, final=True)
    loop.versions.settle(loop.models, state)
    if state.step != loop.saver.last_saved:
        check_fence(loop.plan_log)
        loop.saver.final(loop.models, state, loop.feeder.stop)


def finished_before(run: Run) -> RunFinished | None:
    """The run's finished record, read on rank 0; a damaged one stops every rank alike (OSError, one line)."""

    def read() -> RunFinished | str | None:
        try:
            return read_finished(run.layout)
        except RecordError as e:
            return f"{e} (remove it only if the run is to go on)"

    found = on_rank0(read)
    if isinstance(found, str):
        raise OSError(found)
    return found


def mark_done(loop: Loop) -> None:
    """Once the budget is trained (and checkpointed), the finished record tells every process of the run."""
    state, total = loop.state, loop.run.config.trainer.total_steps
    if state.step < total or not tdist.is_main():
        return
    mark_finished(loop.run.layout, state.step, total, state.version, loop.report.epoch)
    log.info("run finished: step %d of trainer.total_steps = %d", state.step, total)


def train(run: Run) -> TrainState:
    """The whole trainer on this rank; raises FencedError / TimeoutError (on every rank alike) to stop early."""
    tdist.init()
    # rank 0 logs at INFO; the other ranks only warnings, so the console shows one line per step
    setup_logging("trainer", level=logging.INFO if tdist.is_main() else logging.WARNING)
    done = finished_before(run)
    if done is not None:
        if tdist.is_main():
            print(
                f"trainer: run already finished at step {done.step} (trainer.total_steps = {done.total_steps}); "
                "nothing to do",
                file=sys.stderr,
                flush=True,
            )
        return TrainState(step=done.step, version=done.published_version)
    stop = StopFlag()
    plan_log, epoch = claim(run)
    models = build_models(run)
    state = resume(run, models, epoch)
    feeder = Feeder(run, state.step, plan_log, stop)
    report = Reporter(run, epoch, state)
    feeder.start_feed(report.feed)
    problem = on_rank0(lambda: latest_problem(run.layout))
    if problem is not None:  # the next commit replaces it
        report.error(f"{problem}; publishing v{state.version + 1} next")
    versions = Versions(run, plan_log, report, stop)
    loop = Loop(run, models, state, feeder, report, versions, Saver(run, state, report), plan_log)
    try:
        run_steps(loop)
        mark_done(loop)
        report.status("stopped", state, feeder.counts())
    finally:
        feeder.close()
        versions.close()
        report.close()
    if feeder.timed_out:
        t = run.config.trainer
        raise TimeoutError(
            f"step {state.step + 1}: fewer than trainer.samples_per_step = {t.samples_per_step} usable samples "
            f"after trainer.step_wait_timeout_s = {t.step_wait_timeout_s}s; trained and checkpointed up to step {state.step}"
        )
    return state


def run_trainer(run: Run) -> int:
    """Exit status: 0 done or fenced out by a newer incarnation, 1 the last checkpoint could not be saved, 4 gave up
    waiting for samples, 5 a step's data failed it (marked poisoned: a restart replays the step without it) (a bad config never gets here: the config rules refused it when the run was opened)."""
    torch.manual_seed(run.config.run.seed)
    try:
        train(run)
    except FencedError as e:
        code, msg = EXIT_FENCED, f"trainer: stopped: {e}; the newer trainer goes on with the run"
    except TimeoutError as e:
        code, msg = EXIT_TIMEOUT, f"trainer: gave up: {e}"
    except PoisonedStep as e:
        code, msg = EXIT_POISONED, f"trainer: stopped: {e}"
    except OSError as e:
        code, msg = EXIT_STORAGE, f"trainer: stopped: {e}"
    else:
        tdist.teardown()
        return 0
    if tdist.is_main():
        print(msg, file=sys.stderr, flush=True)
    tdist.teardown()  # every rank raised at the same point, so the barrier in here is safe
    return code
