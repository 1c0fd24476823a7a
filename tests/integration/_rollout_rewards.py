"""User reward functions (``reward.function = "tests.integration._rollout_rewards:NAME"``) for the rollout tests."""

from __future__ import annotations

import os
import sys
import time

from rollout_worker.tasks import digit_reward


def flaky(prompt: str, response: str, answer: str | None) -> float:
    """The max-digit reward, except that it raises for prompts whose answer is 7 (their groups must be dropped)."""
    if answer == "7":
        raise ValueError(f"no reward for {prompt!r}")
    return digit_reward(response, answer or "")


def exit_hard(prompt: str, response: str, answer: str | None) -> float:
    """Kills the worker process outright, as a crashing engine would."""
    print("engine exploded: simulated crash", file=sys.stderr, flush=True)
    os._exit(3)


def sleepy(prompt: str, response: str, answer: str | None) -> float:
    """Busy far longer than any drain deadline."""
    print("sleepy reward: scoring slowly", file=sys.stderr, flush=True)
    time.sleep(120)
    return 0.0


def hangs_on_seven(prompt: str, response: str, answer: str | None) -> float:
    """The max-digit reward, except that it never returns for prompts whose answer is 7 (a hung verifier)."""
    if answer == "7":
        time.sleep(3600)
    return digit_reward(response, answer or "")


def dies_on_eight(prompt: str, response: str, answer: str | None) -> float:
    """The max-digit reward, except that it kills its process for prompts whose answer is 8 (a crashing one)."""
    if answer == "8":
        os._exit(9)
    return digit_reward(response, answer or "")


def hangs_on_seven_dies_on_eight(prompt: str, response: str, answer: str | None) -> float:
    """``hangs_on_seven`` and ``dies_on_eight`` in one: both kinds of loss in one worker's run."""
    if answer == "7":
        time.sleep(3600)
    if answer == "8":
        os._exit(9)
    return digit_reward(response, answer or "")
