"""The built-in demo tasks: their prompts, answers and how a response is scored.

``max_digit``: ``max(3,9)=`` -> ``9`` for all 100 ordered pairs of digits.  ``mod_add``: ``3+9=`` -> ``2``
((a+b) mod 10).  A response earns 1.0 when its first non-space character is the right digit, ``near_reward`` when
it is another digit (a shaping signal that teaches a randomly initialised model to emit digits at all), else 0.
"""

from __future__ import annotations

from dataclasses import dataclass

TASKS = ("max_digit", "mod_add")


@dataclass(frozen=True)
class TaskPrompt:
    prompt: str
    answer: str


def task_prompts(task: str) -> list[TaskPrompt]:
    if task == "max_digit":
        return [TaskPrompt(f"max({a},{b})=", str(max(a, b))) for a in range(10) for b in range(10)]
    if task == "mod_add":
        return [TaskPrompt(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
    raise ValueError(f"unknown task {task!r}; built-in tasks: {', '.join(TASKS)}")


def first_digit(response: str) -> str | None:
    s = response.lstrip()
    return s[0] if s and s[0].isdigit() else None


def digit_reward(response: str, answer: str, near_reward: float = 0.1) -> float:
    d = first_digit(response)
    if d is None:
        return 0.0
    return 1.0 if d == answer.strip() else near_reward
