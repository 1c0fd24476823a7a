"""Rollout sources: what a worker runs between admission and publishing, one kind of rollout per module.

The worker (``rollout_worker/worker.py``) is the host: it owns the process's lifecycle, admission (the staleness and
backlog bounds, decided in one place), the weight follower, publishing, the status record and the metrics.  A source
owns how samples are made and nothing else:

- ``batch.BatchSource``: single-turn prompts, a batch of ``rollout.prompts_per_batch`` x ``n`` at a time;
- ``streaming.StreamingSource``: single-turn groups started one by one as the engine has room
  (``rollout.streaming``), weights loaded under the requests in flight;
- ``episodes.EpisodeSource``: multi-turn episodes (``env.tools``, ``env.agent``, ``env.verifiers``), a batch of
  groups at a time.

Each ``step`` asks the host's ``admit`` before it starts samples and hands back what came out scored (``Produced``);
the host counts it, queues it for publishing and writes the status.  ``drain`` finishes what is in flight when the
worker stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from buffer.config import ShardRLConfig
from rollout_worker.admission import View
from rollout_worker.engines.base import SamplingSpec
from rollout_worker.following import WeightFollower
from rollout_worker.prompts import PromptStream
from rollout_worker.scoring import ScoredBatch

# admit(extra, poll=True): why no sample may start now ("stale" / "backlog"), or None; ``extra`` counts the samples
# the source started since the host's view of the run was taken, ``poll`` lets the check load a newer version first.
Admit = Callable[..., str | None]


@dataclass
class Produced:
    """What one ``step`` made: scored groups to publish, or why it made nothing and nothing is generating."""

    scored: ScoredBatch = field(default_factory=ScoredBatch)
    paused: str | None = None  # the admission reason, when the source is idle because of it
    started: int = 0  # samples started in this step (they count against the bounds until published)
    tokens_per_s: float | None = None  # a batch's own rate (a streaming source reports its own)
    batch_s: float | None = None
    episode_stats: dict[str, float] = field(default_factory=dict)


class Host(Protocol):
    """What a source may use of its worker."""

    cfg: ShardRLConfig
    worker_id: str
    incarnation: str
    slot: int
    stream: PromptStream
    weights: WeightFollower | None

    @property
    def pending_samples(self) -> int: ...  # scored, not yet published
    def starting(self, samples: int) -> None: ...  # the record before a batch of ``samples`` starts
    def set_in_flight(self, samples: int) -> None: ...
    def report(self, **fields: Any) -> None: ...  # the status record, with the host's counters
    def view(self) -> View | None: ...  # the run's state as admission last read it
    def metrics(self, **values: Any) -> None: ...


class RolloutSource(Protocol):
    admission_every_s: float  # how often the host reads the run's state for admission (0: at every step)

    @property
    def batches(self) -> int: ...  # batches (groups, for a streaming source) started so far

    def step(self, admit: Admit) -> Produced: ...
    def generating(self) -> int: ...  # samples in the engine now
    def tick(self, force: bool = False) -> None: ...  # after each step's output is published
    def counters(self) -> dict[str, int]: ...  # the source's own counters for the status record
    def drain(self, take: Callable[[Produced], None], keep_going: Callable[[], bool]) -> None: ...
    def close(self) -> None: ...


def sampling_spec(cfg: ShardRLConfig, seed: int | None) -> SamplingSpec:
    """The run's sampling settings as one request's spec."""
    s = cfg.rollout.sampling
    return SamplingSpec(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_response_length,
        n=s.n,
        stop=list(s.stop),
        seed=seed,
    )
