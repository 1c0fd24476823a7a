"""One rollout worker: an engine on one device that turns prompts into published experience shards.

Started by the node supervisor as its own process (one per leased worker slot)::

    python -m rollout_worker.worker --run RUN --slot K [--worker-id wK] [--section.key value ...]

and runnable by hand the same way.  The loop, between batches: follow the trainer's weight versions
(``following``); refuse to start a batch while more than ``rollout.max_staleness`` versions behind (state ``paused``,
reason ``stale``) or while the run's unconsumed backlog is above ``rollout.max_backlog_samples`` (reason
``backlog``); both count the samples the other workers are generating (their ``in_flight``, as the trainer's record
last copied it: ``admission``), so a fleet stops where one worker would, instead of overshooting by a batch per
worker into samples the trainer drops as stale, and a check reads one file whatever the fleet's size; generate n samples per prompt; score whole groups (``scoring``); publish whole groups as shards
(``publishing``).

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
from buffer.config import ConfigError, ShardRLConfig, parse_overrides, resolve_dtype
from buffer.control import LeaseWatch
from buffer.heartbeats import load_worker, worker_status
from buffer.logs import setup_logging
from buffer.records import RecordError
from buffer.run import Run, open_run
from buffer.shards import ShardWriter, new_incarnation
from rollout_worker.admission import Admission
from rollout_worker.checks import require_answers
from rollout_worker.engines import resolve_kind
from rollout_worker.engines.base import EngineError, SamplingSpec, require_model_dir
from rollout_worker.envs import EPISODE_COUNTERS, ToolTask, check_tools, episode_stats
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
from rollout_worker.prompts import (
    EncodedPrompt,
    Prompt,
    PromptError,
    PromptStream,
    derive_seed,
    load_prompts,
    make_encoder,
)
from rollout_worker.publishing import GroupPublisher
from rollout_worker.rewards import RewardConfigError, Scorer, make_scorer
from rollout_worker.scoring import ScoredBatch, score_batch
from rollout_worker.streaming import GroupStream, InlineScorer, LengthDraw, StreamMeter

__all__ = ["EXIT_CRASH", "EXIT_LEASE", "EXIT_OK", "EXIT_USER", "USER_ERRORS", "preflight", "worker_id_for"]

USER_ERRORS = (ConfigError, PromptError, RewardConfigError, EngineError)
PAUSE_S = 0.5  # a paused worker looks again this often (or at every weights poll, when that is sooner)
# Another worker's in-flight samples count while its record is younger than this many heartbeats plus the clock
# skew between nodes (records carry the writer's wall clock).
IN_FLIGHT_BEATS = 5
CLOCK_SKEW_S = 10.0
# Streaming: the trainer's record is read at most this often (samples started since are added to it), the engine is
# asked for finished requests for at most STREAM_POLL_S at a time, and the status record written at most every
# STATUS_S, a metrics line every METRICS_S.
ADMISSION_S = 0.25
STREAM_POLL_S = 0.05
STATUS_S = 0.5
METRICS_S = 5.0
log = logging.getLogger("shardrl.rollout")


def worker_id_for(slot: int) -> str:
    return f"w{slot}"


def max_model_len(run: Run) -> int:
    return run.config.context_length()


def preflight(run: Run) -> tuple[list[Prompt], Scorer]:
    """Every check a user can fail before any engine starts: model, prompts, reward, tools.  One-line errors."""
    cfg = run.config
    resolve_kind(cfg.rollout.engine)
    require_model_dir(run.model_dir, "model directory (model.path)")
    if cfg.model.tokenizer:
        require_model_dir(run.tokenizer_dir, "tokenizer directory (model.tokenizer)")
    prompts = run_prompts(cfg)
    scorer = make_scorer(cfg.reward)
    check_tools(cfg)
    require_answers(cfg, prompts)
    if cfg.reward.reward_model and not (Path(cfg.reward.reward_model) / "config.json").is_file():
        raise RewardConfigError(
            f"{cfg.reward.reward_model}: reward.reward_model is not a HF model directory (no config.json)"
        )
    return prompts, scorer


def run_prompts(cfg: ShardRLConfig) -> list[Prompt]:
    """The run's prompts: the data source's, or with ``env.verifiers`` the environment's tasks (loaded here first,
    and kept for ``_start``: ``verifiers_env.configured_env``)."""
    if cfg.env.verifiers is None:
        return load_prompts(cfg.data)
    from rollout_worker.envs.verifiers_env import env_prompts

    return env_prompts(cfg)


def vllm_options(run: Run) -> dict[str, Any]:
    vllm = run.config.rollout.vllm  # None when this process runs the hf engine
    return vllm.model_dump(exclude={"max_model_len"}) if vllm is not None else {}


def engine_dtype(run: Run) -> str:
    import torch

    return resolve_dtype(run.config.model.dtype, cuda=torch.cuda.is_available())


class RolloutWorker:
    """The loop of one worker process; ``serve()`` returns the exit code."""

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
        self.lengths: LengthDraw | None = None
        self.groups: GroupStream | None = None  # rollout.streaming: the groups in flight
        self.tool_task: ToolTask | None = None
        # envs.agent.AgentTask when env.agent is set (a VerifiersTask with env.verifiers)
        self.agent_task: Any = None
        # a thread-safe complete(prompt_ids, sampling) for episodes: a StreamCompleter (streaming) or a Batcher
        self.complete: Any = None
        self.weights: WeightFollower | None = None
        self.batches = 0
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

    # ------------------------------------------------------------------ the loop, as a table of contents

    def serve(self, prompts: list[Prompt], scorer: Scorer) -> int:
        try:
            self._start(prompts, scorer)
            if self.groups is not None:
                self._stream()
            else:
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
            with contextlib.suppress(Exception):
                self.sink.close()
            if self.groups is not None:
                with contextlib.suppress(Exception):
                    self.groups.scorer.close()
            for closing in (self.agent_task, self.complete):
                if hasattr(closing, "close"):
                    with contextlib.suppress(Exception):
                        closing.close()
            if self.engine is not None:
                with contextlib.suppress(Exception):
                    self.engine.close()

    def _loop(self) -> None:
        assert self.weights is not None
        step = self.cfg.trainer.samples_per_step
        while not self.life.stop_requested:
            # What the trainer will have without a batch of ours: the backlog, ours waiting, the others' batches.
            view = self.admission.view(self.publisher.published_samples, self.publisher.pending_samples)
            coming = view.coming
            rec = view.trainer
            newest = (
                rec.published_version if view.live and rec is not None and rec.publishing is None else None
            )
            if not self.weights.catch_up(coming // step, view.planned_step, rec, newest):
                self._pause("stale", latest_version=self.weights.latest)
                continue
            # Below a step's worth nothing pauses: whatever the bound, the trainer must be able to fill a step.
            if coming > self.cfg.rollout.max_backlog_samples and coming >= step:
                self._pause("backlog", backlog=view.backlog)
                continue
            self._batch(view.backlog)
            self._publish()
            self._set_in_flight(self.publisher.pending_samples)

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

    # ------------------------------------------------------------------ start

    def _start(self, prompts: list[Prompt], scorer: Scorer) -> None:
        from transformers import AutoTokenizer

        from rollout_worker.engines import make_engine, make_streaming_engine

        cfg = self.cfg
        self.scorer = scorer
        kind = resolve_kind(cfg.rollout.engine)
        self._set(state="starting", engine=kind, weights_version=None, **self.counters)
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        tokenizer = AutoTokenizer.from_pretrained(str(self.run.tokenizer_dir))
        self.stream = self._prompt_stream(prompts, tokenizer)
        self.tool_task = ToolTask(cfg, tokenizer) if cfg.env.tools else None
        if cfg.env.verifiers:
            from rollout_worker.envs.verifiers_env import VerifiersTask, configured_env

            env, tasks = configured_env(cfg)  # what preflight loaded: the prompts are these tasks
            self.agent_task = VerifiersTask(cfg, tokenizer, env, tasks=tasks)
        elif cfg.env.agent:
            from rollout_worker.envs.agent import AgentTask

            self.agent_task = AgentTask(cfg, tokenizer)
        self.reward_model = None
        if cfg.reward.reward_model:
            from rollout_worker.rewards import RewardModel

            self.reward_model = RewardModel(cfg.reward.reward_model)
        self.lengths = self._length_draw()
        self.life.phase = "loading"
        self._set(state="loading")
        start = time.monotonic()
        episodes = self.tool_task is not None or self.agent_task is not None
        # The engine's processes are the children it adds: not a tool's zygote started before it, nor the reward
        # processes started after it, whose deaths (a crashing or timed-out reward) are theirs to handle.
        before = child_pids()
        if cfg.rollout.streaming:
            self.engine = make_streaming_engine(
                kind,
                self.run.model_dir,
                dtype=engine_dtype(self.run),
                seed=derive_seed(cfg.run.seed, "engine", self.slot),
                max_model_len=max_model_len(self.run),
                vllm_options=vllm_options(self.run),
                lora_rank=cfg.model.lora.rank,
                max_batch_size=self._max_in_flight(),
            )
            engine_pids = child_pids() - before
            if episodes:  # each episode at its own pace, its turns requests of their own
                from rollout_worker.engines.completer import StreamCompleter

                self.complete = StreamCompleter(self.engine)
            else:
                self.groups = self._group_stream()
        else:
            self.engine = make_engine(
                kind,
                self.run.model_dir,
                dtype=engine_dtype(self.run),
                seed=derive_seed(cfg.run.seed, "engine", self.slot),
                max_model_len=max_model_len(self.run),
                vllm_options=vllm_options(self.run),
                lora_rank=cfg.model.lora.rank,
            )
            engine_pids = child_pids() - before
        if self.agent_task is not None and self.complete is None:  # its calls, from many threads, batched
            from rollout_worker.envs.endpoint import Batcher

            self.complete = Batcher(
                self.engine.generate, lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))
            )
        self.life.install_signal_handlers()  # an engine library may have replaced them while starting
        self.life.watch_engine(engine_pids)
        log.info("%s: %s engine up in %.1fs on %s", self.worker_id, kind, time.monotonic() - start, _device())
        self.weights = WeightFollower(
            self.layout,
            self.engine,
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
        limit = min(cfg.data.max_prompt_length, max_model_len(self.run) - 1)
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

    # ------------------------------------------------------------------ one batch

    def _batch(self, backlog: int) -> None:
        assert self.weights is not None
        prompts = self.stream.next_batch(self.cfg.rollout.prompts_per_batch)
        version = self.weights.version
        # The cursor moves before generating: a batch that kills the engine is skipped after a restart.
        self._set(
            state="running",
            in_flight=self.publisher.pending_samples + len(prompts) * self.cfg.rollout.sampling.n,
            paused_reason=None,
            backlog=backlog,
            prompt_source=self._source_key(self.stream.prompts),
            prompt_epoch=self.stream.epoch,
            prompt_cursor=self.stream.cursor,
            dropped_too_long=self.stream.skipped_too_long,
        )
        start = time.monotonic()
        if (
            self.tool_task is not None or self.agent_task is not None
        ):  # multi-turn: episodes generate and score
            scored, generated = self._episodes(prompts, version)
            seconds = max(time.monotonic() - start, 1e-9)
        else:
            spec = self._sampling()
            if self.lengths is not None:
                each = [self.lengths() for _ in range(len(prompts) * spec.n)]
                spec = replace(spec, max_tokens_each=each, ignore_eos=True)
            outputs = self.engine.generate([p.ids for p in prompts], spec)
            seconds = max(time.monotonic() - start, 1e-9)
            scored = self._score(prompts, outputs, version)
            generated = sum(len(c.response_ids) for out in outputs for c in out)
        self.publisher.add(scored.groups)
        self.batches += 1
        tps = generated / seconds
        episodes: dict[str, float] = {}
        if self.tool_task is not None or self.agent_task is not None:
            episodes = episode_stats(scored.groups)
            for k in EPISODE_COUNTERS:
                self.counters[k] = self.counters.get(k, 0) + int(episodes[k])
        self._count(scored, tps)
        self._metrics(
            samples=scored.samples,
            tokens=scored.tokens,
            tokens_per_s=tps,
            reward_mean=scored.reward_mean(),
            batch_s=seconds,
            **_per_episode(episodes, seconds),
        )
        reward = scored.reward_mean()
        log.info(
            "%s | v%d | batch %d | %d samples | reward %s | %.0f tok/s | backlog %d",
            self.worker_id,
            version,
            self.batches,
            scored.samples,
            "-" if reward is None else f"{reward:.3f}",
            tps,
            backlog,
        )

    def _sampling(self) -> SamplingSpec:
        s = self.cfg.rollout.sampling
        return SamplingSpec(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_response_length,
            n=s.n,
            stop=list(s.stop),
            seed=derive_seed(self.cfg.run.seed, "batch", self.slot, self.incarnation, self.batches),
        )

    def _score(self, prompts: list[EncodedPrompt], outputs: list[Any], version: int) -> ScoredBatch:
        return score_batch(
            prompts,
            outputs,
            self.scorer.score_batch(prompts, outputs),
            group_prefix=f"{self.worker_id}.{self.incarnation}.{self.batches}",
            policy_version=version,
            epoch=self.stream.epoch,
            model_scorer=None if self.reward_model is None else self.reward_model.score,
            model_weight=self.cfg.reward.reward_model_weight,
        )

    def _episodes(self, prompts: list[EncodedPrompt], version: int) -> tuple[ScoredBatch, int]:
        prefix = f"{self.worker_id}.{self.incarnation}.{self.batches}"
        # a batch engine's weights change between batches only; a streaming engine's may change under a turn, and
        # its completions then say which version drew each token
        current = (lambda: self.engine.version) if self.cfg.rollout.streaming else (lambda: version)
        if self.agent_task is not None:
            return self.agent_task.run_batch(  # type: ignore[no-any-return]
                self.complete,
                prompts,
                self._sampling(),
                current,
                group_prefix=prefix,
                epoch=self.stream.epoch,
            )
        assert self.tool_task is not None
        streaming = self.cfg.rollout.streaming
        return self.tool_task.run_batch(
            None if streaming else self.engine.generate,
            prompts,
            self._sampling(),
            current,
            group_prefix=prefix,
            epoch=self.stream.epoch,
            complete=self.complete if streaming else None,
        )

    def _count(self, scored: ScoredBatch, tokens_per_s: float) -> None:
        c = self.counters
        first: dict[str, str] = {}
        if scored.errors and c["dropped_reward_groups"] == 0:
            log.warning(
                "%s: dropping groups whose reward fails; first error: %s", self.worker_id, scored.errors[0]
            )
            first = {"first_reward_error": scored.errors[0][:500]}
        c["samples"] += scored.samples
        c["tokens"] += scored.tokens
        c["dropped_too_long"] = self.stream.skipped_too_long
        c["dropped_reward_groups"] += scored.dropped_reward_groups
        c["dropped_reward_samples"] += scored.dropped_reward_samples
        c["dropped_bad_logprob_groups"] += scored.dropped_bad_logprob_groups
        c["errors"] += len(scored.errors)
        last = {"last_error": scored.errors[-1]} if scored.errors else {}
        self._set(
            tokens_per_s=round(tokens_per_s, 1),
            batches=self.batches,
            reward_mean=scored.reward_mean(),
            **first,
            **last,
            **c,
        )

    # ------------------------------------------------------------------ streaming (rollout.streaming)

    def _max_in_flight(self) -> int:
        r = self.cfg.rollout
        return max(r.max_in_flight or r.prompts_per_batch * r.sampling.n, r.sampling.n)

    def _group_stream(self) -> GroupStream:
        cfg, r = self.cfg, self.cfg.rollout
        scorer: Any = InlineScorer(self.scorer)
        if r.score_processes > 0:
            from rollout_worker.scorepool import ScorePool

            scorer = ScorePool(cfg.reward, processes=r.score_processes, timeout_s=cfg.reward.timeout_s)
        return GroupStream(
            self.engine,
            scorer,
            n=r.sampling.n,
            group_prefix=f"{self.worker_id}.{self.incarnation}.s",
            lengths=self.lengths,
            model_scorer=None if self.reward_model is None else self.reward_model.score,
            model_weight=cfg.reward.reward_model_weight,
        )

    def _stream(self) -> None:
        """Keep the engine full: start a group whenever a slot frees and the backlog and staleness bounds allow
        one more, take each group as soon as it is scored, let weights change under the requests in flight."""
        assert self.weights is not None and self.groups is not None
        g, r = self.groups, self.cfg.rollout
        meter = StreamMeter(self.engine)
        view, viewed_at, started_since = None, -math.inf, 0
        while not self.life.stop_requested:
            now = time.monotonic()
            if view is None or now - viewed_at >= ADMISSION_S:  # one small file, at most 4 times a second
                view = self.admission.view(
                    self.publisher.published_samples, self.publisher.pending_samples + g.samples
                )
                viewed_at, started_since = now, 0
            reason = self._admit(view, view.coming + started_since * r.sampling.n)
            if reason is None:
                started_since += self._start_groups(view, view.coming + started_since * r.sampling.n)
            # paused: nothing may start and nothing is generating (a bound holds the engine idle); while requests
            # run the worker is running, whether or not it may start more
            idle = reason is not None and g.generating == 0
            meter.tick(paused=idle)
            if idle and not g.groups:
                assert reason is not None
                self._pause(reason, **({"backlog": view.backlog} if reason == "backlog" else {}))
                view = None
                continue
            self._streamed(g.poll(STREAM_POLL_S, epoch=self.stream.epoch), meter)
            self._abort_doomed(view)
            self._publish()
            self._stream_status(meter, state="paused" if idle else "running", reason=reason if idle else None)
        self._drain_stream(meter)

    def _admit(self, view: Any, coming: int) -> str | None:
        """Why no group may start now (``stale`` / ``backlog``), or None."""
        assert self.weights is not None
        step = self.cfg.trainer.samples_per_step
        rec = view.trainer
        newest = rec.published_version if view.live and rec is not None and rec.publishing is None else None
        if not self.weights.catch_up(coming // step, view.planned_step, rec, newest):
            return "stale"
        if coming > self.cfg.rollout.max_backlog_samples and coming >= step:
            return "backlog"
        return None

    def _start_groups(self, view: Any, coming: int) -> int:
        """Start groups while there is room in the engine and the bounds hold for each one more."""
        assert self.weights is not None and self.groups is not None
        g, r = self.groups, self.cfg.rollout
        n, step, limit = r.sampling.n, self.cfg.trainer.samples_per_step, self._max_in_flight()
        started = 0
        while g.generating + n <= limit:
            if coming > r.max_backlog_samples and coming >= step:
                break
            if self.weights.too_stale(coming // step, view.planned_step, view.trainer):
                break
            prompt = self.stream.next_batch(1)[0]
            g.start(prompt, self._stream_sampling())
            coming += n
            started += 1
        return started

    def _stream_sampling(self) -> SamplingSpec:
        assert self.groups is not None
        seed = derive_seed(self.cfg.run.seed, "group", self.slot, self.incarnation, self.groups.started)
        return replace(self._sampling(), seed=seed)

    def _abort_doomed(self, view: Any) -> None:
        """Stop the groups the trainer is sure to drop: started before its version - ``trainer.max_staleness`` (a
        group's oldest token is no older than its start).  A long response can outlive the bound that admitted it;
        cut now, its slots go to groups the trainer will take.

        The trainer judges its next plan by the version it will hold then: at least LATEST, or the one it is
        publishing.  (It may be one more, once the step it computes is done; the worker cannot tell for sure from
        a record up to a second old, and stopping a group the trainer would keep would cost what it avoids.)"""
        assert self.weights is not None and self.groups is not None
        if self.cfg.algorithm.staleness_mode != "drop":
            return
        judged = self.weights.newest_known(view.trainer if view is not None and view.live else None)
        if dropped := self.groups.abort_older(judged - self.cfg.trainer.max_staleness):
            self.counters["aborted_stale_samples"] += dropped
            log.info(
                "%s: %d samples in flight would be too stale to train on, stopped", self.worker_id, dropped
            )

    def _streamed(self, scored: ScoredBatch, meter: StreamMeter) -> None:
        """Count and queue the groups that came back scored."""
        if not (scored.groups or scored.errors):
            return
        assert self.groups is not None
        self.publisher.add(scored.groups)
        meter.add(scored)
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
        c["reward_timeouts"] = self.groups.timed_out
        c["errors"] += len(scored.errors)
        if scored.errors:
            self.status.record["last_error"] = scored.errors[-1]

    def _stream_status(
        self, meter: StreamMeter, *, state: str, reason: str | None, force: bool = False
    ) -> None:
        """The status record (and a metrics line every METRICS_S), at most every STATUS_S: a record per group
        would be a write per few milliseconds."""
        assert self.groups is not None
        now = time.monotonic()
        if not force and now - meter.status_at < STATUS_S:
            return
        meter.status_at = now
        stats = self.engine.stats()
        self.batches = self.groups.started
        self.counters["dropped_too_long"] = self.stream.skipped_too_long
        self._set(
            state=state,
            paused_reason=reason,
            in_flight=self.publisher.pending_samples + self.groups.samples,
            requests_in_flight=stats.in_flight,
            engine_busy=meter.busy_fraction(),
            reloads_in_flight=stats.updates,
            batches=self.batches,
            prompt_source=self._source_key(self.stream.prompts),
            prompt_epoch=self.stream.epoch,
            prompt_cursor=self.stream.cursor,
            reward_mean=meter.reward_mean(),
            tokens_per_s=round(meter.tokens_per_s(), 1),
            **self.counters,
        )
        if now - meter.metrics_at >= METRICS_S:
            self._metrics(**meter.interval(), aborted_stale_samples=self.counters["aborted_stale_samples"])

    def _drain_stream(self, meter: StreamMeter) -> None:
        """Stopping: no new group; the ones in flight finish and are scored until the drain's time is half gone,
        then the rest are dropped (never published in part)."""
        assert self.groups is not None
        g = self.groups
        deadline = time.monotonic() + self.cfg.rollout.drain_deadline_s / 2
        while g.groups and time.monotonic() < deadline and self.life.fenced is None:
            self._streamed(g.poll(STREAM_POLL_S, epoch=self.stream.epoch), meter)
        dropped = g.abort_all()
        if dropped:
            log.info(
                "%s: %d samples still generating at the drain's deadline, dropped", self.worker_id, dropped
            )
        self._stream_status(meter, state="running", reason=None, force=True)

    # ------------------------------------------------------------------ publishing and backpressure

    def _publish(self, *, everything: bool = False) -> None:
        if self.publisher.publish(everything=everything):
            self.counters["shards"] = self.publisher.shards
            self._set(shards=self.publisher.shards, published_samples=self.publisher.published_samples)

    def _set_in_flight(self, samples: int) -> None:
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

    def _metrics(self, **values: Any) -> None:
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
