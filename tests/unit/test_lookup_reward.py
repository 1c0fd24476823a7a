"""The lookup task's reward: the answer's digit score, and nothing for an episode whose call returned no result."""

from __future__ import annotations

from rollout_worker.rewards import Sample
from rollout_worker.tasks import lookup, lookup_codes, lookup_reward

CODE = lookup_codes("train")[0]
VALUE = lookup(CODE)
OTHER = str((int(VALUE) + 1) % 10)


def _episode(tool_content: str | None) -> Sample:
    messages = [{"role": "user", "content": f"What is the value of code {CODE}?"}]
    if tool_content is not None:
        messages.append({"role": "assistant", "content": "<tool_call>...</tool_call>"})
        messages.append({"role": "tool", "name": "lookup", "content": tool_content})
    return Sample("prompt", messages=tuple(messages))


def _score(reply: str, tool_content: str | None) -> float:
    return lookup_reward(reply, VALUE, extra={}, sample=_episode(tool_content))


def test_a_looked_up_answer_scores_as_a_digit_answer() -> None:
    assert _score(VALUE, VALUE) == 1.0
    assert _score(OTHER, VALUE) == 0.1
    assert _score("none", VALUE) == 0.0


def test_without_a_result_even_the_right_digit_scores_nothing() -> None:
    assert _score(VALUE, None) == 0.0  # no call
    assert _score(VALUE, "error: the call is not JSON") == 0.0  # a broken call
    assert _score(OTHER, "error: timed out after 5 s") == 0.0
