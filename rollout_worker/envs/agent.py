"""The agent environment: an unmodified OpenAI-SDK agent run against the worker's chat endpoint, one base URL per
episode.

``env.agent = "package.module:function"`` names the agent, called once per episode, in a thread of its own, as
``fn(base_url, row) -> str | None``.  ``base_url`` is the episode's ``http://127.0.0.1:PORT/episodes/<id>/v1`` on
the task's ``endpoint.ChatEndpoint`` (``openai.OpenAI(base_url=base_url, api_key="x")``); ``row`` is the data row:
``messages`` (the conversation to start from), ``prompt`` (its text), ``answer``, ``extra`` (the row's other fields)
and ``index``.  The agent runs its own tools; the endpoint only generates.  It returns the final answer, or None for
the content of the last reply it was sent.

Scoring.  The run's reward function (``reward.function``) judges the final answer; an episode cut by a limit (a call
refused past ``env.max_turns`` or the context, or a last reply cut at its budget) gets ``reward.truncated_reward``
when that is set.  An agent that raises, returns something other than text or None, or runs past
``env.agent_timeout_s`` gets a reward of 0 with the error in its ``episode`` record, and never stops the worker.  A
thread cannot be killed: a timed-out agent's episode is closed, so its next call gets 404 and ends it, and its
daemon thread is left to finish.

Rows.  Each episode's calls become one or more samples (``calls.split_calls``), every one in the group of its data
row with the episode's reward (``calls`` says how they share an advantage).  A group is dropped whole when a
logprob is unusable or none of its episodes made a model call; an episode without a call adds no row.  Limits:
``env.max_turns`` calls per episode, ``env.max_turn_tokens`` per call, ``rollout.sampling.max_response_length`` per
sample, the engine's context.
"""

from __future__ import annotations

import importlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from buffer.config import ConfigError, ShardRLConfig

from ..engines.base import SamplingSpec
from ..prompts import EncodedPrompt, Prompt
from ..rewards import Sample as RewardSample
from ..rewards import resolve_reward
from ..scoring import ScoredBatch
from .calls import Split, logprobs_ok, split_calls, split_rows
from .endpoint import ChatEndpoint, Complete, EpisodeLog, normalise_message
from .episode import ChatRenderer, Limits

AgentFn = Callable[[str, dict[str, Any]], str | None]


class AgentConfigError(ConfigError):
    """The agent ``env.agent`` names cannot be used; the message is one line."""


def resolve_agent(target: str) -> AgentFn:
    """The function ``env.agent`` names, or a one-line AgentConfigError."""
    module_name, _, attr = target.partition(":")
    at = f"config: field env.agent: {target!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise AgentConfigError(f"{at}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AgentConfigError(f"{at}: {module_name!r} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def agent_row(p: Prompt) -> dict[str, Any]:
    """What the agent is given of its data row (copies: an agent may change them)."""
    messages = (
        [dict(m) for m in p.messages] if p.messages is not None else [{"role": "user", "content": p.text}]
    )
    return {
        "messages": messages,
        "prompt": p.text,
        "answer": p.answer,
        "extra": dict(p.extra),
        "index": p.index,
    }


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:500]


@dataclass
class AgentRun:
    """One episode: the agent's thread, and what it left."""

    prompt: Prompt
    episode_id: str
    deadline: float  # time.monotonic() past which the episode is closed
    started: float
    thread: threading.Thread | None = None
    outcome: tuple[str | None, str | None] | None = None  # (answer, error), set once by the agent's thread
    seconds: float = 0.0
    timed_out: bool = False
    log: EpisodeLog | None = None


class AgentTask:
    """Episodes of a run's agent (``env.agent``) against the task's own endpoint, started at the first batch."""

    def __init__(
        self,
        cfg: ShardRLConfig,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        e, s = cfg.env, cfg.rollout.sampling
        if e.agent is None:
            raise AgentConfigError(
                "config: field env.agent is not set; an agent task runs the agent it names"
            )
        self.name = e.agent
        self.agent = resolve_agent(e.agent)
        self.timeout_s = e.agent_timeout_s
        self.reward = resolve_reward(cfg.reward.function)
        self.truncated_reward = cfg.reward.truncated_reward
        self.renderer = ChatRenderer(tokenizer, chat_template)
        self.limits = Limits(
            max_turns=e.max_turns,
            max_turn_tokens=e.max_turn_tokens or s.max_response_length,
            max_response=s.max_response_length,
            context=cfg.context_length(),
        )
        self.endpoint = ChatEndpoint(self.renderer, host=host, port=port)

    def close(self) -> None:
        self.endpoint.stop()

    def run_batch(
        self,
        complete: Complete,
        prompts: Sequence[EncodedPrompt],
        sampling: SamplingSpec,
        version: Callable[[], int],
        *,
        group_prefix: str,
        epoch: int = 0,
    ) -> tuple[ScoredBatch, int]:
        """``sampling.n`` agent runs of every prompt, side by side, to their ends or time limits, as scored groups
        (group ``i`` is ``{group_prefix}.{i}``), and the count of tokens the model generated.

        ``complete`` must be thread-safe (``endpoint.Batcher`` over the engine); ``version()`` is the policy version
        at each call.  A group that cannot be trained is dropped whole, one line in ``errors``.
        """
        self.endpoint.start()
        spec = replace(sampling, n=1)
        groups = [
            [self._launch(complete, p.prompt, spec, version) for _ in range(sampling.n)] for p in prompts
        ]
        for run in (r for g in groups for r in g):
            self._wait(run)
        out = ScoredBatch()
        for i, g in enumerate(groups):
            rows, why = self._group_rows(g, f"{group_prefix}.{i}", epoch)
            if rows is None:
                out.errors.append(str(why))
            else:
                out.groups.append(rows)
        generated = sum(len(c.completion_ids) for g in groups for r in g for c in self._log(r).calls)
        return out, generated

    # ------------------------------------------------------------------------------------------ one episode

    def _launch(
        self, complete: Complete, prompt: Prompt, sampling: SamplingSpec, version: Callable[[], int]
    ) -> AgentRun:
        eid = self.endpoint.open(complete, version=version, sampling=sampling, limits=self.limits)
        now = time.monotonic()
        run = AgentRun(prompt, eid, deadline=now + self.timeout_s, started=now)
        run.thread = threading.Thread(
            target=self._call_agent, args=(run, self.endpoint.base_url(eid)), daemon=True, name=f"agent-{eid}"
        )
        run.thread.start()
        return run

    def _call_agent(self, run: AgentRun, base_url: str) -> None:
        try:
            answer = self.agent(base_url, agent_row(run.prompt))
            if answer is not None and not isinstance(answer, str):
                raise TypeError(
                    f"the agent returned {type(answer).__name__}; expected the answer text or None"
                )
            outcome: tuple[str | None, str | None] = (answer, None)
        except BaseException as e:  # whatever the agent does, the worker goes on
            outcome = (None, _one_line(e))
        run.seconds = time.monotonic() - run.started
        run.outcome = outcome

    def _wait(self, run: AgentRun) -> None:
        assert run.thread is not None
        run.thread.join(max(0.0, run.deadline - time.monotonic()))
        if run.thread.is_alive():
            run.timed_out = True
            run.seconds = self.timeout_s
        run.log = self.endpoint.close(run.episode_id)

    @staticmethod
    def _log(run: AgentRun) -> EpisodeLog:
        assert run.log is not None
        return run.log

    # ------------------------------------------------------------------------------------------ rows

    def _group_rows(
        self, runs: list[AgentRun], group_id: str, epoch: int
    ) -> tuple[list[dict[str, Any]] | None, str | None]:
        prompt = runs[0].prompt
        samples = [split_calls(self._log(r).calls, self.limits.max_response) for r in runs]
        if not any(samples):
            why = next(
                (e for r in runs if (e := self._error(r))), "the agent returned before calling the model"
            )
            return None, f"prompt {prompt.index}: no agent run made a model call ({why})"
        if not all(logprobs_ok(s) for s in samples):
            return None, "a behaviour logprob is not a finite number <= 0"
        return [
            row for r, s in zip(runs, samples, strict=True) if s for row in self._rows(r, s, group_id, epoch)
        ], None

    def _error(self, run: AgentRun) -> str | None:
        if run.timed_out:
            return f"timed out after {self.timeout_s:g} s (env.agent_timeout_s)"
        return None if run.outcome is None else run.outcome[1]

    def _rows(self, run: AgentRun, splits: list[Split], group_id: str, epoch: int) -> list[dict[str, Any]]:
        log = self._log(run)
        calls = log.calls
        error = self._error(run)
        cut = bool(log.refused) or run.timed_out or calls[-1].finish_reason == "length"
        finish = "length" if cut else "stop"
        record: dict[str, Any] = {
            "agent": self.name,
            "episode_id": run.episode_id,
            "ended": "timeout" if run.timed_out else "error" if error else "done",
            "truncated": cut,
            "calls": len(calls),
            # what the model asked for, read from the replies the endpoint sent back (the agent ran the tools)
            "tool_calls": sum(len(x.reply.get("tool_calls") or []) for x in log.exchanges),
            "seconds": round(run.seconds, 3),
        }
        if log.refused:
            record["refused"] = log.refused[-1]
        if error is not None:
            record["error"] = error
            reward = 0.0
        else:
            reward = self._reward(run, finish, record)
        return split_rows(
            splits,
            group_id=group_id,
            reward=reward,
            finish_reason=finish,
            prompt=run.prompt,
            record=record,
            decode=lambda ids: self.renderer.decode(ids, special=True),
            epoch=epoch,
        )

    def _reward(self, run: AgentRun, finish: str, record: dict[str, Any]) -> float:
        """The reward function on the final answer; 0, with the error recorded, when it fails."""
        if finish == "length" and self.truncated_reward is not None:
            return self.truncated_reward
        last = self._log(run).exchanges[-1]
        answer = run.outcome[0] if run.outcome is not None else None
        final = answer if answer is not None else (last.reply.get("content") or "")
        p = run.prompt
        messages = (*last.messages, normalise_message("reply", last.reply))
        sample = RewardSample(p.text, finish, p.index, messages, tuple(last.call.completion_ids))
        try:
            value = float(self.reward.call([final], [p.answer], [dict(p.extra)], [sample])[0])
            if not math.isfinite(value):
                raise ValueError(f"reward {value}")
        except Exception as e:
            record["reward_error"] = _one_line(e)
            return 0.0
        return value
