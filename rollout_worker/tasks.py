"""The built-in demo tasks: their prompts, answers and how a response is scored.

``max_digit``: ``max(3,9)=`` -> ``9`` for all 100 ordered pairs of digits.  ``mod_add``: ``3+9=`` -> ``2``
((a+b) mod 10).  A response earns 1.0 when its first non-space character is the right digit, ``near_reward`` when
it is another digit (a shaping signal that teaches a randomly initialised model to emit digits at all), else 0.

``lookup``, a tool task: ``What is the value of code 4821?``, where the value is one digit that only the ``lookup``
tool knows (a keyed hash of the code; the key is not in any prompt), so the model must call
``<tool_call>{"name":"lookup","arguments":{"code":4821}}</tool_call>`` and answer with the digit the tool returns;
it is scored like the digit tasks.  The table has no entry for about one four-digit code in five (the tool answers
``unknown``, and the reply to give is ``none``); the prompts ask only for codes it holds.  Of those, the first
``LOOKUP_HELD_OUT`` of a fixed shuffle are set aside for the evaluator and never drawn in training, so that no score
can come from codes seen before.  The tool is a function of this module because each call imports its module in a
fresh child process: this one imports nothing of ours.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

TASKS = ("max_digit", "mod_add", "lookup")
TOOL_TASKS = {"lookup": "rollout_worker.tasks:lookup"}  # a tool task -> its tool (env.tools)
LOOKUP_HELD_OUT = 100
# Four digits without a leading zero: a code is a plain JSON number in the call.
LOOKUP_CODES = range(1000, 10000)
LOOKUP_UNKNOWN = "unknown"  # the tool's result for a code the table has no entry for
LOOKUP_NONE = "none"  # the reply to such a result
_LOOKUP_KEY = b"shardrl lookup table"
_UNKNOWN_EVERY = 5  # the table has no entry for about one code in five


@dataclass(frozen=True)
class TaskPrompt:
    prompt: str
    answer: str


def task_prompts(task: str, *, split: str = "train") -> list[TaskPrompt]:
    """The prompts of a built-in task; ``split="eval"``: the held-out ones (the digit tasks have no other)."""
    if task == "max_digit":
        return [TaskPrompt(f"max({a},{b})=", str(max(a, b))) for a in range(10) for b in range(10)]
    if task == "mod_add":
        return [TaskPrompt(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
    if task == "lookup":
        codes = lookup_codes(split)
        return [TaskPrompt(lookup_prompt(c), lookup(c)) for c in codes]
    raise ValueError(f"unknown task {task!r}; built-in tasks: {', '.join(TASKS)}")


def first_digit(response: str) -> str | None:
    s = response.lstrip()
    return s[0] if s and s[0].isdigit() else None


def digit_reward(response: str, answer: str, near_reward: float = 0.1) -> float:
    d = first_digit(response)
    if d is None:
        return 0.0
    return 1.0 if d == answer.strip() else near_reward


# ---------------------------------------------------------------------------------------------- lookup


def lookup(code: int) -> str:
    """The value stored under a code: one digit, or `unknown` when the table has no entry for it.

    Args:
        code: the four-digit code to look up
    """
    digest = hashlib.blake2b(str(code).encode(), key=_LOOKUP_KEY, digest_size=8).digest()
    h = int.from_bytes(digest, "little")
    return LOOKUP_UNKNOWN if h % _UNKNOWN_EVERY == 0 else str(h // _UNKNOWN_EVERY % 10)


def lookup_codes(split: str = "train") -> list[int]:
    """The codes the table holds, in a fixed shuffled order: ``eval`` the first ``LOOKUP_HELD_OUT``, ``train`` the
    rest."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}; splits: train, eval")
    codes = [c for c in LOOKUP_CODES if lookup(c) != LOOKUP_UNKNOWN]
    random.Random(0).shuffle(codes)
    return codes[:LOOKUP_HELD_OUT] if split == "eval" else codes[LOOKUP_HELD_OUT:]


def lookup_prompt(code: int) -> str:
    return f"What is the value of code {code}?"


def lookup_call(code: int) -> str:
    """The call a model that follows the format writes (compact JSON: the tiny tokenizer spends a token per
    character of it)."""
    return f'<tool_call>{{"name":"lookup","arguments":{{"code":{code}}}}}</tool_call>'


def lookup_reward(response: str, answer: str | None, *, extra: dict, sample: object) -> float:
    """The lookup task's reward (``reward.function = "rollout_worker.tasks:lookup_reward"``): the digit tasks'
    score of the episode's last reply against the tool's value, and 0 for an episode whose call returned nothing.

    Why the call must succeed: while the answers are still at chance, an episode with a broken call scores as much
    as one with a working call (a random digit either way), so nothing holds the call in place and it can drift.
    One run lost it that way at step 50 (every call an error from then on) and never recovered in 200 steps."""
    if answer is None:
        raise ValueError("the lookup task needs an answer for every prompt")
    return digit_reward(response, answer) if _looked_up(sample) else 0.0


def _looked_up(sample: object) -> bool:
    """Whether the episode holds a tool result that is not an error (``episode.py`` and ``sandbox.py`` write every
    failed call's message as ``error: ...``)."""
    messages = getattr(sample, "messages", None) or ()
    return any(
        m.get("role") == "tool" and not str(m.get("content", "")).startswith("error") for m in messages
    )
