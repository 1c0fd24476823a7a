"""Multi-turn episodes a batch of groups at a time: tool use (``env.tools``), agent programs (``env.agent``) and
verifiers environments (``env.verifiers``).

The task runs ``n`` episodes of each prompt side by side; their turns go to the engine through ``complete``, a
thread-safe ``complete(prompt_ids, sampling)``: a ``Batcher`` that gathers concurrent turns into batch calls, or
with ``rollout.streaming`` a ``StreamCompleter`` that submits each turn as its own request (a weight update may then
land under a turn, and its completion says which version drew each token: the source follows the trainer's
versions while its episodes run).  The built-in tool task on a batch engine calls ``generate`` itself instead, a
turn of every live episode per call.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from buffer.config import ConfigError, ShardRLConfig
from rollout_worker.envs import ToolTask
from rollout_worker.prompts import EncodedPrompt
from rollout_worker.scoring import ScoredBatch
from rollout_worker.sources import Admit, Host, Produced
from rollout_worker.sources.batch import BatchSource

FOLLOW_S = 0.05  # while a streaming batch's episodes run, LATEST is looked at this often (rate-limited again)
# Batches in a row whose every episode failed (an agent that raises, a verifiers harness that cannot start) after
# which the worker stops with the error in its status: such an environment produces no sample however long it runs,
# and the trainer would wait for one forever.  A batch with one episode that ran resets the count.
FAILING_BATCHES = 3


class EpisodesFailing(ConfigError):
    """Every episode of ``FAILING_BATCHES`` batches in a row failed: a user's environment, not a crash to retry."""


def failure_of(scored: ScoredBatch) -> str | None:
    """The last error when every episode of the batch failed (its group dropped for want of a model call, or its
    rows' episode record naming an error); None when one ran, or the batch held nothing at all."""
    rows = [r for g in scored.groups for r in g]
    errors = [json.loads(r["episode"]).get("error") for r in rows if r.get("episode")]
    if (rows and not (errors and all(errors))) or not (rows or scored.errors):
        return None
    last = str(errors[-1]) if errors else scored.errors[-1]
    return " ".join(last.split())[:500]  # one line in the status record


def make_task(cfg: ShardRLConfig, tokenizer: Any) -> Any:
    """The run's episode task: a ``VerifiersTask`` (``env.verifiers``), an ``AgentTask`` (``env.agent``) or a
    ``ToolTask`` (``env.tools``); None for single-turn runs."""
    if cfg.env.verifiers:
        from rollout_worker.envs.verifiers_env import VerifiersTask, configured_env

        env, tasks = configured_env(cfg)  # what preflight loaded: the prompts are these tasks
        return VerifiersTask(cfg, tokenizer, env, tasks=tasks)
    if cfg.env.agent:
        from rollout_worker.envs.agent import AgentTask

        return AgentTask(cfg, tokenizer)
    return ToolTask(cfg, tokenizer) if cfg.env.tools else None


def make_complete(engine: Any, tokenizer: Any, streaming: bool) -> Any:
    """The thread-safe ``complete`` episodes call: each turn its own request on a streaming engine, concurrent
    turns batched into ``generate`` calls on a batch engine."""
    from rollout_worker.engines.completer import Batcher, StreamCompleter

    if streaming:
        return StreamCompleter(engine)
    return Batcher(engine.generate, lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))


class EpisodeSource(BatchSource):
    """``BatchSource``'s loop with episodes in place of single generations."""

    def __init__(self, host: Host, engine: Any, task: Any, complete: Any, *, streaming: bool):
        super().__init__(host, engine, scorer=None)  # type: ignore[arg-type]  # the task scores its episodes
        self.engine: Any = engine  # batch or streaming: a streaming engine's version tags each turn's tokens
        self.task, self.complete, self.streaming = task, complete, streaming
        self.last_stats: dict[str, float] = {}
        self.failing = 0  # batches in a row whose every episode failed

    def step(self, admit: Admit) -> Produced:
        from rollout_worker.envs import episode_stats

        out = super().step(admit)
        if out.paused is None:
            out.episode_stats = episode_stats(out.scored.groups)
            self._count_failures(out.scored)
        return out

    def _count_failures(self, scored: ScoredBatch) -> None:
        error = failure_of(scored)
        self.failing = 0 if error is None else self.failing + 1
        if self.failing >= FAILING_BATCHES:
            raise EpisodesFailing(
                f"env: every episode of the last {self.failing} batches failed, so this environment produces no "
                f"sample; the worker stops (a restart would fail the same way). The last error: {error}"
            )

    def make(self, prompts: list[EncodedPrompt], version: int) -> tuple[ScoredBatch, int]:
        if not self.streaming:  # a batch engine's weights change between batches only
            return self._run(prompts, lambda: version)
        return self._run_following(prompts)

    def _run_following(self, prompts: list[EncodedPrompt]) -> tuple[ScoredBatch, int]:
        """The batch's episodes in a thread of their own while this one follows the trainer's versions: a new one
        is loaded under the turns in flight (the streaming engine's ``update_weights``), between turns or inside
        one, and each completion says which version drew each token."""
        out: list[tuple[ScoredBatch, int]] = []
        failed: list[BaseException] = []

        def body() -> None:
            try:
                out.append(self._run(prompts, lambda: self.engine.version))
            except BaseException as e:  # raised in the worker's thread below
                failed.append(e)

        episodes = threading.Thread(target=body, daemon=True, name="episodes")
        episodes.start()
        weights = self.host.weights
        while episodes.is_alive():
            episodes.join(FOLLOW_S)
            if weights is not None and episodes.is_alive():
                weights.poll()  # rate-limited by rollout.weights_poll_s
        if failed:
            raise failed[0]
        return out[0]

    def _run(self, prompts: list[EncodedPrompt], current: Any) -> tuple[ScoredBatch, int]:
        epoch = self.host.stream.epoch
        if isinstance(self.task, ToolTask):
            return self.task.run_batch(
                None if self.streaming else self.engine.generate,
                prompts,
                self.sampling(),
                current,
                group_prefix=self.group_prefix(),
                epoch=epoch,
                complete=self.complete if self.streaming else None,
            )
        return self.task.run_batch(  # type: ignore[no-any-return]
            self.complete, prompts, self.sampling(), current, group_prefix=self.group_prefix(), epoch=epoch
        )

    def close(self) -> None:
        for closing in (self.task, self.complete):
            close = getattr(closing, "close", None)
            if close is not None:
                close()
