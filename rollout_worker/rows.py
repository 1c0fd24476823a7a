"""One experience sample as the worker builds it, before the shard writer stamps ``sample_id``, ``worker_id`` and
``created_at`` (buffer/schema.py has the columns).

Every builder (single-turn scoring, episodes, agent runs) makes a ``SampleRow``, so the rules a row must keep live
here once: a behaviour logprob above 0 is float32 rounding of a log-softmax and is stored as 0, and a response that
spans a weight update is judged by its oldest token's version.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class _Turn(Protocol):  # envs.episode.Turn, as far as a row needs it
    @property
    def ids(self) -> list[int]: ...

    @property
    def version(self) -> int: ...  # -1 on an environment turn


@dataclass(frozen=True)
class Turns:
    """The multi-turn columns: per response token whether the model sampled it, the turns' lengths and versions
    (-1 on the environment's), and the episode's record (its turns, calls, why it ended)."""

    loss_mask: list[int]
    lengths: list[int]
    versions: list[int]
    episode: dict[str, Any]

    @classmethod
    def of(cls, turns: Sequence[_Turn], loss_mask: list[int], episode: dict[str, Any]) -> Turns:
        return cls(loss_mask, [len(t.ids) for t in turns], [t.version for t in turns], episode)

    @property
    def oldest(self) -> int:
        """The oldest model turn's version: what the sample's staleness is judged by."""
        return oldest(self.versions)


@dataclass(frozen=True)
class SampleRow:
    group_id: str
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    response_logprobs: Sequence[float]
    reward: float
    policy_version: int  # of the weights that sampled it; with token_versions, their oldest model token's
    finish_reason: str  # "stop" or "length"
    prompt_text: str | None
    response_text: str | None
    answer: str | None
    extra: dict[str, Any] = field(default_factory=dict)
    turns: Turns | None = None
    # per response token, set only when the response spans a weight update (-1 on environment tokens)
    token_versions: Sequence[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The row in the shard writer's column names."""
        row: dict[str, Any] = {
            "group_id": self.group_id,
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "response_logprobs": [min(x, 0.0) for x in self.response_logprobs],
            "reward": self.reward,
            "policy_version": self.policy_version,
            "finish_reason": self.finish_reason,
            "prompt_text": self.prompt_text,
            "response_text": self.response_text,
            "answer": self.answer,
            "extra": json.dumps(self.extra),
        }
        if self.turns is not None:
            row |= {
                "loss_mask": self.turns.loss_mask,
                "turn_lengths": self.turns.lengths,
                "turn_versions": self.turns.versions,
                "episode": json.dumps(self.turns.episode),
            }
        if self.token_versions is not None:
            row["token_versions"] = list(self.token_versions)
        return row


def spanned(token_versions: Sequence[int] | None) -> Sequence[int] | None:
    """The per-token versions worth storing: only those of a response that more than one version sampled."""
    if token_versions is None:
        return None
    return token_versions if len({v for v in token_versions if v >= 0}) > 1 else None


def oldest(versions: Sequence[int]) -> int:
    """The version a sample's staleness is judged by: its oldest model token's (environment tokens are -1)."""
    return min(v for v in versions if v >= 0)
