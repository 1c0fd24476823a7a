"""Scoring one generated batch into experience rows, group by group: a pure function of what it is given.

A group is the ``n`` responses to one prompt.  A group is kept or dropped whole, never in part, because dropping one
sample of a GRPO group would shift the group's baseline: it is dropped when its reward failed (the function raised
or returned something that is not a finite number), when the reward model's score of any response is not finite, or
when any behaviour logprob is not a finite number <= 0 (beyond float rounding), which would poison the PPO ratio.
Nothing here touches the run directory, the engine or the clock, so ``tests/unit`` checks it on hand-made batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from buffer.schema import logprobs_ok as valid_logprobs
from rollout_worker.engines.base import Completion
from rollout_worker.prompts import EncodedPrompt
from rollout_worker.rewards import GroupRewards
from rollout_worker.rows import SampleRow, oldest, spanned

# Logprobs are log-softmax outputs: <= 0 up to float32 rounding (the shard schema's tolerance).

# (prompt texts, response texts) -> one score per pair; the reward model's ``score``.
ModelScorer = Callable[[list[str], list[str]], list[float]]


@dataclass
class ScoredBatch:
    """The kept groups as shard rows, and what was dropped (counted in the worker's status record)."""

    groups: list[list[dict[str, Any]]] = field(default_factory=list)
    dropped_reward_groups: int = 0
    dropped_reward_samples: int = 0
    dropped_bad_logprob_groups: int = 0
    errors: list[str] = field(default_factory=list)  # one line per group dropped for its reward

    @property
    def samples(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def tokens(self) -> int:
        return sum(len(r["response_ids"]) for g in self.groups for r in g)

    def reward_mean(self) -> float | None:
        rewards = [r["reward"] for g in self.groups for r in g]
        return sum(rewards) / len(rewards) if rewards else None


def logprobs_ok(outs: Sequence[Completion]) -> bool:
    return all(valid_logprobs(c.response_logprobs) for c in outs)


def score_batch(
    prompts: Sequence[EncodedPrompt],
    outputs: Sequence[Sequence[Completion]],
    rewards: Sequence[GroupRewards],
    *,
    group_prefix: str,
    policy_version: int,
    epoch: int,
    model_scorer: ModelScorer | None = None,
    model_weight: float = 0.0,
) -> ScoredBatch:
    """Rows of every kept group of one batch; ``prompts``, ``outputs`` and ``rewards`` (the reward function's,
    from ``rewards.Scorer.score_batch``) are parallel, one per group.

    Group ``i`` gets the id ``{group_prefix}.{i}``.  With ``model_scorer``, each row's reward is the function's
    reward plus ``model_weight`` times the model's score (both are kept in ``extra``); the model only scores the
    groups that survived the other checks.
    """
    out = ScoredBatch()
    kept: list[int] = []
    for i, (outs, reward) in enumerate(zip(outputs, rewards, strict=True)):
        if reward.rewards is None:
            _drop_reward(out, len(outs), reward.error or "reward function failed")
        elif not logprobs_ok(outs):
            out.dropped_bad_logprob_groups += 1
        else:
            kept.append(i)
    scores = _model_scores(prompts, outputs, kept, model_scorer)
    for i in kept:
        group_scores = scores.get(i)
        if group_scores is not None and not all(math.isfinite(x) for x in group_scores):
            _drop_reward(out, len(outputs[i]), "reward model returned a non-finite score")
            continue
        group_rewards = rewards[i].rewards
        assert group_rewards is not None
        out.groups.append(
            [
                _row(
                    f"{group_prefix}.{i}",
                    prompts[i],
                    c,
                    r,
                    policy_version,
                    epoch,
                    None if group_scores is None else (group_scores[j], model_weight),
                    getattr(rewards[i], "note", None),
                )
                for j, (c, r) in enumerate(zip(outputs[i], group_rewards, strict=True))
            ]
        )
    return out


def _drop_reward(out: ScoredBatch, samples: int, error: str) -> None:
    out.dropped_reward_groups += 1
    out.dropped_reward_samples += samples
    out.errors.append(error)


def _model_scores(
    prompts: Sequence[EncodedPrompt],
    outputs: Sequence[Sequence[Completion]],
    kept: list[int],
    scorer: ModelScorer | None,
) -> dict[int, list[float]]:
    """group index -> the reward model's scores of its responses (one call for the whole batch)."""
    if scorer is None or not kept:
        return {}
    pairs = [(prompts[i].text or prompts[i].prompt.text, c.response_text) for i in kept for c in outputs[i]]
    flat = scorer([p for p, _ in pairs], [r for _, r in pairs])
    out, k = {}, 0
    for i in kept:
        out[i] = list(flat[k : k + len(outputs[i])])
        k += len(outputs[i])
    return out


def _row(
    gid: str,
    p: EncodedPrompt,
    c: Completion,
    reward: float,
    version: int,
    epoch: int,
    model: tuple[float, float] | None,
    note: str | None = None,
) -> dict[str, Any]:
    extra: dict[str, Any] = {"prompt_index": p.prompt.index, "epoch": epoch}
    if note is not None:  # a reward call of the group timed out or crashed: what scored 0.0 and why
        extra["reward_note"] = note
    if model is not None:
        score, weight = model
        extra |= {"reward_function": reward, "reward_model": score}
        reward = reward + weight * score
    return SampleRow(
        group_id=gid,
        prompt_ids=p.ids,
        response_ids=c.response_ids,
        response_logprobs=c.response_logprobs,
        reward=reward,
        # generated across a weight update: the oldest token is what staleness means
        policy_version=oldest(c.token_versions) if c.token_versions else version,
        finish_reason=c.finish_reason,
        prompt_text=p.text or p.prompt.text,  # what the model saw (chat template applied)
        response_text=c.response_text,
        answer=p.prompt.answer,
        extra=extra,
        token_versions=spanned(c.token_versions),
    ).to_dict()
