"""Groups in flight on a streaming engine (``rollout.streaming``): started one prompt at a time, scored as each ends.

A group is the ``n`` samples of one prompt, each its own request to the engine (``engines.base.StreamingEngine``),
so the engine's continuous batching starts a new request as soon as any slot frees.  When a group's last sample
finishes, the group goes to scoring at once (``scorepool.ScorePool``: reward functions in processes of their own,
with a time limit, so a slow or hung reward never holds the engine), and its rows come back from ``poll`` once
scored.  What the worker admits is decided by the worker (``worker.py``): this module only keeps count of what is in
flight, so that the backlog and staleness checks can count it.

Nothing here reads the run directory or the clock, apart from the time a group waits.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from rollout_worker.engines.base import Completion, SamplingSpec, StreamingEngine
from rollout_worker.prompts import EncodedPrompt
from rollout_worker.rewards import GroupRewards, Scorer
from rollout_worker.scoring import ModelScorer, ScoredBatch, score_batch


@dataclass
class _Group:
    seq: int
    prompt: EncodedPrompt
    outs: list[Completion | None]
    version: int = 0  # the engine's version when the group started: no token of it is older
    scoring: Future[GroupRewards] | None = None

    @property
    def complete(self) -> bool:
        return all(o is not None for o in self.outs)


class InlineScorer:
    """``ScorePool``'s interface in the worker's own thread (``rollout.score_processes = 0``): no time limit."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    def submit(self, prompt: EncodedPrompt, outs: list[Completion]) -> Future[GroupRewards]:
        done: Future[GroupRewards] = Future()
        try:
            done.set_result(self.scorer.score_batch([prompt], [outs])[0])
        except Exception as e:  # a scorer bug, not a reward failure: the group is dropped with its reason
            done.set_result(GroupRewards(None, f"scoring raised {type(e).__name__}: {e}"))
        return done

    def close(self) -> None:
        pass


@dataclass
class LengthDraw:
    """``rollout.sampling.lengths = "loguniform"``: each sample's length drawn log-uniformly (benchmarks)."""

    low: int
    high: int
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def __call__(self) -> int:
        return round(math.exp(self.rng.uniform(math.log(self.low), math.log(self.high))))


class GroupStream:
    """The groups one worker has in flight: generating, then scoring, then handed back as shard rows."""

    def __init__(
        self,
        engine: StreamingEngine,
        scorer: Any,  # ScorePool or InlineScorer: submit(prompt, outs) -> Future[GroupRewards]
        *,
        n: int,
        group_prefix: str,
        lengths: LengthDraw | None = None,
        model_scorer: ModelScorer | None = None,
        model_weight: float = 0.0,
    ):
        self.engine = engine
        self.scorer = scorer
        self.n = n
        self.group_prefix = group_prefix
        self.lengths = lengths
        self.model_scorer = model_scorer
        self.model_weight = model_weight
        self.groups: dict[int, _Group] = {}
        self.started = 0  # groups started by this incarnation (their sequence numbers)
        self.generating = 0  # requests in the engine
        self.timed_out = 0  # samples scored 0.0 because their reward call ran out of time or crashed

    @property
    def samples(self) -> int:
        """Samples in flight: generating or scoring (what the backlog check adds to the worker's own)."""
        return len(self.groups) * self.n

    def start(self, prompt: EncodedPrompt, sampling: SamplingSpec) -> None:
        """Submit the ``n`` requests of one group; sample ``j`` is seeded ``sampling.seed + j``."""
        seq = self.started
        self.started += 1
        self.groups[seq] = _Group(seq, prompt, [None] * self.n, version=self.engine.version)
        for j in range(self.n):
            spec = replace(
                sampling,
                n=1,
                seed=None if sampling.seed is None else sampling.seed + j,
            )
            if self.lengths is not None:
                spec = replace(spec, max_tokens=self.lengths(), ignore_eos=True)
            self.engine.submit(f"{seq}:{j}", list(prompt.ids), spec)
            self.generating += 1

    def poll(self, timeout: float, *, epoch: int) -> ScoredBatch:
        """Collect finished requests (waiting up to ``timeout`` for the first), send complete groups to scoring,
        and return the groups whose scores are in, as rows."""
        for key, c in self.engine.finished(timeout):
            seq, j = (int(x) for x in key.split(":"))
            g = self.groups.get(seq)
            if g is None:
                continue
            g.outs[j] = c
            self.generating -= 1
            if g.complete:
                g.scoring = self.scorer.submit(g.prompt, [o for o in g.outs if o is not None])
        return self._scored(epoch)

    def _scored(self, epoch: int) -> ScoredBatch:
        out = ScoredBatch()
        for seq in [s for s, g in self.groups.items() if g.scoring is not None and g.scoring.done()]:
            g = self.groups.pop(seq)
            assert g.scoring is not None
            rewards = g.scoring.result()
            self.timed_out += getattr(rewards, "timed_out", 0)
            outs = [o for o in g.outs if o is not None]
            one = score_batch(
                [g.prompt],
                [outs],
                [rewards],
                group_prefix=f"{self.group_prefix}.{seq}",
                policy_version=min(min(o.token_versions or [0]) for o in outs),
                epoch=epoch,
                model_scorer=self.model_scorer,
                model_weight=self.model_weight,
            )
            _merge(out, one)
        return out

    def abort_all(self) -> int:
        """Stop every request still generating; their groups are dropped.  Returns the samples dropped."""
        return self._abort(lambda g: True)

    def abort_older(self, version: int) -> int:
        """Stop the groups still generating that started before ``version``: the trainer would drop them (their
        oldest token is older than it accepts), so every further token of theirs is wasted engine time.  Returns
        the samples dropped."""
        return self._abort(lambda g: g.version < version)

    def _abort(self, which: Callable[[_Group], bool]) -> int:
        dropped = 0
        for seq, g in list(self.groups.items()):
            if g.scoring is not None or not which(g):
                continue
            for j, o in enumerate(g.outs):
                if o is None:
                    self.engine.abort(f"{seq}:{j}")
                    self.generating -= 1
            dropped += self.n
            del self.groups[seq]
        return dropped


def _merge(into: ScoredBatch, one: ScoredBatch) -> None:
    into.groups.extend(one.groups)
    into.dropped_reward_groups += one.dropped_reward_groups
    into.dropped_reward_samples += one.dropped_reward_samples
    into.dropped_bad_logprob_groups += one.dropped_bad_logprob_groups
    into.errors.extend(one.errors)


class StreamMeter:
    """What a streaming worker reports: the engine's busy fraction of the time the worker was allowed to generate
    (not paused for backlog or staleness), its tokens/s, and a metrics line per interval."""

    def __init__(self, engine: StreamingEngine):
        self.engine = engine
        now = time.monotonic()
        first = engine.stats()
        self.status_at = -math.inf
        self.metrics_at = now
        self._last, self._busy = now, first.busy_s
        self.unpaused_s = 0.0
        self.busy_s = 0.0  # engine busy while the worker was unpaused
        self._mark = (now, first.tokens, 0.0, 0.0)  # interval start: time, engine tokens, unpaused_s, busy_s
        self._samples = self._tokens = 0
        self._rewards: list[float] = []
        self._rate = 0.0

    def tick(self, *, paused: bool) -> None:
        now, busy = time.monotonic(), self.engine.stats().busy_s
        if not paused:
            self.unpaused_s += now - self._last
            self.busy_s += busy - self._busy
        self._last, self._busy = now, busy

    def add(self, scored: ScoredBatch) -> None:
        self._samples += scored.samples
        self._tokens += scored.tokens
        self._rewards.extend(r["reward"] for grp in scored.groups for r in grp)

    def busy_fraction(self) -> float | None:
        return None if self.unpaused_s <= 0 else round(min(1.0, self.busy_s / self.unpaused_s), 4)

    def reward_mean(self) -> float | None:
        return sum(self._rewards) / len(self._rewards) if self._rewards else None

    def tokens_per_s(self) -> float:
        t0, tok0, _, _ = self._mark
        dt = time.monotonic() - t0
        return (self.engine.stats().tokens - tok0) / dt if dt > 0 else self._rate

    def interval(self) -> dict[str, Any]:
        """The metrics line of the interval since the last one, and a new interval."""
        now, stats = time.monotonic(), self.engine.stats()
        t0, tok0, unpaused0, busy0 = self._mark
        unpaused, busy = self.unpaused_s - unpaused0, self.busy_s - busy0
        self._rate = (stats.tokens - tok0) / max(now - t0, 1e-9)
        line = {
            "samples": self._samples,
            "tokens": self._tokens,
            "tokens_per_s": round(self._rate, 1),
            "reward_mean": self.reward_mean(),
            "batch_s": round(
                busy, 3
            ),  # engine busy seconds of the interval: what a batch worker's batch_s is
            "engine_busy": None if unpaused <= 0 else round(min(1.0, busy / unpaused), 4),
            "interval_s": round(now - t0, 3),
            "requests_in_flight": stats.in_flight,
            "weight_updates": stats.updates,
        }
        self._mark = (now, stats.tokens, self.unpaused_s, self.busy_s)
        self._samples = self._tokens = 0
        self._rewards = []
        self.metrics_at = now
        return line
