"""One rollout worker: an engine on one device that turns prompts into published experience shards.

Started by the node supervisor as its own process (one per leased worker slot)::

    python -m rollout_worker.worker --run RUN --slot K [--worker-id wK] [--section.key value ...]

and runnable by hand the same way.  The loop, between batches: poll ``weights/LATEST`` and hot-reload a newer
verified version; refuse to start a batch while more than ``rollout.max_staleness`` versions behind (reload first) or
while the run's unconsumed backlog is above ``rollout.max_backlog_samples`` (state ``paused``); generate n samples per
prompt; score whole groups; publish whole groups as shards every ``rollout.shard_samples`` samples or
``rollout.flush_interval_s`` seconds.

SIGTERM/SIGINT (or the supervisor dying) drains: the batch in flight is finished, every complete group is published,
state ``stopped``, exit 0.  A batch that cannot finish in time dies with the process when the supervisor kills it
at its deadline; shards are published atomically, so nothing partial ever appears.  During engine start a signal
exits at once.

Exit codes: 0 after a drain, 2 for a user-caused problem (one line on stderr: bad prompts file, missing model,
unknown reward), 1 for anything else, e.g. the engine crashed (it raised, or one of its processes died); the
supervisor then restarts the worker, which is how a worker survives its engine crashing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from buffer.config import ConfigError, parse_overrides
from buffer.fsio import read_json_or_none
from buffer.heartbeats import read_trainer, worker_status
from buffer.run import Run, open_run
from buffer.shards import ShardWriter, list_ready, new_incarnation, ready_sample_count
from buffer.weights import WeightsError, latest_version, published_versions, verify_version
from rollout_worker.engines import resolve_kind
from rollout_worker.engines.base import Completion, EngineError, SamplingSpec, require_model_dir
from rollout_worker.prompts import (
    EncodedPrompt,
    Prompt,
    PromptError,
    PromptStream,
    derive_seed,
    load_prompts,
    make_encoder,
)
from rollout_worker.rewards import (
    RewardConfigError,
    RewardError,
    RewardFn,
    needs_answers,
    resolve_reward,
    score_group,
)

EXIT_OK, EXIT_CRASH, EXIT_USER = 0, 1, 2
USER_ERRORS = (ConfigError, PromptError, RewardConfigError, EngineError)
log = logging.getLogger("shardrl.rollout")


class _StopNow(BaseException):
    """Raised by the signal handler while the engine is still starting: nothing to finish, leave at once."""


def worker_id_for(slot: int) -> str:
    return f"w{slot}"


def max_model_len(run: Run) -> int:
    cfg = run.config
    return cfg.rollout.vllm.max_model_len or (
        cfg.data.max_prompt_length + cfg.rollout.sampling.max_response_length
    )


def preflight(run: Run) -> tuple[list[Prompt], RewardFn]:
    """Every check a user can fail before any engine starts: model, prompts, reward.  One-line errors."""
    cfg = run.config
    resolve_kind(cfg.rollout.engine)
    require_model_dir(run.model_dir, "model directory (model.path)")
    if cfg.model.tokenizer:
        require_model_dir(run.tokenizer_dir, "tokenizer directory (model.tokenizer)")
    prompts = load_prompts(cfg.data)
    reward_fn = resolve_reward(cfg.reward.function)
    if needs_answers(cfg.reward.function) and all(p.answer is None for p in prompts):
        raise PromptError(
            f"{cfg.data.prompts_file}: no prompt has an answer field {cfg.data.answer_field!r} "
            f"(data.answer_field), which reward.function = {cfg.reward.function!r} needs"
        )
    if cfg.reward.reward_model and not (Path(cfg.reward.reward_model) / "config.json").is_file():
        raise RewardConfigError(
            f"{cfg.reward.reward_model}: reward.reward_model is not a HF model directory (no config.json)"
        )
    return prompts, reward_fn


def vllm_options(run: Run) -> dict[str, Any]:
    return run.config.rollout.vllm.model_dump(exclude={"max_model_len"})


class RolloutWorker:
    """The loop of one worker process; ``serve()`` returns the exit code."""

    def __init__(self, run: Run, slot: int, worker_id: str, *, supervisor: str | None = None):
        self.run = run
        self.cfg = run.config
        self.layout = run.layout
        self.slot = slot
        self.worker_id = worker_id
        self.incarnation = new_incarnation()
        self.writer = ShardWriter(self.layout, run.run_id, worker_id, self.incarnation)
        self.previous = read_json_or_none(self.layout.worker_status(worker_id)) or {}
        self.status = worker_status(
            self.layout, worker_id, slot=slot, supervisor=supervisor, incarnation=self.incarnation
        )
        self._lock = threading.Lock()
        self.phase = "starting"
        self.stop_requested = False
        self.engine: Any = None
        self.version = 0
        self.latest = 0
        self.bad_versions: dict[int, str] = {}
        self.groups: list[list[dict[str, Any]]] = []  # complete, scored groups not yet published
        self.pending_since: float | None = None
        self.last_weights_poll = -math.inf
        self.batches = 0
        self.counters = {
            "samples": 0,
            "tokens": 0,
            "shards": 0,
            "dropped_too_long": 0,
            "dropped_reward_groups": 0,
            "dropped_reward_samples": 0,
            "dropped_bad_logprob_groups": 0,
            "errors": 0,
        }

    # ------------------------------------------------------------------ status and signals

    def _set(self, **fields: Any) -> None:
        with self._lock:
            self.status.update(**fields)

    def _state(self, state: str, **fields: Any) -> None:
        self.phase = state if state in ("starting", "loading") else self.phase
        self._set(state=state, **fields)

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.cfg.run.heartbeat_interval_s)
            with contextlib.suppress(OSError):
                self._set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum: int, frame: object) -> None:
        self.stop_requested = True
        if self.phase in ("starting", "loading"):
            raise _StopNow()

    # ------------------------------------------------------------------ start

    def _start(self, prompts: list[Prompt], reward_fn: RewardFn) -> None:
        from transformers import AutoTokenizer

        from rollout_worker.engines import make_engine

        cfg = self.cfg
        self.reward_fn = reward_fn
        kind = resolve_kind(cfg.rollout.engine)
        self._state("starting", engine=kind, weights_version=None, **self.counters)
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        tokenizer = AutoTokenizer.from_pretrained(str(self.run.tokenizer_dir))
        limit = min(cfg.data.max_prompt_length, max_model_len(self.run) - 1)
        resume = self.previous if self.previous.get("prompt_source") == self._source_key(prompts) else {}
        self.stream = PromptStream(
            prompts,
            make_encoder(tokenizer, cfg.data.chat_template),
            seed=cfg.run.seed,
            slot=self.slot,
            max_tokens=limit,
            epoch=int(resume.get("prompt_epoch", 0)),
            cursor=int(resume.get("prompt_cursor", 0)),
        )
        self.reward_model = None
        if cfg.reward.reward_model:
            from rollout_worker.rewards import RewardModel

            self.reward_model = RewardModel(cfg.reward.reward_model)
        self._state("loading")
        start = time.monotonic()
        self.engine = make_engine(
            kind,
            self.run.model_dir,
            dtype=cfg.model.dtype,
            seed=derive_seed(cfg.run.seed, "engine", self.slot),
            max_model_len=max_model_len(self.run),
            vllm_options=vllm_options(self.run),
            lora_rank=cfg.model.lora.rank,
        )
        self.install_signal_handlers()  # an engine library may have replaced them while starting
        threading.Thread(target=self._watch_engine, args=(_child_pids(),), daemon=True, name="engine").start()
        log.info(
            "%s: %s engine up in %.1fs on %s", self.worker_id, kind, time.monotonic() - start, self._device()
        )
        self._poll_weights(force=True)
        self._set(weights_version=self.version, latest_version=self.latest)
        self.phase = "running"

    def _source_key(self, prompts: list[Prompt]) -> str:
        return f"{self.cfg.data.task}:{self.cfg.data.prompts_file}:{len(prompts)}"

    def _device(self) -> str:
        gpus, threads = os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS")
        if gpus:
            return f"CUDA_VISIBLE_DEVICES={gpus}"
        return f"cpu ({threads} threads)" if threads else "cpu"

    def _watch_engine(self, pids: set[int]) -> None:
        """Exit non-zero when a process of the engine dies under us.

        An engine that runs in child processes (vLLM's engine core) can die while ``generate`` waits for it, and a
        waiting call does not always notice.  The main thread gets a few seconds to report the failure itself.
        """
        while pids and self.phase != "closing":
            time.sleep(1.0)
            dead = [p for p in pids if not _is_child(p)]
            if not dead:
                continue
            time.sleep(5.0)
            if self.phase == "closing":
                return
            error = f"EngineError: engine process {dead[0]} died"
            log.error("%s: %s; exiting", self.worker_id, error)
            with contextlib.suppress(Exception):
                self._state("stopped" if self.stop_requested else "failed", last_error=error, **self.counters)
            os._exit(EXIT_OK if self.stop_requested else EXIT_CRASH)

    # ------------------------------------------------------------------ weights

    def _poll_weights(self, *, force: bool = False) -> None:
        """Load the newest verified version newer than ours (rate-limited to ``weights_poll_s``)."""
        now = time.monotonic()
        if not force and now - self.last_weights_poll < self.cfg.rollout.weights_poll_s:
            return
        self.last_weights_poll = now
        self.latest = latest_version(self.layout)
        if self.latest <= self.version:
            return
        if self._load(self.latest):
            return
        # LATEST is unusable (damaged, or being deleted): an older version newer than ours still helps staleness
        for v in sorted(
            (v for v in published_versions(self.layout) if self.version < v < self.latest), reverse=True
        ):
            if self._load(v):
                return

    def _load(self, version: int) -> bool:
        try:
            wv = verify_version(self.layout, version)
            self._state("reloading" if self.phase == "running" else self.phase)
            start = time.monotonic()
            self.engine.load_weights(wv.path)
        except (WeightsError, EngineError) as e:
            if version not in self.bad_versions:
                log.warning(
                    "%s: weights v%d skipped (%s); keeping v%d, will retry",
                    self.worker_id,
                    version,
                    e,
                    self.version,
                )
                self.counters["errors"] += 1
                self._set(last_error=f"weights v{version} skipped: {e}", errors=self.counters["errors"])
            self.bad_versions[version] = str(e)
            return False
        seconds = time.monotonic() - start
        log.info("%s: loaded weights v%d in %.2fs (was v%d)", self.worker_id, version, seconds, self.version)
        self.version = version
        self.bad_versions.pop(version, None)
        self._set(weights_version=version, latest_version=self.latest, last_reload_s=round(seconds, 3))
        return True

    def _too_stale(self) -> bool:
        return self.latest - self.version > self.cfg.rollout.max_staleness

    # ------------------------------------------------------------------ backpressure

    def _backlog(self) -> int:
        ready = ready_sample_count(list_ready(self.layout))
        consumed = int((read_trainer(self.layout) or {}).get("consumed_samples", 0) or 0)
        return ready - consumed + sum(len(g) for g in self.groups)

    def _pause(self, reason: str, **fields: Any) -> None:
        """Wait a little without generating; what is buffered is complete, so it is published first."""
        self._publish(everything=True)
        if self.status.record.get("state") != "paused" or self.status.record.get("paused_reason") != reason:
            log.info("%s: paused (%s)", self.worker_id, reason)
        self._state("paused", paused_reason=reason, **fields)
        end = time.monotonic() + min(self.cfg.rollout.weights_poll_s, 0.5)
        while time.monotonic() < end and not self.stop_requested:
            time.sleep(0.05)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        max_backlog = self.cfg.rollout.max_backlog_samples
        while not self.stop_requested:
            self._poll_weights()
            if self._too_stale():
                self._poll_weights(force=True)
                if self._too_stale():
                    self._pause("stale", latest_version=self.latest)
                    continue
            backlog = self._backlog()
            if backlog > max_backlog:
                self._pause("backlog", backlog=backlog)
                continue
            self._batch(backlog)
            self._publish()

    def _batch(self, backlog: int) -> None:
        cfg, s = self.cfg, self.cfg.rollout.sampling
        prompts = self.stream.next_batch(cfg.rollout.prompts_per_batch)
        version = self.version
        # The cursor moves before generating: a batch that kills the engine is skipped after a restart.
        self._state(
            "running",
            paused_reason=None,
            backlog=backlog,
            prompt_source=self._source_key(self.stream.prompts),
            prompt_epoch=self.stream.epoch,
            prompt_cursor=self.stream.cursor,
            dropped_too_long=self.stream.skipped_too_long,
        )
        spec = SamplingSpec(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_response_length,
            n=s.n,
            stop=list(s.stop),
            seed=derive_seed(cfg.run.seed, "batch", self.slot, self.incarnation, self.batches),
        )
        start = time.monotonic()
        outputs = self.engine.generate([p.ids for p in prompts], spec)
        seconds = max(time.monotonic() - start, 1e-9)
        groups = self._score(prompts, outputs, version)
        if groups and not self.groups:
            self.pending_since = time.monotonic()
        self.groups.extend(groups)
        self.batches += 1
        samples = sum(len(g) for g in groups)
        tokens = sum(len(r["response_ids"]) for g in groups for r in g)
        rewards = [r["reward"] for g in groups for r in g]
        self.counters["samples"] += samples
        self.counters["tokens"] += tokens
        self.counters["dropped_too_long"] = self.stream.skipped_too_long
        tps = sum(len(c.response_ids) for out in outputs for c in out) / seconds
        reward_mean = sum(rewards) / len(rewards) if rewards else None
        self._set(tokens_per_s=round(tps, 1), batches=self.batches, reward_mean=reward_mean, **self.counters)
        self._metrics(
            samples=samples, tokens=tokens, tokens_per_s=tps, reward_mean=reward_mean, batch_s=seconds
        )
        log.info(
            "%s | v%d | batch %d | %d samples | reward %s | %.0f tok/s | backlog %d",
            self.worker_id,
            version,
            self.batches,
            samples,
            "-" if reward_mean is None else f"{reward_mean:.3f}",
            tps,
            backlog,
        )

    def _score(
        self, prompts: list[EncodedPrompt], outputs: list[list[Completion]], version: int
    ) -> list[list[dict[str, Any]]]:
        """Scored rows, one list per kept group; a group whose reward or logprobs fail is dropped whole."""
        kept: list[tuple[int, list[float]]] = []
        for i, (p, outs) in enumerate(zip(prompts, outputs, strict=True)):
            try:
                rewards = score_group(
                    self.reward_fn, p.prompt.text, [c.response_text for c in outs], p.prompt.answer
                )
            except RewardError as e:
                self._drop_reward(len(outs), str(e))
                continue
            if not all(math.isfinite(x) and x <= 1e-4 for c in outs for x in c.response_logprobs):
                self.counters["dropped_bad_logprob_groups"] += 1
                continue
            kept.append((i, rewards))
        model_scores = self._model_scores(prompts, outputs, kept)
        groups = []
        for i, rewards in kept:
            p, outs = prompts[i], outputs[i]
            scores = model_scores.get(i)
            if scores is not None and not all(math.isfinite(x) for x in scores):
                self._drop_reward(len(outs), "reward model returned a non-finite score")
                continue
            gid = f"{self.worker_id}.{self.incarnation}.{self.batches}.{i}"
            groups.append(
                [
                    self._row(gid, p, c, r, version, None if scores is None else scores[j])
                    for j, (c, r) in enumerate(zip(outs, rewards, strict=True))
                ]
            )
        return groups

    def _model_scores(
        self,
        prompts: list[EncodedPrompt],
        outputs: list[list[Completion]],
        kept: list[tuple[int, list[float]]],
    ) -> dict[int, list[float]]:
        if self.reward_model is None or not kept:
            return {}
        texts = [(prompts[i].prompt.text, c.response_text) for i, _ in kept for c in outputs[i]]
        flat = self.reward_model.score([t[0] for t in texts], [t[1] for t in texts])
        out, k = {}, 0
        for i, _ in kept:
            out[i] = flat[k : k + len(outputs[i])]
            k += len(outputs[i])
        return out

    def _drop_reward(self, samples: int, error: str) -> None:
        if self.counters["dropped_reward_groups"] == 0:
            log.warning("%s: dropping groups whose reward fails; first error: %s", self.worker_id, error)
        self.counters["dropped_reward_groups"] += 1
        self.counters["dropped_reward_samples"] += samples
        self.counters["errors"] += 1
        self._set(last_error=error)

    def _row(
        self,
        gid: str,
        p: EncodedPrompt,
        c: Completion,
        reward: float,
        version: int,
        model_score: float | None,
    ) -> dict[str, Any]:
        extra: dict[str, Any] = {"prompt_index": p.prompt.index, "epoch": self.stream.epoch}
        if model_score is not None:
            extra |= {"reward_function": reward, "reward_model": model_score}
            reward = reward + self.cfg.reward.reward_model_weight * model_score
        return {
            "group_id": gid,
            "prompt_ids": list(p.ids),
            "response_ids": list(c.response_ids),
            "response_logprobs": [min(x, 0.0) for x in c.response_logprobs],
            "reward": reward,
            "policy_version": version,
            "finish_reason": c.finish_reason,
            "prompt_text": p.prompt.text,
            "response_text": c.response_text,
            "answer": p.prompt.answer,
            "extra": json.dumps(extra),
        }

    def _publish(self, *, everything: bool = False) -> None:
        """Publish whole groups: a shard per ``shard_samples`` samples, or all of them once the interval is up."""
        r = self.cfg.rollout
        due = everything or (
            self.pending_since is not None and time.monotonic() - self.pending_since >= r.flush_interval_s
        )
        published = False
        while self.groups and (due or sum(len(g) for g in self.groups) >= r.shard_samples):
            taken = 0
            while self.groups and (taken == 0 or taken + len(self.groups[0]) <= r.shard_samples):
                group = self.groups.pop(0)
                for row in group:
                    self.writer.add(row)
                taken += len(group)
            self.writer.flush()
            self.counters["shards"] += 1
            published = True
        if published:
            self.pending_since = time.monotonic() if self.groups else None
            self._set(shards=self.counters["shards"])

    def _metrics(self, **values: Any) -> None:
        rec = {"time": time.time(), "worker_id": self.worker_id, "weights_version": self.version, **values}
        path = self.layout.metrics_file(f"rollout-{self.worker_id}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ run

    def serve(self, prompts: list[Prompt], reward_fn: RewardFn) -> int:
        try:
            self._start(prompts, reward_fn)
            self._loop()
            self._publish(everything=True)
            self._state("stopped", **self.counters)
            log.info("%s: stopped after %d samples", self.worker_id, self.counters["samples"])
            return EXIT_OK
        except _StopNow:
            self._state("stopped", **self.counters)
            return EXIT_OK
        except USER_ERRORS as e:
            self.writer.discard()
            self._state("failed", last_error=str(e))
            print(f"shardrl-rollout worker {self.worker_id}: {e}", file=sys.stderr)
            return EXIT_USER
        except Exception as e:
            self.writer.discard()
            line = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            if self.stop_requested:  # the engine went down with us (e.g. Slurm signalled the whole step)
                self._publish(everything=True)
                self._state("stopped", last_error=line, **self.counters)
                return EXIT_OK
            traceback.print_exc()
            self._state("failed", last_error=line, **self.counters)
            return EXIT_CRASH
        finally:
            self.phase = "closing"
            if self.engine is not None:
                with contextlib.suppress(Exception):
                    self.engine.close()


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...); None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _child_pids() -> set[int]:
    """This process's children (Linux /proc; an empty set elsewhere)."""
    me, out = os.getpid(), set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit() and (st := _stat(int(name))) is not None and st[1] == str(me):
                out.add(int(name))
    return out


def _is_child(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X") and st[1] == str(os.getpid())


def _watch_parent(parent_pid: int) -> None:
    """A worker outlives its supervisor only until it notices; then it drains as on SIGTERM.

    PR_SET_PDEATHSIG makes the kernel send SIGTERM the moment the supervisor dies (Linux); polling the parent pid
    covers other systems and a supervisor that died before the call.
    """
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    threading.Thread(target=_poll_parent, args=(parent_pid,), daemon=True, name="parent").start()


def _poll_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


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
    p.add_argument("--supervisor", default=None, help="id of the supervisor that holds the slot's lease")
    p.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process (the supervisor) is gone"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    wid = args.worker_id or worker_id_for(args.slot)
    try:
        run = open_run(args.run, parse_overrides(rest))
        prompts, reward_fn = preflight(run)
    except USER_ERRORS as e:
        print(f"shardrl-rollout worker {wid}: {e}", file=sys.stderr)
        return EXIT_USER
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    worker = RolloutWorker(run, args.slot, wid, supervisor=args.supervisor)
    worker.install_signal_handlers()
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
    return worker.serve(prompts, reward_fn)


if __name__ == "__main__":
    sys.exit(main())
