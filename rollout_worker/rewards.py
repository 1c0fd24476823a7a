r"""Reward functions by name, and the optional reward model, as the rollout worker scores samples.

``reward.function`` (required) is a registered name (``math_answer``, ``exact_match``, ``max_digit``, ``mod_add``) or
a user function ``package.module:function``.  A reward function has this signature::

    def my_reward(response: str, answer: str | None, *, extra: dict, sample: Sample) -> float

``answer`` is the row's ``data.answer_field`` (None when the row has none), ``extra`` the row's other fields, and
``sample`` (a ``Sample``) what else is known: the prompt as the model saw it, the chat messages, ``finish_reason``
(``stop`` or ``length``) and the response's token ids.  A function decorated with ``@batched`` (or carrying the
attribute ``shardrl_batched = True``, for code that does not import shardrl) is called once per batch of groups with
lists instead: ``fn(responses, answers, *, extras, samples) -> list[float]``.  The older form
``fn(prompt, response, answer) -> float`` still works: a function with neither ``extra`` nor ``sample`` parameters is
called that way.

``reward.truncated_reward``, when set, is the reward of every response cut off at ``max_response_length``
(``finish_reason == "length"``) instead of the function's.  A function that raises or returns something that is not a
finite number fails the whole group it scores (``RewardError``; a batched call fails its whole batch): the worker
drops the group and counts it, because dropping one sample of a GRPO group would shift the group's baseline.  An
unknown name is one ``RewardConfigError`` line, at ``shardrl init`` for registered names and at worker start for user
functions.

``scorepool.ScorePool`` runs the same per-group code (``group_items``, ``to_score``, ``score_items``, ``checked``) in
child processes, so that a slow, hanging or crashing function costs its samples, not the worker.

``reward.reward_model`` (a HF sequence-classification directory with one output) adds its score of prompt + response,
times ``reward.reward_model_weight``; it runs on the worker's device.  Only that class imports torch, when built, and
``math_answer`` imports math-verify (sympy) on its first call.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from buffer.config import ConfigError, RewardConfig

from .prompts import EncodedPrompt
from .tasks import digit_reward

# The older call form: (prompt, response, answer) -> reward.  ``resolve_reward`` returns one of these.
RewardFn = Callable[[str, str, str | None], float]
F = TypeVar("F", bound=Callable[..., Any])
BATCHED_ATTR = "shardrl_batched"


class RewardConfigError(ConfigError):
    """A user-caused reward configuration problem; the message is one line."""


class RewardError(RuntimeError):
    """Scoring a group failed: a function raised or returned a non-finite value."""


@dataclass(frozen=True)
class Sample:
    """What a reward function knows about one response besides its text, its answer and its row's extra fields."""

    prompt: str  # the prompt as the model saw it (template and chat template applied)
    finish_reason: str = "stop"  # "stop" (EOS or a stop string) or "length" (cut off at max_response_length)
    prompt_index: int = 0  # the prompt's row in the source
    messages: tuple[Mapping[str, str], ...] | None = None  # the conversation, for chat-rendered prompts
    response_ids: Sequence[int] = field(default_factory=tuple)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class Response(Protocol):
    """What scoring reads of a completion (rollout_worker.engines.base.Completion has it)."""

    response_text: str
    finish_reason: str
    response_ids: list[int]


def batched(fn: F) -> F:
    """Mark ``fn`` as batched: called once per batch with lists (responses, answers, extras=, samples=)."""
    setattr(fn, BATCHED_ATTR, True)
    return fn


# ---------------------------------------------------------------------------------------------- math answers


def _gold_text(answer: str) -> str:
    """The final answer inside a reference that may be a worked solution (GSM8K's ``... #### 72``)."""
    return answer.rsplit("####", 1)[-1].strip()


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple[Any, ...]:
    """A reference answer parsed by math-verify; cached because the n samples of a group share one."""
    from math_verify import LatexExtractionConfig, parse

    ref = _gold_text(answer)
    # A bare reference is a whole expression: boxing it keeps math-verify from picking the last number out of
    # `x^{2} + 1`; a reference that has its own box is parsed as written.
    text = ref if "\\boxed" in ref or "\\fbox" in ref else f"\\boxed{{{ref}}}"
    return tuple(parse(text, [LatexExtractionConfig()], parsing_timeout=_timeout()))


def _parse_response(response: str, truncated: bool) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if truncated:
        # A response cut off mid-thought has no last number worth trusting: only a closed \boxed{} or an
        # explicit "final answer is ..." counts.
        targets: list[Any] = [
            LatexExtractionConfig(try_extract_without_anchor=False),
            ExprExtractionConfig(try_extract_without_anchor=False),
        ]
    else:
        targets = [LatexExtractionConfig(), ExprExtractionConfig()]
    return list(parse(response, targets, parsing_timeout=_timeout()))


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread may use; elsewhere it runs without a limit
    return 5 if threading.current_thread() is threading.main_thread() else None


def _normalize(s: str) -> str:
    return re.sub(r"\s+", "", s.strip().strip("$")).rstrip(".")


def math_answer(response: str, answer: str | None, *, extra: Mapping[str, Any], sample: Sample) -> float:
    r"""1.0 when the response's final answer is mathematically equal to ``answer`` (math-verify), else 0.0.

    The response's answer is its last ``\boxed{}``, else an explicit "the final answer is", else its last number or
    expression; a response cut off at the length limit gets no last-number fallback.  ``answer`` may be a worked
    solution (GSM8K's ``... #### 72``, or one ending in ``\boxed{}``); its final answer is used.
    """
    if answer is None:
        raise ValueError("math_answer needs an answer for every prompt (data.answer_field)")
    from math_verify import verify

    got = _parse_response(response, sample.truncated)
    if not got:
        return 0.0
    gold = _parse_gold(answer)
    if not gold:  # not mathematics math-verify can read: compare the texts
        return 1.0 if _normalize(str(got[-1])) == _normalize(_gold_text(answer)) else 0.0
    return 1.0 if verify(list(gold), got, timeout_seconds=_timeout()) else 0.0


def exact_match(response: str, answer: str | None, *, extra: Mapping[str, Any], sample: Sample) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace, else 0.0."""
    if answer is None:
        raise ValueError("exact_match needs an answer for every prompt (data.answer_field)")
    return 1.0 if response.strip() == answer.strip() else 0.0


def digit_task(response: str, answer: str | None, *, extra: Mapping[str, Any], sample: Sample) -> float:
    """The demo tasks (max_digit, mod_add): the first non-space character is the right digit."""
    if answer is None:
        raise ValueError("the digit tasks need an answer for every prompt")
    return digit_reward(response, answer)


# ---------------------------------------------------------------------------------------------- resolving

Form = Literal["sample", "batched", "legacy"]


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward function and the form it is called in; callable in the older form for old callers."""

    name: str
    fn: Callable[..., Any]
    form: Form

    def __call__(self, prompt: str, response: str, answer: str | None) -> float:
        return self.call([response], [answer], [{}], [Sample(prompt)])[0]  # type: ignore[no-any-return]

    def call(
        self,
        responses: list[str],
        answers: list[str | None],
        extras: list[dict[str, Any]],
        samples: list[Sample],
    ) -> list[Any]:
        """Raw values for a list of responses, one call per response unless the function is batched."""
        if self.form == "batched":
            out = self.fn(responses, answers, extras=extras, samples=samples)
            if not isinstance(out, Sequence) or len(out) != len(responses):
                raise TypeError(
                    f"a batched reward function must return {len(responses)} values, got {out!r:.60}"
                )
            return list(out)
        if self.form == "legacy":
            return [self.fn(s.prompt, r, a) for r, a, s in zip(responses, answers, samples, strict=True)]
        return [
            self.fn(r, a, extra=e, sample=s)
            for r, a, e, s in zip(responses, answers, extras, samples, strict=True)
        ]


def _form(fn: Callable[..., Any]) -> Form:
    if getattr(fn, BATCHED_ATTR, False):
        return "batched"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "legacy"
    return "sample" if "sample" in params or "extra" in params else "legacy"


_DIGITS = RewardFunction("max_digit", digit_task, "sample")
REGISTRY: dict[str, RewardFunction] = {
    "math_answer": RewardFunction("math_answer", math_answer, "sample"),
    "exact_match": RewardFunction("exact_match", exact_match, "sample"),
    "max_digit": _DIGITS,
    "mod_add": _DIGITS,
}


def needs_answers(name: str) -> bool:
    """Registered functions cannot score a prompt without an answer; user functions decide for themselves."""
    return name in REGISTRY


def _accepted() -> str:
    return f"accepted: {', '.join(REGISTRY)}, or a user function `package.module:function`"


def check_reward_name(name: str) -> None:
    """A one-line RewardConfigError for a name that is neither registered nor ``module:function`` (no import)."""
    if name not in REGISTRY and ":" not in name:
        raise RewardConfigError(
            f"config: field reward.function: {name!r} is not a known reward; {_accepted()}"
        )


def resolve_reward(name: str) -> RewardFunction:
    """The function named by ``reward.function``, or a one-line RewardConfigError.

    The result is also callable in the older form ``(prompt, response, answer) -> float``.
    """
    if name in REGISTRY:
        return REGISTRY[name]
    check_reward_name(name)
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardConfigError(
            f"config: field reward.function: cannot import {module_name!r} ({type(e).__name__}: {e}); {_accepted()}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardConfigError(
            f"config: field reward.function: {module_name!r} has no function {attr!r}; {_accepted()}"
        )
    return RewardFunction(name, fn, _form(fn))


def _raised(e: Exception) -> str:
    # the line goes into the worker's status record and log: an exception's own newlines must not split it
    return " ".join(f"reward function raised {type(e).__name__}: {e}".split())


def _finite(value: Any, response: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError) as e:
        raise RewardError(_raised(e)) from e
    if not math.isfinite(x):
        raise RewardError(f"reward function returned {x} for {response!r:.60}")
    return x


def score_group(fn: RewardFn, prompt: str, responses: list[str], answer: str | None) -> list[float]:
    """Rewards of one group in the older form (no extra fields, every response taken as finished).

    RewardError when any of them fails.  ``Scorer.score_batch`` is the full form.
    """
    out = []
    for response in responses:
        try:
            value = fn(prompt, response, answer)
        except Exception as e:
            raise RewardError(_raised(e)) from e
        out.append(_finite(value, response))
    return out


# ---------------------------------------------------------------------------------------------- the scorer


@dataclass(frozen=True)
class GroupRewards:
    """The rewards of one group, or why the group failed (then ``rewards`` is None).

    ``timed_out`` and ``note`` are set by ``scorepool.ScorePool`` only: how many samples were scored 0.0 because the
    reward function ran past its time limit or its process died, and one line about the first of them.
    """

    rewards: list[float] | None
    error: str | None = None
    timed_out: int = 0
    note: str | None = None


@dataclass(frozen=True)
class ScoreItem:
    """One response as the reward function is given it; picklable, so the score pool sends it to its children."""

    response: str
    answer: str | None
    extra: Mapping[str, Any]
    sample: Sample


class Scorer:
    """``reward.function`` with ``reward.truncated_reward`` applied: what the worker scores a batch with."""

    def __init__(self, cfg: RewardConfig):
        self.function = resolve_reward(cfg.function)
        self.truncated_reward = cfg.truncated_reward

    def score_batch(
        self, prompts: Sequence[EncodedPrompt], outputs: Sequence[Sequence[Response]]
    ) -> list[GroupRewards]:
        """One ``GroupRewards`` per prompt (its group of responses), in order.

        A failure fails its group; a batched function is called once for the whole batch, so its failure fails
        every group of the batch.
        """
        groups = [group_items(p, outs) for p, outs in zip(prompts, outputs, strict=True)]
        if self.function.form != "batched":
            return [self._scored(g) for g in groups]
        flat = [item for g in groups for item in g]
        try:
            values = self._values(flat)
        except RewardError as e:
            return [GroupRewards(None, str(e)) for _ in groups]
        out, k = [], 0
        for g in groups:
            out.append(checked(g, values[k : k + len(g)]))
            k += len(g)
        return out

    def _scored(self, group: list[ScoreItem]) -> GroupRewards:
        try:
            return checked(group, self._values(group))
        except RewardError as e:
            return GroupRewards(None, str(e))

    def _values(self, items: list[ScoreItem]) -> list[Any]:
        """Raw values: ``truncated_reward`` for cut-off responses when it is set, the function's for the rest."""
        values: list[Any] = [self.truncated_reward] * len(items)
        scored = to_score(items, self.truncated_reward)
        if not scored:
            return values
        got = call_function(self.function, [items[i] for i in scored])
        for i, v in zip(scored, got, strict=True):
            values[i] = v
        return values


def group_items(p: EncodedPrompt, outs: Sequence[Response]) -> list[ScoreItem]:
    """What the reward function is given of each response of one group."""
    q = p.prompt
    return [
        ScoreItem(
            o.response_text,
            q.answer,
            q.extra,
            Sample(p.text or q.text, o.finish_reason, q.index, q.messages, tuple(o.response_ids)),
        )
        for o in outs
    ]


def to_score(items: Sequence[ScoreItem], truncated_reward: float | None) -> list[int]:
    """Indices of the items the function scores: all, or those not cut off when ``truncated_reward`` is set."""
    return [i for i, it in enumerate(items) if truncated_reward is None or not it.sample.truncated]


def call_function(function: RewardFunction, items: Sequence[ScoreItem]) -> list[Any]:
    """The function's raw values of ``items``; RewardError when it raises."""
    try:
        return function.call(
            [it.response for it in items],
            [it.answer for it in items],
            [dict(it.extra) for it in items],
            [it.sample for it in items],
        )
    except Exception as e:
        raise RewardError(_raised(e)) from e


def score_items(function: RewardFunction, items: Sequence[ScoreItem]) -> GroupRewards:
    """The function's rewards of every one of ``items`` (no ``truncated_reward``); one failure fails them all."""
    try:
        return checked(items, call_function(function, items))
    except RewardError as e:
        return GroupRewards(None, str(e))


def checked(items: Sequence[ScoreItem], values: Sequence[Any]) -> GroupRewards:
    """The values as finite floats, or the group failed by the first that is not one."""
    try:
        return GroupRewards([_finite(v, it.response) for it, v in zip(items, values, strict=True)])
    except RewardError as e:
        return GroupRewards(None, str(e))


def make_scorer(cfg: RewardConfig) -> Scorer:
    """The worker's scorer; a one-line RewardConfigError when the function cannot be resolved."""
    return Scorer(cfg)


# ---------------------------------------------------------------------------------------------- reward model


class RewardModel:
    """A HF sequence-classification model (one output) that scores prompt + response texts."""

    def __init__(self, path: str | Path, *, device: str | None = None, batch_size: int = 32):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise RewardConfigError(
                f"{path}: reward.reward_model is not a HF model directory (no config.json)"
            )
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise RewardConfigError(
                f"{path}: reward.reward_model must have one output (num_labels = 1), it has "
                f"{self.model.config.num_labels}"
            )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        import torch

        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        out: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc: Any = self.tokenizer(
                    texts[i : i + self.batch_size], return_tensors="pt", padding=True, truncation=True
                ).to(self.device)
                out.extend(self.model(**enc).logits[:, 0].float().tolist())
        return out
