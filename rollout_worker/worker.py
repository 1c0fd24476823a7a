"""One rollout worker: an engine on one device that turns prompts into published experience shards.

Started by the node supervisor as its own process (one per leased worker slot)::

    python -m rollout_worker.worker --run RUN --slot K [--worker-id wK] [--section.key value ...]

and runnable by hand the same way.  The worker is a host around one rollout source (``rollout_worker/sources``:
single-turn batches, single-turn streaming, or multi-turn episodes), which makes and scores samples; the host owns
everything else.  Its loop: ask the source for a step; the source asks ``admit`` before it starts samples, which
follows the trainer's weight versions (``following``) and refuses while more than ``rollout.max_staleness``
versions behind (state ``paused``, reason ``stale``) or while the run's unconsumed backlog is above
``rollout.max_backlog_samples`` (reason ``backlog``); both count the samples the other workers are generating (their
``in_flight``, as the trainer's record last copied it: ``admission``), so a fleet stops where one worker would,
instead of overshooting by a batch per worker into samples the trainer drops as stale, and a check reads one file
whatever the fleet's size.  What the step made is counted once and published as whole groups (``publishing``).

How it ends (``lifecycle``): SIGTERM/SIGINT, or the supervisor dying, drains: the batch in flight is finished, every
complete group is published, state ``stopped``, exit 0.  A signal while the engine is still starting, or a second
Ctrl-C, stops at once, still with state ``stopped``.  A worker whose slot's lease is no longer its supervisor's, or no
longer renewed, stops by itself without publishing anything more (exit 75).  A batch that cannot finish in time dies
with the process when the supervisor kills it at its deadline; shards are published atomically, so nothing partial
ever appears.

Exit codes: 0 after a drain, 2 for a user-caused problem (one line on stderr: bad prompts file, missing model,
unknown reward), 75 when the slot's lease was lost, 1 for anything else, e.g. the engine crashed (it raised, or one of
its processes died); the supervisor then restarts the worker, which is how a worker survives its engine crashing.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from buffer import metrics
from buffer.config import parse_overrides
from buffer.control import LeaseWatch
from buffer.heartbeats import load_worker, worker_status
from buffer.logs import setup_logging
from buffer.records import RecordError
from buffer.run import Run, open_run
from buffer.shards import ShardWriter, new_incarnation
from rollout_worker.admission import Admission, View
from rollout_worker.engines import EngineSpec, build, resolve_kind
from rollout_worker.engines.base import weight_loader
from rollout_worker.envs import EPISODE_COUNTERS
from rollout_worker.following import WeightFollower
from rollout_worker.lifecycle import (
    EXIT_CRASH,
    EXIT_LEASE,
    EXIT_OK,
    EXIT_USER,
    Lifecycle,
    child_pids,
    leave,
)
from rollout_worker.preflight import USER_ERRORS, preflight
from rollout_worker.prompts import (
    Prompt,
    PromptStream,
    derive_seed,
    make_encoder,
)
from rollout_worker.publishing import GroupPublisher
from rollout_worker.rewards import Scorer
from rollout_worker.sources import Produced, RolloutSource
from rollout_worker.sources.episodes import make_task
from rollout_worker.sources.make import make_source
from rollout_worker.sources.streaming import max_in_flight
from rollout_worker.streaming import LengthDraw

__all__ = ["EXIT_CRASH", "EXIT_LEASE", "EXIT_OK", "EXIT_USER", "USER_ERRORS", "preflight", "worker_id_for"]

PAUSE_S = 0.5  # a paused worker looks again this often (or at every weights poll, when that is sooner)
# Another worker's in-flight samples count while its record is younger than this many heartbeats plus the clock
# skew between nodes (records carry the writer's wall clock).
IN_FLIGHT_BEATS = 5
CLOCK_SKEW_S = 10.0
log = logging.getLogger("shardrl.rollout")


def worker_id_for(slot: int) -> str:
    return f"w{slot}"


class RolloutWorker:
    """The loop of one worker process, the host of one rollout source (``rollout_worker/sources``); ``serve()``
    returns the exit code."""

    def __init__(
        self, run: Run, slot: int, worker_id: str, life: Lifecycle, *, supervisor: str | None = None
    ):
        self.run = run
        self.cfg = run.config
        self.layout = run.layout
        self.slot = slot
        self.worker_id = worker_id
        self.life = life
        self.incarnation = new_incarnation()
        self.previous = _previous_record(run, worker_id)
        hb = self.cfg.run.heartbeat_interval_s
        self.admission = Admission(
            self.layout,
            worker_id,
            self.incarnation,
            max_age_s=IN_FLIGHT_BEATS * hb + CLOCK_SKEW_S,
            fallback_every_s=hb,
            supervisor=supervisor,
        )
        self.status = worker_status(
            self.layout, worker_id, slot=slot, supervisor=supervisor, incarnation=self.incarnation
        )
        r = self.cfg.rollout
        self.publisher = GroupPublisher(
            ShardWriter(self.layout, run.run_id, worker_id, self.incarnation),
            shard_samples=r.shard_samples,
            flush_interval_s=r.flush_interval_s,
            io_lock=life.io_lock,
            may_publish=lambda: life.fenced is None,
        )
        self.engine: Any = None
        self.source: RolloutSource | None = None
        self.weights: WeightFollower | None = None
        self._view: View | None = None  # what admission last read of the run
        self._viewed_at = -math.inf
        self._since = 0  # samples the source started since that view
        self.sink = metrics.wandb_sinks(run, f"rollout-{worker_id}")  # JSONL is written by _metrics itself
        self.counters = {
            "samples": 0,
            "tokens": 0,
            "shards": 0,
            "dropped_too_long": 0,
            "dropped_reward_groups": 0,
            "dropped_reward_samples": 0,
            "dropped_bad_logprob_groups": 0,
            "reward_timeouts": 0,
            "aborted_stale_samples": 0,
            "errors": 0,
        }
        life.final_status = self._final_status

    @property
    def batches(self) -> int:
        return self.source.batches if self.source is not None else 0

    @property
    def pending_samples(self) -> int:
        return self.publisher.pending_samples

    # ------------------------------------------------------------------ the loop, as a table of contents

    def serve(self, prompts: list[Prompt], scorer: Scorer) -> int:
        try:
            self._start(prompts, scorer)
            self._loop()
            return self._finish()
        except USER_ERRORS as e:
            self.publisher.discard()
            self._set(state="failed", last_error=str(e))
            print(f"shardrl-rollout worker {self.worker_id}: {e}", file=sys.stderr)
            return EXIT_USER
        except Exception as e:
            return self._crashed(e)
        finally:
            self.life.phase = "closing"
            for closing in (self.sink, self.source, self.engine):
                if closing is not None:
                    with contextlib.suppress(Exception):
                        closing.close()

    def _loop(self) -> None:
        """Step the source while admission lets it, count and publish what it made; drain it at the end."""
        assert self.source is not None
        while not self.life.stop_requested:
            out = self.source.step(self.admit)
            self._since += out.started
            if out.paused is not None:
                view = self._view
                self._pause(
                    out.paused, **({"backlog": view.backlog} if out.paused == "backlog" and view else {})
                )
                self._view = None  # read the run again after a pause
                continue
            self._take(out)
            self._publish()
            self.source.tick()
        self.source.drain(self._take, lambda: self.life.fenced is None)

    def _finish(self) -> int:
        """The loop stopped: publish what is complete (unless the slot is no longer ours), state ``stopped``."""
        if self.life.fenced is not None:
            self.publisher.discard()
            self._set(state="stopped", last_error=self.life.fenced, **self.counters)
            return EXIT_LEASE
        self._publish(everything=True)
        self._set(state="stopped", **self.counters)
        log.info("%s: stopped after %d samples", self.worker_id, self.counters["samples"])
        return EXIT_OK

    def _crashed(self, e: Exception) -> int:
        self.publisher.writer.discard()  # rows of a shard that failed half way; whole groups stay
        line = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        if self.life.fenced is not None:
            self.publisher.discard()
            self._set(state="stopped", last_error=self.life.fenced, **self.counters)
            return EXIT_LEASE
        if self.life.stop_requested:  # the engine went down with us (e.g. Slurm signalled the whole step)
            self._publish(everything=True)
            self._set(state="stopped", last_error=line, **self.counters)
            return EXIT_OK
        traceback.print_exc()
        self._set(state="failed", last_error=line, **self.counters)
        return EXIT_CRASH

    # ------------------------------------------------------------------ admission, for every source

    def view(self) -> View | None:
        return self._view

    def admit(self, extra: int = 0, poll: bool = True) -> str | None:
        """Why no more samples may start now (``stale`` / ``backlog``), or None.  What the trainer will have
        without them: the backlog, ours waiting or generating, the other workers' batches; ``extra`` samples the
        source is starting now.  ``poll``: read the run's state again when it is due and load a newer version first
        when one is (``catch_up``); a source asks without it for each of the samples it starts in a row, so that
        those are counted once, in ``extra``, against one view."""
        assert self.weights is not None and self.source is not None
        now = time.monotonic()
        if self._view is None or (poll and now - self._viewed_at >= self.source.admission_every_s):
            pending = self.publisher.pending_samples + self.source.generating()
            self._view = self.admission.view(self.publisher.published_samples, pending)
            self._viewed_at, self._since = now, 0
        view, step = self._view, self.cfg.trainer.samples_per_step
        assert view is not None
        coming, rec = view.coming + self._since + extra, view.trainer
        if poll:
            newest = (
                rec.published_version if view.live and rec is not None and rec.publishing is None else None
            )
            if not self.weights.catch_up(coming // step, view.planned_step, rec, newest):
                return "stale"
        elif self.weights.too_stale(coming // step, view.planned_step, rec):
            return "stale"
        # Below a step's worth nothing pauses: whatever the bound, the trainer must be able to fill a step.
        if coming > self.cfg.rollout.max_backlog_samples and coming >= step:
            return "backlog"
        return None

    # ------------------------------------------------------------------ start

    def _start(self, prompts: list[Prompt], scorer: Scorer) -> None:
        from transformers import AutoTokenizer

        cfg = self.cfg
        kind = resolve_kind(cfg.rollout.engine)
        self._set(state="starting", engine=kind, weights_version=None, **self.counters)
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        tokenizer = AutoTokenizer.from_pretrained(str(self.run.tokenizer_dir))
        self.stream = self._prompt_stream(prompts, tokenizer)
        task = make_task(cfg, tokenizer)
        reward_model = None
        if cfg.reward.reward_model:
            from rollout_worker.rewards import RewardModel

            reward_model = RewardModel(cfg.reward.reward_model)
        self.life.phase = "loading"
        self._set(state="loading")
        start = time.monotonic()
        # The engine's processes are the children it adds: not a tool's zygote started before it, nor the reward
        # processes started after it, whose deaths (a crashing or timed-out reward) are theirs to handle.
        before = child_pids()
        self.engine = self._engine()
        engine_pids = child_pids() - before
        self.source = make_source(
            self,
            self.engine,
            task=task,
            tokenizer=tokenizer,
            scorer=scorer,
            lengths=self._length_draw(),
            model_scorer=None if reward_model is None else reward_model.score,
        )
        self.life.install_signal_handlers()  # an engine library may have replaced them while starting
        self.life.watch_engine(engine_pids)
        log.info("%s: %s engine up in %.1fs on %s", self.worker_id, kind, time.monotonic() - start, _device())
        self.weights = WeightFollower(
            self.layout,
            weight_loader(self.engine, cfg.rollout.streaming),
            name=self.worker_id,
            poll_s=cfg.rollout.weights_poll_s,
            max_staleness=cfg.rollout.max_staleness,
            publish_every=cfg.trainer.publish_every,
            report=self._weights_report,
            on_error=self._error,
        )
        self.weights.poll(force=True)
        self._set(weights_version=self.weights.version, latest_version=self.weights.latest)
        self.life.phase = "running"

    def _engine(self) -> Any:
        seed, streaming = derive_seed(self.cfg.run.seed, "engine", self.slot), self.cfg.rollout.streaming
        spec = EngineSpec.of_run(self.run, seed)
        if streaming:  # the transformers streaming engine decodes as many rows as may be in flight
            spec = replace(spec, max_batch_size=max_in_flight(self.cfg))
        return build(spec, streaming=streaming)

    def _length_draw(self) -> LengthDraw | None:
        """``rollout.sampling.lengths = "loguniform"``: each sample's own length (benchmarks)."""
        s = self.cfg.rollout.sampling
        if s.lengths != "loguniform":
            return None
        rng = random.Random(derive_seed(self.cfg.run.seed, "lengths", self.slot, self.incarnation))
        return LengthDraw(s.min_response_length, s.max_response_length, rng)

    def _prompt_stream(self, prompts: list[Prompt], tokenizer: Any) -> PromptStream:
        """This slot's prompt stream, resumed where the previous incarnation left it when the source is the same."""
        cfg = self.cfg
        limit = min(cfg.data.max_prompt_length, self.cfg.context_length() - 1)
        resume = self.previous if self.previous.get("prompt_source") == self._source_key(prompts) else {}
        return PromptStream(
            prompts,
            make_encoder(tokenizer, cfg.data.chat_template, cfg.data),
            seed=cfg.run.seed,
            slot=self.slot,
            max_tokens=limit,
            epoch=int(resume.get("prompt_epoch", 0)),
            cursor=int(resume.get("prompt_cursor", 0)),
        )

    def _source_key(self, prompts: list[Prompt]) -> str:
        data = self.cfg.data
        source = self.cfg.env.verifiers if data.task == "env" else data.prompts_file
        return f"{data.task}:{source}:{len(prompts)}"

    # ------------------------------------------------------------------ what a source made

    def starting(self, samples: int) -> None:
        """The record before a batch of ``samples`` starts: its prompts are drawn, the cursor moved past them."""
        view = self._view
        self.report(
            state="running",
            in_flight=self.publisher.pending_samples + samples,
            paused_reason=None,
            backlog=view.backlog if view is not None else None,
        )

    def _take(self, out: Produced) -> None:
        """Queue what came back scored and count it: once, whichever source made it."""
        scored = out.scored
        if not (scored.groups or scored.errors) and out.batch_s is None:
            return
        self.publisher.add(scored.groups)
        c = self.counters
        if scored.errors and c["dropped_reward_groups"] == 0:
            log.warning(
                "%s: dropping groups whose reward fails; first error: %s", self.worker_id, scored.errors[0]
            )
            self.status.record["first_reward_error"] = scored.errors[0][:500]
        c["samples"] += scored.samples
        c["tokens"] += scored.tokens
        c["dropped_reward_groups"] += scored.dropped_reward_groups
        c["dropped_reward_samples"] += scored.dropped_reward_samples
        c["dropped_bad_logprob_groups"] += scored.dropped_bad_logprob_groups
        c["errors"] += len(scored.errors)
        for k in EPISODE_COUNTERS:
            if k in out.episode_stats:
                c[k] = c.get(k, 0) + int(out.episode_stats[k])
        if scored.errors:
            self.status.record["last_error"] = scored.errors[-1]
        if out.batch_s is not None:  # a batch's own figures; a streaming source reports them over time
            self._batch_done(out)

    def _batch_done(self, out: Produced) -> None:
        scored, tps, seconds = out.scored, out.tokens_per_s or 0.0, out.batch_s or 0.0
        reward = scored.reward_mean()
        self.report(tokens_per_s=round(tps, 1), batches=self.batches, reward_mean=reward)
        self.metrics(
            samples=scored.samples,
            tokens=scored.tokens,
            tokens_per_s=tps,
            reward_mean=reward,
            batch_s=seconds,
            **_per_episode(out.episode_stats, seconds),
        )
        log.info(
            "%s | v%d | batch %d | %d samples | reward %s | %.0f tok/s | backlog %d",
            self.worker_id,
            self.weights.version if self.weights is not None else 0,
            self.batches,
            scored.samples,
            "-" if reward is None else f"{reward:.3f}",
            tps,
            self._view.backlog if self._view is not None else 0,
        )

    # ------------------------------------------------------------------ publishing and backpressure

    def _publish(self, *, everything: bool = False) -> None:
        if self.publisher.publish(everything=everything):
            self.counters["shards"] = self.publisher.shards
            self._set(shards=self.publisher.shards, published_samples=self.publisher.published_samples)

    def set_in_flight(self, samples: int) -> None:
        if self.status.record.get("in_flight") != samples:
            self._set(in_flight=samples)

    def _pause(self, reason: str, **fields: Any) -> None:
        """Wait a little without generating; what is buffered is complete, so it is published first."""
        self._publish(everything=True)
        rec = self.status.record
        if rec.get("state") != "paused" or rec.get("paused_reason") != reason:
            log.info("%s: paused (%s)", self.worker_id, reason)
        fields = {
            "state": "paused",
            "paused_reason": reason,
            "in_flight": self.publisher.pending_samples,
            **fields,
        }
        if any(rec.get(k) != v for k, v in fields.items()):  # else the heartbeat keeps the record fresh
            self._set(**fields)
        end = time.monotonic() + min(self.cfg.rollout.weights_poll_s, PAUSE_S)
        while time.monotonic() < end and not self.life.stop_requested:
            time.sleep(0.05)

    # ------------------------------------------------------------------ status and metrics

    def report(self, **fields: Any) -> None:
        """The status record with the prompt cursor and every counter (the source's own too)."""
        assert self.source is not None
        self.counters.update(self.source.counters())
        self.counters["dropped_too_long"] = self.stream.skipped_too_long
        self._set(
            prompt_source=self._source_key(self.stream.prompts),
            prompt_epoch=self.stream.epoch,
            prompt_cursor=self.stream.cursor,
            **self.counters,
            **fields,
        )

    def _set(self, **fields: Any) -> None:
        with self.life.io_lock:
            self.status.update(**fields)

    def _final_status(self, state: str, error: str | None) -> None:
        """Called under the I/O lock by ``Lifecycle.exit_now``."""
        fields: dict[str, Any] = {"state": state, **self.counters}
        if error is not None:
            fields["last_error"] = error
        self.status.update(**fields)

    def _weights_report(self, **fields: Any) -> None:
        if fields.get("state") == "reloading" and self.life.phase != "running":
            fields.pop("state")  # the first load happens while the engine is still starting
        if fields:
            self._set(**fields)

    def _error(self, line: str) -> None:
        self.counters["errors"] += 1
        self._set(last_error=line, errors=self.counters["errors"])

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.cfg.run.heartbeat_interval_s)
            with contextlib.suppress(OSError):
                self._set()

    def metrics(self, **values: Any) -> None:
        assert self.weights is not None
        rec = {
            "time": time.time(),
            "worker_id": self.worker_id,
            "weights_version": self.weights.version,
            **values,
        }
        with self.life.io_lock:
            metrics.append(self.layout.metrics_file(f"rollout-{self.worker_id}"), rec)
        self.sink.log(rec, self.batches)


def _per_episode(stats: dict[str, float], batch_s: float) -> dict[str, Any]:
    """A multi-turn batch's metrics: turns and tool calls per episode, tool errors, time-outs and truncated episodes,
    and the tools' share of the batch's time (their seconds over the episodes side by side, against the batch's)."""
    n = stats.get("episodes", 0)
    if not n:
        return {}
    return {
        "episodes": int(n),
        "turns_per_episode": stats["model_turns"] / n,
        "tool_calls_per_episode": stats["tool_calls"] / n,
        "tool_errors": int(stats["tool_errors"]),
        "tool_timeouts": int(stats["tool_timeouts"]),
        "truncated_episodes": int(stats["truncated_episodes"]),
        "env_s": round(stats["env_s"], 3),
        "env_s_per_episode": stats["env_s"] / n,
        # tool seconds over batch seconds: above 1 when tools of many episodes ran side by side
        "env_s_per_batch_s": stats["env_s"] / batch_s if batch_s > 0 else None,
    }


def _previous_record(run: Run, worker_id: str) -> dict[str, Any]:
    """What the previous incarnation of this worker recorded (its prompt cursor); empty when unreadable."""
    try:
        rec = load_worker(run.layout, worker_id)
    except (RecordError, OSError):
        return {}
    return {} if rec is None else rec.to_json()


def _device() -> str:
    gpus, threads = os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS")
    if gpus:
        return f"CUDA_VISIBLE_DEVICES={gpus}"
    return f"cpu ({threads} threads)" if threads else "cpu"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rollout_worker.worker",
        description="One rollout worker (normally started by the node supervisor, `shardrl-rollout`).",
        epilog="Further arguments are per-process config overrides, e.g. --rollout.engine hf.",
    )
    p.add_argument("--run", type=Path, required=True, help="the run directory")
    p.add_argument(
        "--slot", type=int, required=True, help="worker slot (seed and prompt stream derive from it)"
    )
    p.add_argument("--worker-id", default=None, help="worker id (default w<slot>; no '.' or '/')")
    p.add_argument(
        "--supervisor",
        default=None,
        help="id of the supervisor that holds the slot's lease; the worker stops once it no longer does",
    )
    p.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process (the supervisor) is gone"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    wid = args.worker_id or worker_id_for(args.slot)
    life = Lifecycle(wid, threading.RLock())
    life.install_signal_handlers()  # from here on a signal ends the process cleanly, whatever it is doing
    try:
        run = open_run(args.run, parse_overrides(rest))
        prompts, scorer = preflight(run)
    except USER_ERRORS as e:
        print(f"shardrl-rollout worker {wid}: {e}", file=sys.stderr)
        return EXIT_USER
    setup_logging("rollout")
    worker = RolloutWorker(run, args.slot, wid, life, supervisor=args.supervisor)
    if args.parent_pid is not None:
        life.watch_parent(args.parent_pid)
    if args.supervisor is not None:
        life.watch_lease(LeaseWatch(run.layout, args.slot, args.supervisor, run.config.run.lease_timeout_s))
    return worker.serve(prompts, scorer)


if __name__ == "__main__":
    leave(main())
