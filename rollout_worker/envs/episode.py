"""Multi-turn episodes: the environment interface, token-faithful trajectories, and the loop that runs them.

An ``Environment`` is one episode's other side.  ``start()`` gives the conversation the model starts from (the data
row's messages); ``step(reply)`` takes each assistant turn's text and returns the environment's next messages (tool
results, user turns) and whether the episode is done; ``reward(...)`` scores the finished episode.  ``ToolEnv`` is the
built-in one: it answers every ``<tool_call>`` with the tool's result (run in a child process, ``sandbox``) or an error
message, is done at the first turn without a tool call, and scores the last reply with the run's reward function
(``rollout_worker.rewards``).

Token faithfulness.  An episode is a prompt and a list of ``Turn``s: each model turn holds the ids and logprobs the
engine returned, unchanged (a turn cut to its budget keeps a prefix, which is what sampling with that budget would
have drawn); each environment turn holds the ids appended after it.  The engine's next prompt is always the prompt
followed by every turn so far, so what the trainer reads (``response_ids``, the turns back to back) is exactly what
the engine saw and produced: no assistant text is ever tokenised again.  An environment turn's ids come from the chat
template, rendered with and without the new messages; only the new text is tokenised: what the template writes after
an assistant message's content (``<|im_end|>\\n`` in Qwen's), less the end-of-turn token the model itself produced,
then the new messages and the next generation prompt.  A template that rewrites earlier turns (one that drops
earlier reasoning) breaks the prefix; the episode is then split there (``Episode._split``): what the engine saw so
far is one sample, and the episode goes on in a new one whose prompt is the conversation rendered whole, so no sample
holds ids the engine never saw.  The samples of an episode share its reward and, in the trainer, its advantage (one
``episode_id``).

Limits: ``max_turns`` assistant turns, ``max_turn_tokens`` per turn (a longer turn is cut there and the episode goes
on), the response budget (every turn counts) and the engine's context.  An episode past any of them ends as truncated (``finish_reason = "length"``, the reason in its
``episode`` record); it is still a sample.  ``run_episodes`` takes one turn of every live episode per ``generate``
call, and runs the environments' steps (their tools) side by side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from buffer.schema import logprobs_ok as valid_logprobs

from ..engines.base import Completion, SamplingSpec
from ..prompts import Prompt, PromptError
from ..rewards import RewardFunction
from ..rewards import Sample as RewardSample
from ..rows import SampleRow, Turns
from .sandbox import ToolRunner
from .tools import Tool, parse_tool_calls

Message = dict[str, Any]
Generate = Callable[[list[list[int]], SamplingSpec], list[list[Completion]]]
ENV_VERSION = -1  # the policy version of an environment turn: no policy sampled it
_MARK = "\x00shardrl-turn\x00"


@dataclass
class Step:
    """What the environment answers to one assistant turn."""

    messages: list[
        Message
    ]  # appended to the conversation (role "tool" for tool results, "user" for user turns)
    done: bool
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_s: float = 0.0


class Environment:
    """One episode's environment; subclass and override ``step`` (and ``reward``) for other interactions."""

    tools: Sequence[Tool] = ()  # what the chat template shows the model

    def start(self) -> list[Message]:
        raise NotImplementedError

    def step(self, reply: str) -> Step:
        raise NotImplementedError

    def reward(
        self, reply: str, *, finish_reason: str, messages: list[Message], response_ids: list[int]
    ) -> float:
        return 0.0


class ToolEnv(Environment):
    """A data row's conversation, the configured tools (or the subset the row's ``tools`` field names), and the run's
    reward function on the last reply."""

    def __init__(
        self,
        prompt: Prompt,
        tools: list[Tool],
        runner: ToolRunner,
        reward: RewardFunction | None = None,
        truncated_reward: float | None = None,
    ):
        self.prompt = prompt
        self.tools = _row_tools(prompt, tools)
        self.runner = runner
        self.reward_fn = reward
        self.truncated_reward = truncated_reward
        self._by_name = {t.name: t for t in self.tools}

    def start(self) -> list[Message]:
        if self.prompt.messages is not None:
            return [dict(m) for m in self.prompt.messages]
        return [{"role": "user", "content": self.prompt.text}]

    def step(self, reply: str) -> Step:
        calls = parse_tool_calls(reply)
        if not calls:
            return Step([], done=True)
        out = Step([], done=False, tool_calls=len(calls))
        for call in calls:
            tool = self._by_name.get(call.name)
            if call.error is not None:
                content, failed, timed_out = f"error: {call.error}", True, False
            elif tool is None:
                known = ", ".join(self._by_name) or "none"
                content, failed, timed_out = (
                    f"error: unknown tool {call.name!r} (tools: {known})",
                    True,
                    False,
                )
            else:
                result = self.runner.run(tool.target, call.arguments)
                content, failed, timed_out = result.content, result.error is not None, result.timed_out
                out.tool_s += result.seconds
            out.messages.append({"role": "tool", "name": call.name, "content": content})
            out.tool_errors += failed
            out.tool_timeouts += timed_out
        return out

    def reward(
        self, reply: str, *, finish_reason: str, messages: list[Message], response_ids: list[int]
    ) -> float:
        if finish_reason == "length" and self.truncated_reward is not None:
            return self.truncated_reward
        if self.reward_fn is None:
            return 0.0
        p = self.prompt
        sample = RewardSample(p.text, finish_reason, p.index, tuple(messages), tuple(response_ids))
        return float(self.reward_fn.call([reply], [p.answer], [dict(p.extra)], [sample])[0])


def _row_tools(prompt: Prompt, tools: list[Tool]) -> list[Tool]:
    wanted = prompt.extra.get("tools")
    if wanted is None:
        return list(tools)
    names = {t.name for t in tools}
    if not isinstance(wanted, list) or not all(isinstance(w, str) and w in names for w in wanted):
        raise PromptError(
            f"prompt {prompt.index}: field 'tools' is {wanted!r:.80}, expected a list of names among the tools of "
            f"env.tools ({', '.join(sorted(names)) or 'none'})"
        )
    return [t for t in tools if t.name in wanted]


# ---------------------------------------------------------------------------------------------- rendering


class TemplateError(RuntimeError):
    """The chat template does not keep the conversation so far as a prefix of its next rendering."""


class ChatRenderer:
    """The tokenizer's chat template (or ``chat_template``), with the episode's tools, as token ids."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            name = getattr(tokenizer, "name_or_path", "tokenizer")
            raise PromptError(f"{name}: multi-turn episodes need a chat template and the tokenizer has none")

    def render(self, messages: list[Message], tools: Sequence[Tool], *, generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages,
                tools=[t.schema for t in tools] or None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                chat_template=self.chat_template,
            )
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # the template wrote any BOS

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=not special))

    def turn_end(self, tools: Sequence[Tool]) -> str:
        """What the template writes after an assistant message's content."""
        text = self.render(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}],
            tools,
            generation_prompt=False,
        )
        return text[text.rindex(_MARK) + len(_MARK) :]

    def env_turn(
        self, history: list[Message], new: list[Message], tools: Sequence[Tool], model_ids: list[int]
    ) -> list[int]:
        """Ids appended after the model's last turn (the last message of ``history``) for the messages ``new``."""
        before = self.render(history, tools, generation_prompt=False)
        after = self.render(history + new, tools, generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError("the chat template does not keep the conversation so far as a prefix")
        closing = self.turn_end(tools)
        last = self.decode(model_ids[-1:], special=True) if model_ids else ""
        # A model that ended its turn itself wrote the first part of the closing; only the rest is the environment's.
        # A turn cut at its budget gets the whole closing from the environment.
        if last and closing.startswith(last):
            closing = closing[len(last) :]
        return self.encode(closing + after[len(before) :])


# ---------------------------------------------------------------------------------------------- trajectories


@dataclass(frozen=True)
class Turn:
    ids: list[int]
    logprobs: list[float]  # the engine's on a model turn; 0 on an environment turn
    version: int  # the policy version that sampled it (the oldest, if several); ENV_VERSION for an environment turn
    # each token's version, when a weight update landed while the turn was generated (streaming engines)
    token_versions: list[int] | None = None

    @property
    def model(self) -> bool:
        return self.version != ENV_VERSION


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_turn_tokens: int
    max_response: int  # tokens of every turn together (rollout.sampling.max_response_length)
    context: int  # prompt and response together (the engine's max_model_len)


@dataclass
class Episode:
    env: Environment
    renderer: ChatRenderer
    prompt_ids: list[int]
    prompt_text: str
    messages: list[Message]
    turns: list[Turn] = field(default_factory=list)
    # Samples closed where the template broke the prefix: (prompt ids, prompt text, turns) each; the open one is
    # prompt_ids / prompt_text / turns
    closed: list[tuple[list[int], str, list[Turn]]] = field(default_factory=list)
    ended: str | None = None  # done | length | turn_limit | context_limit | template
    reply: str = ""  # the last assistant turn's text
    reply_cut: bool = (
        False  # the last assistant turn was cut at its budget (env.max_turn_tokens or the room left)
    )
    stats: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("tool_calls", "tool_errors", "tool_timeouts", "tool_s"), 0)
    )

    @classmethod
    def start(cls, env: Environment, renderer: ChatRenderer) -> Episode:
        messages = env.start()
        text = renderer.render(messages, env.tools, generation_prompt=True)
        return cls(env, renderer, renderer.encode(text), text, messages)

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

    @property
    def truncated(self) -> bool:
        return self.ended not in (None, "done")

    def room(self, limits: Limits) -> int:
        """Tokens left for the rest of the episode: the response budget and the context."""
        used = sum(len(t.ids) for t in self.turns)
        return min(limits.max_response - used, limits.context - self.length)

    def add_model_turn(self, c: Completion, limits: Limits, version: int) -> None:
        """Record one sampled turn, cut to its budget; a turn that used up the episode's room ends it.

        A turn cut at ``max_turn_tokens`` with room left goes on: the environment closes it (its end-of-turn tokens
        are then the environment's) and answers what there is.
        """
        room = self.room(limits)
        budget = min(limits.max_turn_tokens, room)
        ids, lps = list(c.response_ids[:budget]), list(c.response_logprobs[:budget])
        self.reply = self.renderer.decode(ids) if len(c.response_ids) > budget else c.response_text
        self.reply_cut = len(c.response_ids) > budget or c.finish_reason == "length"
        versions = None if c.token_versions is None else list(c.token_versions[:budget])
        if versions:  # a streaming engine says which weights drew each token
            version = min(versions)
            versions = versions if len(set(versions)) > 1 else None
        self.turns.append(Turn(ids, lps, version, versions))
        self.messages.append({"role": "assistant", "content": self.reply})
        if len(ids) >= room:
            self.ended = "length"

    def add_env_turn(self, step: Step, limits: Limits) -> None:
        """Append the environment's answer, or end the episode: done, past a limit, or a template that broke."""
        for k in ("tool_calls", "tool_errors", "tool_timeouts", "tool_s"):
            self.stats[k] += getattr(step, k)
        if step.done:
            # an episode whose last reply was cut ends truncated, as a single-turn response cut at its budget does
            self.ended = "length" if self.reply_cut else "done"
            return
        if self.model_turns >= limits.max_turns:
            self.ended = "turn_limit"
            return
        try:
            ids = self.renderer.env_turn(self.messages, step.messages, self.env.tools, self.turns[-1].ids)
        except TemplateError:
            self._split(step, limits)
            return
        if not ids:  # nothing to tell the model apart from its own turn: ending beats a turn of no tokens
            self.ended = "template"
            return
        used = sum(len(t.ids) for t in self.turns)
        # the model needs room for at least one token after it
        if used + len(ids) >= limits.max_response or self.length + len(ids) >= limits.context:
            self.ended = "context_limit"
            return
        self.turns.append(Turn(ids, [0.0] * len(ids), ENV_VERSION))
        self.messages.extend(step.messages)

    @property
    def model_turns(self) -> int:
        return sum(t.model for _, _, turns in self.closed for t in turns) + sum(t.model for t in self.turns)

    def _split(self, step: Step, limits: Limits) -> None:
        """The template rewrote an earlier turn (one that drops earlier reasoning): what the engine saw so far is
        closed as a sample, and the episode goes on in a new one whose prompt is the conversation rendered whole,
        new messages included, so every sample is still exactly what the engine saw and drew."""
        self.messages.extend(step.messages)
        text = self.renderer.render(self.messages, self.env.tools, generation_prompt=True)
        ids = self.renderer.encode(text)
        if len(ids) >= limits.context:
            self.ended = "context_limit"
            return
        self.closed.append((self.prompt_ids, self.prompt_text, self.turns))
        self.prompt_ids, self.prompt_text, self.turns = ids, text, []

    def record(self) -> dict[str, Any]:
        """The ``episode`` column: how it went."""
        return {
            "ended": self.ended,
            "truncated": self.truncated,
            "turns": len(self.turns) + sum(len(turns) for _, _, turns in self.closed),
            "model_turns": self.model_turns,
            **{k: (round(v, 3) if k == "tool_s" else int(v)) for k, v in self.stats.items()},
        }


def run_episodes(
    generate: Generate,
    episodes: list[Episode],
    sampling: SamplingSpec,
    limits: Limits,
    version: Callable[[], int],
    *,
    tool_threads: int = 8,
) -> None:
    """Run every episode to its end, one ``generate`` call per turn of all the live ones.

    ``sampling.n`` is ignored (each episode is one sample; a group is n episodes of one row); ``version()`` is the
    engine's policy version at each call.  One ``max_tokens`` serves the call, each turn is then cut to its own
    episode's budget.
    """
    live = list(episodes)
    round_ = 0
    with ThreadPoolExecutor(max_workers=tool_threads) as pool:
        while live:
            for e in live:
                if e.room(limits) < 1:
                    e.ended = "context_limit"
            live = [e for e in live if e.ended is None]
            if not live:
                break
            budget = max(min(limits.max_turn_tokens, e.room(limits)) for e in live)
            seed = None if sampling.seed is None else sampling.seed + 1_000_003 * round_
            spec = replace(sampling, n=1, max_tokens=budget, seed=seed)
            v = version()
            outs = generate([e.prompt_ids + e.response_ids for e in live], spec)
            for e, out in zip(live, outs, strict=True):
                e.add_model_turn(out[0], limits, v)
            going = [e for e in live if e.ended is None]
            steps = list(pool.map(lambda e: e.env.step(e.reply), going))
            for e, s in zip(going, steps, strict=True):
                e.add_env_turn(s, limits)
            live = [e for e in going if e.ended is None]
            round_ += 1


Complete = Callable[[list[int], SamplingSpec], Completion]


def run_episodes_in_flight(
    complete: Complete,
    episodes: list[Episode],
    sampling: SamplingSpec,
    limits: Limits,
    version: Callable[[], int],
    *,
    threads: int = 64,
) -> None:
    """Run every episode to its end, each on its own: a turn is generated as soon as the episode's last tool
    answered (``complete`` over a streaming engine: ``engines.completer.StreamCompleter``), so a slow tool holds
    only its own episode while the engine generates the others' turns.  Up to ``threads`` episodes at once."""

    def one(k: int, e: Episode) -> None:
        turn = 0
        while e.ended is None:
            room = e.room(limits)
            if room < 1:
                e.ended = "context_limit"
                return
            seed = None if sampling.seed is None else sampling.seed + 1_000_003 * turn + k
            spec = replace(sampling, n=1, max_tokens=min(limits.max_turn_tokens, room), seed=seed)
            v = version()
            e.add_model_turn(complete(e.prompt_ids + e.response_ids, spec), limits, v)
            if e.ended is None:
                e.add_env_turn(e.env.step(e.reply), limits)
            turn += 1

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(episodes)))) as pool:
        for f in [pool.submit(one, k, e) for k, e in enumerate(episodes)]:
            f.result()


# ---------------------------------------------------------------------------------------------- shard rows


def _reward(e: Episode, finish: str, record: dict[str, Any]) -> float:
    """The environment's reward of the finished episode; 0 when it fails (the error goes into ``record``)."""
    try:
        reward = float(
            e.env.reward(e.reply, finish_reason=finish, messages=e.messages, response_ids=e.response_ids)
        )
        if not math.isfinite(reward):
            raise ValueError(f"reward {reward}")
    except Exception as err:
        reward = 0.0
        record["reward_error"] = f"{type(err).__name__}: {err}"[:500]
    return reward


def logprobs_ok(e: Episode) -> bool:
    return valid_logprobs(e.response_logprobs)


def group_rows(
    episodes: list[Episode], group_id: str, prompt: Prompt, *, epoch: int = 0
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Shard rows of one group (the episodes of one row), or (None, why) when its logprobs are unusable or its
    prompt left no room for a single turn.

    A reward function that raises or returns a non-finite value gives that episode a reward of 0, its error kept in
    the ``episode`` record: unlike a single-turn batch, an episode cannot be drawn again cheaply, and the group keeps
    its other samples.
    """
    if not all(any(t.model for t in e.turns) or e.closed for e in episodes):
        return (
            None,
            f"prompt {prompt.index}: {len(episodes[0].prompt_ids)} tokens leave no room for a response",
        )
    if not all(logprobs_ok(e) for e in episodes):
        return None, "a behaviour logprob is not a finite number <= 0"
    rows = [r for k, e in enumerate(episodes) for r in _rows(e, f"{group_id}.{k}", group_id, prompt, epoch)]
    return rows, None


def _rows(e: Episode, episode_id: str, group_id: str, prompt: Prompt, epoch: int) -> list[dict[str, Any]]:
    """The samples of one episode: one, or one per piece where the template broke the prefix (``_split``); the
    pieces share the episode's reward, and the trainer its advantage (their ``episode_id``)."""
    if not e.closed:
        return [_row(e, group_id, prompt, epoch)]
    pieces = [*e.closed, (e.prompt_ids, e.prompt_text, e.turns)]
    pieces = [p for p in pieces if any(t.model for t in p[2])]
    last = _row(e, group_id, prompt, epoch)  # the reward, of the episode's last reply
    rows = []
    for k, (ids, text, turns) in enumerate(pieces):
        piece = replace(e, prompt_ids=ids, prompt_text=text, turns=turns, closed=[])
        row = _row(piece, group_id, prompt, epoch, reward=last["reward"])
        if k < len(pieces) - 1:  # closed where the template broke, its turns ended as the model ended them
            row["finish_reason"] = "stop"
        record = json.loads(last["episode"]) | {"episode_id": episode_id, "split": k, "splits": len(pieces)}
        row["episode"] = json.dumps(record)
        rows.append(row)
    return rows


def _row(
    e: Episode, group_id: str, prompt: Prompt, epoch: int, *, reward: float | None = None
) -> dict[str, Any]:
    finish = "length" if e.truncated else "stop"
    record = e.record()
    if reward is None:
        reward = _reward(e, finish, record)
    token_versions = None
    if any(t.token_versions for t in e.turns):  # a weight update landed inside a turn: versions per token
        token_versions = [v for t in e.turns for v in (t.token_versions or [t.version] * len(t.ids))]
    turns = Turns.of(e.turns, e.loss_mask, record)
    return SampleRow(
        group_id=group_id,
        prompt_ids=e.prompt_ids,
        response_ids=e.response_ids,
        response_logprobs=e.response_logprobs,
        reward=reward,
        policy_version=turns.oldest,
        finish_reason=finish,
        prompt_text=e.prompt_text,
        response_text=e.renderer.decode(e.response_ids, special=True),
        answer=prompt.answer,
        extra={"prompt_index": prompt.index, "epoch": epoch},
        turns=turns,
        token_versions=token_versions,
    ).to_dict()
