"""The run's rollout source, chosen once from its config: the only place that knows the modes."""

from __future__ import annotations

from typing import Any

from rollout_worker.envs import ToolTask
from rollout_worker.rewards import Scorer
from rollout_worker.sources import Host, RolloutSource
from rollout_worker.sources.batch import BatchSource
from rollout_worker.sources.episodes import EpisodeSource, make_complete
from rollout_worker.sources.streaming import StreamingSource
from rollout_worker.streaming import LengthDraw


def make_source(
    host: Host,
    engine: Any,
    *,
    task: Any,
    tokenizer: Any,
    scorer: Scorer,
    lengths: LengthDraw | None,
    model_scorer: Any,
) -> RolloutSource:
    """Episodes when the run has an environment (``task``: ``episodes.make_task``), else single-turn batches or,
    with ``rollout.streaming``, single-turn groups streamed through the engine."""
    streaming = host.cfg.rollout.streaming
    if task is not None:
        complete = None
        if streaming or not isinstance(task, ToolTask):  # a batch engine's tool task calls generate itself
            complete = make_complete(engine, tokenizer, streaming)
        return EpisodeSource(host, engine, task, complete, streaming=streaming)
    if streaming:
        return StreamingSource(host, engine, scorer, lengths=lengths, model_scorer=model_scorer)
    return BatchSource(host, engine, scorer, lengths=lengths, model_scorer=model_scorer)
