"""Single-turn prompts a batch at a time: ``rollout.prompts_per_batch`` prompts x ``n`` samples per engine call,
scored as whole groups.  Weights change between batches only (``WeightFollower`` in the host's admission)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from rollout_worker.engines.base import Engine
from rollout_worker.prompts import EncodedPrompt, derive_seed
from rollout_worker.rewards import Scorer
from rollout_worker.scoring import ScoredBatch, score_batch
from rollout_worker.sources import Admit, Host, Produced, sampling_spec
from rollout_worker.streaming import LengthDraw


class BatchSource:
    admission_every_s = 0.0  # a batch takes seconds: read the run's state before each one

    def __init__(
        self,
        host: Host,
        engine: Engine,
        scorer: Scorer,
        *,
        lengths: LengthDraw | None = None,
        model_scorer: Any = None,
    ):
        self.host, self.engine, self.scorer = host, engine, scorer
        self.lengths = lengths
        self.model_scorer = model_scorer
        self._batches = 0

    @property
    def batches(self) -> int:
        return self._batches

    def step(self, admit: Admit) -> Produced:
        reason = admit()
        if reason is not None:
            return Produced(paused=reason)
        host, cfg = self.host, self.host.cfg
        assert host.weights is not None
        prompts = host.stream.next_batch(cfg.rollout.prompts_per_batch)
        version = host.weights.version
        started = len(prompts) * cfg.rollout.sampling.n
        # The cursor moves before generating: a batch that kills the engine is skipped after a restart.
        host.starting(started)
        start = time.monotonic()
        scored, generated = self.make(prompts, version)
        seconds = max(time.monotonic() - start, 1e-9)
        self._batches += 1
        return Produced(scored=scored, started=started, tokens_per_s=generated / seconds, batch_s=seconds)

    def make(self, prompts: list[EncodedPrompt], version: int) -> tuple[ScoredBatch, int]:
        """The batch's scored groups and the tokens the engine generated for them."""
        spec = self.sampling()
        if self.lengths is not None:
            each = [self.lengths() for _ in range(len(prompts) * spec.n)]
            spec = replace(spec, max_tokens_each=each, ignore_eos=True)
        outputs = self.engine.generate([p.ids for p in prompts], spec)
        scored = score_batch(
            prompts,
            outputs,
            self.scorer.score_batch(prompts, outputs),
            group_prefix=self.group_prefix(),
            policy_version=version,
            epoch=self.host.stream.epoch,
            model_scorer=self.model_scorer,
            model_weight=self.host.cfg.reward.reward_model_weight,
        )
        return scored, sum(len(c.response_ids) for out in outputs for c in out)

    def sampling(self) -> Any:
        h = self.host
        return sampling_spec(h.cfg, derive_seed(h.cfg.run.seed, "batch", h.slot, h.incarnation, self.batches))

    def group_prefix(self) -> str:
        return f"{self.host.worker_id}.{self.host.incarnation}.{self.batches}"

    def generating(self) -> int:
        return 0  # between steps nothing is

    def tick(self, force: bool = False) -> None:
        self.host.set_in_flight(self.host.pending_samples)

    def counters(self) -> dict[str, int]:
        return {}

    def drain(self, take: Any, keep_going: Any) -> None:
        """A batch ends inside its step: nothing is left in flight."""

    def close(self) -> None:
        pass
