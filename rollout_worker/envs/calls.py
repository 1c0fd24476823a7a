"""Token-faithful training samples from the model calls an agent made through the endpoint (``endpoint``).

An agent episode is a list of ``Call``s: the prompt ids the engine was given, the ids and logprobs it produced, the
policy version it sampled with.  Nothing here renders or tokenises text; samples are built from those ids alone.

Merging.  A call extends a sample when its prompt ids start with the sample's ids so far (its prompt, then every
turn): the ids past that point are what the environment added since (the template's end of the model's turn less
the end-of-turn token the model wrote itself, tool results, user turns, the next generation prompt), and become an
environment turn (loss mask 0, logprob 0, version -1); the call's completion is a model turn (mask 1, the engine's
logprobs, the call's version).  The comparison is of ids exactly as the engine saw and produced them, end-of-turn
token included: a model that ended with ``<|endoftext|>`` where the template writes ``<|im_end|>`` does not match a
re-rendered history, and the endpoint, which builds each prompt from the earlier call's ids, makes it match by
construction whenever the conversation only grew.

Splitting.  A call that extends no sample (the template rewrote an earlier turn, e.g. dropped reasoning; the agent
edited, summarised or restarted its history; a second conversation of the same agent) starts a new sample whose
prompt is its whole prompt.  So does a call whose merge would take the sample's response past ``max_response``
(the trainer refuses a longer one): the long history is then the new sample's prompt.  Each call extends the
longest sample it can, so interleaved conversations of one agent each keep their own sample.

Advantage sharing.  Every sample of an episode gets the episode's reward and the group id of its row (the ``n``
episodes of one data row), and carries ``{"episode_id", "split", "splits"}`` in its ``episode`` record.  The trainer
plans whole groups, so the samples of an episode are trained together.  GRPO's baseline should be over episodes,
not samples: an episode split in three would otherwise count three times in its group's mean and std, so the
trainer computes the group statistics over one entry per ``(group_id, episode_id)`` and gives each sample its
episode's advantage (``trainer/step.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from buffer.schema import logprobs_ok as valid_logprobs

from ..prompts import Prompt
from ..rows import SampleRow, Turns
from .episode import ENV_VERSION, Turn


@dataclass(frozen=True)
class Call:
    """One model call of an episode, as the engine saw and answered it."""

    prompt_ids: list[int]
    completion_ids: list[int]  # the engine's, end-of-turn token included
    logprobs: list[float]  # the engine's, one per completion id
    version: int  # the policy version that sampled the completion
    finish_reason: str  # the engine's: "stop" | "length"


@dataclass
class Split:
    """One training sample of an episode: the prompt of its first call, then every turn after it."""

    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # indices of the calls it holds, in order

    @property
    def response_ids(self) -> list[int]:
        return [i for t in self.turns for i in t.ids]

    @property
    def response_logprobs(self) -> list[float]:
        return [x for t in self.turns for x in t.logprobs]

    @property
    def loss_mask(self) -> list[int]:
        return [int(t.model) for t in self.turns for _ in t.ids]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + sum(len(t.ids) for t in self.turns)

    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def split_calls(calls: Sequence[Call], max_response: int | None = None) -> list[Split]:
    """The samples of an episode's calls (in the order they were made): merged where a call extends a sample,
    split where it extends none or the merge would pass ``max_response`` response tokens."""
    splits: list[Split] = []
    for k, c in enumerate(calls):
        s = _extended(splits, c, max_response)
        if s is None:
            s = Split(list(c.prompt_ids))
            splits.append(s)
        else:
            env = c.prompt_ids[s.length :]
            if env:
                s.turns.append(Turn(env, [0.0] * len(env), ENV_VERSION))
        if c.completion_ids:
            s.turns.append(Turn(list(c.completion_ids), list(c.logprobs), c.version))
        s.calls.append(k)
    return [s for s in splits if any(t.model for t in s.turns)]


def _extended(splits: list[Split], c: Call, max_response: int | None) -> Split | None:
    """The longest sample whose ids are a prefix of the call's prompt ids and that has room for the call."""
    best: Split | None = None
    for s in splits:
        n = s.length
        if len(c.prompt_ids) < n or (best is not None and n <= best.length):
            continue
        if (
            max_response is not None
            and len(c.prompt_ids) + len(c.completion_ids) - len(s.prompt_ids) > max_response
        ):
            continue
        if c.prompt_ids[:n] == s.ids():
            best = s
    return best


def logprobs_ok(splits: Sequence[Split]) -> bool:
    return all(valid_logprobs(s.response_logprobs) for s in splits)


def split_rows(
    splits: Sequence[Split],
    *,
    group_id: str,
    reward: float,
    finish_reason: str,
    prompt: Prompt,
    record: dict[str, Any],
    decode: Callable[[list[int]], str],
    epoch: int = 0,
) -> list[dict[str, Any]]:
    """Shard rows of one episode's samples, in the multi-turn columns ``episode.group_rows`` writes.

    Every row carries the episode's reward and finish reason (what the reward judged is the whole episode), and
    ``record`` with ``split``/``splits`` added; ``decode`` gives the text of ids, special tokens kept.
    """
    rows = []
    for i, s in enumerate(splits):
        turns = Turns.of(
            s.turns, s.loss_mask, {**record, "split": i, "splits": len(splits), "split_calls": len(s.calls)}
        )
        rows.append(
            SampleRow(
                group_id=group_id,
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                response_logprobs=s.response_logprobs,
                reward=reward,
                policy_version=turns.oldest,
                finish_reason=finish_reason,
                prompt_text=decode(s.prompt_ids),
                response_text=decode(s.response_ids),
                answer=prompt.answer,
                extra={"prompt_index": prompt.index, "epoch": epoch},
                turns=turns,
            ).to_dict()
        )
    return rows
