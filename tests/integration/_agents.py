"""Agents the endpoint tests run: plain OpenAI-SDK programs of the shape ``fn(base_url, row) -> str | None``,
written as a user would write them, with nothing of shardrl in them."""

from __future__ import annotations

import json
import time
from typing import Any

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)


def add(a: int, b: int) -> int:
    return a + b


def calculator(base_url: str, row: dict[str, Any]) -> str | None:
    """Asks the model, runs every ``add`` call it makes and sends the results back, until it answers without one.

    The SDK's reply objects go back into the history as they are (the SDK serialises them)."""
    client = _client(base_url)
    messages: list[Any] = list(row["messages"])
    for _ in range(4):
        reply = client.chat.completions.create(
            model="anything", messages=messages, tools=[ADD], max_tokens=96
        )
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            result = add(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return None


def streaming_calculator(base_url: str, row: dict[str, Any]) -> str | None:
    """``calculator`` over ``stream=True``, with the history kept as plain dicts."""
    client = _client(base_url)
    messages: list[dict[str, Any]] = list(row["messages"])
    for _ in range(4):
        content, calls = "", {}
        for chunk in client.chat.completions.create(
            model="anything", messages=messages, tools=[ADD], max_tokens=96, stream=True
        ):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                calls[tc.index] = {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        messages.append(message)
        if not calls:
            return content
        for c in message["tool_calls"]:
            result = add(**json.loads(c["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": str(result)})
    return None


def follow_up(base_url: str, row: dict[str, Any]) -> str | None:
    """Two calls: the question, then "Are you sure?" on the model's answer; the last reply is the answer (None)."""
    client = _client(base_url)
    messages: list[dict[str, Any]] = list(row["messages"])
    for turn in range(2):
        reply = client.chat.completions.create(model="anything", messages=messages, max_tokens=32)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if turn == 0:
            messages.append({"role": "user", "content": "Are you sure?"})
    return None


def restarting(base_url: str, row: dict[str, Any]) -> str | None:
    """Asks once, then again with the history replaced by a summary of it: the second call continues nothing."""
    client = _client(base_url)
    messages: list[dict[str, Any]] = list(row["messages"])
    first = client.chat.completions.create(model="anything", messages=messages, max_tokens=16)
    summary = f"Earlier you said: {first.choices[0].message.content}. Say it again."
    again = client.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": summary}], max_tokens=16
    )
    return again.choices[0].message.content


def by_mode(base_url: str, row: dict[str, Any]) -> str | None:
    """The behaviour the row's ``extra.mode`` names: ``calculator``, ``raise`` (after one call), ``sleep`` (past
    any short time limit, after one call), ``number`` (returns an int), ``silent`` (returns without a call)."""
    mode = row["extra"].get("mode", "calculator")
    if mode == "silent":
        return "nothing asked"
    if mode == "calculator":
        return calculator(base_url, row)
    client = _client(base_url)
    client.chat.completions.create(model="anything", messages=row["messages"], max_tokens=16)
    if mode == "raise":
        raise RuntimeError("the agent broke")
    if mode == "sleep":
        time.sleep(10)
    return 5  # type: ignore[return-value]  # mode "number": not the text an agent must return


def broken(base_url: str, row: dict[str, Any]) -> str | None:
    """An agent with a bug: it raises before it calls the model, in every episode."""
    raise KeyError("the agent looked up row['question'], a key its rows do not have")
