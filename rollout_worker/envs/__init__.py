"""Multi-turn, tool-using episodes for the rollout worker.

``episode`` holds the environment interface (``Environment``, the built-in ``ToolEnv``), token-faithful trajectories
(``Episode``, ``Turn``), the episode loop (``run_episodes``) and the shard rows of a group (``group_rows``); ``tools``
resolves ``env.tools`` and parses the model's tool calls; ``sandbox`` runs one call in a child process under limits.
``ToolTask`` puts them together from a run config.  docs/DATA.md describes the multi-turn shard columns.  Importing
this package imports nothing heavy: the tokenizer and the engine are passed in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from buffer.config import ShardRLConfig

from ..engines.base import SamplingSpec
from ..prompts import EncodedPrompt, Prompt
from ..rewards import resolve_reward
from ..scoring import ScoredBatch
from .episode import (
    ChatRenderer,
    Complete,
    Episode,
    Generate,
    Limits,
    ToolEnv,
    group_rows,
    run_episodes,
    run_episodes_in_flight,
)
from .sandbox import ToolRunner
from .tools import Tool, resolve_tools

EPISODE_COUNTERS = (
    "episodes",
    "model_turns",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "truncated_episodes",
)


def episode_stats(groups: Sequence[Sequence[dict[str, Any]]]) -> dict[str, float]:
    """What a batch's episodes did, summed from their rows' ``episode`` records (one per episode: a split
    episode's first sample speaks for it, its model turns counted over every sample): the worker's counters and
    metrics (``EPISODE_COUNTERS``, and ``env_s``, the seconds its tools ran)."""
    out: dict[str, float] = dict.fromkeys((*EPISODE_COUNTERS, "env_s"), 0)
    for row in (r for g in groups for r in g):
        if not row.get("episode"):
            continue
        rec = json.loads(row["episode"])
        out["model_turns"] += rec.get("model_turns", sum(v >= 0 for v in row.get("turn_versions") or []))
        if rec.get("split", 0):
            continue
        out["episodes"] += 1
        out["truncated_episodes"] += bool(rec.get("truncated"))
        for k in ("tool_calls", "tool_errors", "tool_timeouts"):
            out[k] += int(rec.get(k, 0))
        out["env_s"] += float(rec.get("tool_s", 0.0))
    return out


def check_tools(cfg: ShardRLConfig) -> list[Tool]:
    """The tools of ``env.tools``, or a one-line ToolConfigError (what ``shardrl init`` checks)."""
    return resolve_tools(cfg.env.tools)


class ToolTask:
    """Episodes of a run's tool task: a ``ToolEnv`` per sample, rendered through the tokenizer's chat template (or
    ``chat_template``)."""

    def __init__(self, cfg: ShardRLConfig, tokenizer: Any, *, chat_template: str | None = None):
        e, s = cfg.env, cfg.rollout.sampling
        self.tools = check_tools(cfg)
        self.runner = ToolRunner(e.tool_timeout_s, e.tool_memory_mb, e.tool_output_chars)
        self.reward = resolve_reward(cfg.reward.function)
        self.truncated_reward = cfg.reward.truncated_reward
        self.renderer = ChatRenderer(tokenizer, chat_template)
        self.limits = Limits(
            max_turns=e.max_turns,
            max_turn_tokens=e.max_turn_tokens or s.max_response_length,
            max_response=s.max_response_length,
            context=cfg.context_length(),
        )

    def episode(self, prompt: Prompt) -> Episode:
        env = ToolEnv(prompt, self.tools, self.runner, self.reward, self.truncated_reward)
        return Episode.start(env, self.renderer)

    def run_batch(
        self,
        generate: Generate | None,
        prompts: Sequence[EncodedPrompt],
        sampling: SamplingSpec,
        version: Callable[[], int],
        *,
        group_prefix: str,
        epoch: int = 0,
        complete: Complete | None = None,
    ) -> tuple[ScoredBatch, int]:
        """``sampling.n`` episodes of every prompt, run to their ends, as scored groups (group ``i`` is
        ``{group_prefix}.{i}``), and the count of tokens the model generated.

        With ``complete`` (a streaming engine's ``StreamCompleter``) each episode goes at its own pace
        (``run_episodes_in_flight``); else every live episode takes a turn per ``generate`` call.

        The prompts are rendered again here, with the tools (``EncodedPrompt.ids`` have none).  A group whose
        logprobs are unusable, or whose prompt leaves no room for a turn, is dropped whole, one line in ``errors``.
        """
        groups = [[self.episode(p.prompt) for _ in range(sampling.n)] for p in prompts]
        flat = [e for g in groups for e in g]
        if complete is not None:
            run_episodes_in_flight(complete, flat, sampling, self.limits, version)
        else:
            assert generate is not None, "run_batch needs generate or complete"
            run_episodes(generate, flat, sampling, self.limits, version)
        out = ScoredBatch()
        for i, (g, p) in enumerate(zip(groups, prompts, strict=True)):
            rows, why = group_rows(g, f"{group_prefix}.{i}", p.prompt, epoch=epoch)
            if rows is None:
                out.errors.append(str(why))
                continue
            out.groups.append(rows)
        generated = sum(len(t.ids) for g in groups for e in g for t in e.turns if t.model)
        return out, generated
