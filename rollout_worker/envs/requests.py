"""The OpenAI Chat Completions request, as the endpoint (``endpoint.py``) accepts it: parsed and checked field by
field, every refusal a one-line ``RequestError`` naming the field and what is accepted."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from .tools import Tool

Message = dict[str, Any]
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def bad_request(message: str, code: str | None = None) -> RequestError:
    return RequestError(400, message, code)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[Message]  # normalised: text content, tool-call arguments as objects
    tools: list[Tool]
    model: str = ""
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    logprobs: bool = False  # each completion token's logprob in the reply (``top_logprobs`` are not served)


def parse_request(body: bytes) -> ChatRequest:
    """A chat-completions request body, or a RequestError (400) naming the first bad field."""
    try:
        obj = json.loads(body or b"null")
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object with a 'messages' field")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("field 'messages' must be a non-empty list of messages")
    if obj.get("n") not in (None, 1):
        raise bad_request(f"field 'n' is {obj['n']!r}; only n = 1 is served (one completion per call)")
    top = obj.get("top_logprobs")
    if top not in (None, 0):
        raise bad_request(
            f"field 'top_logprobs' is {top!r}; only 0 is served (the engine returns the sampled token's logprob)"
        )
    options = obj.get("stream_options")
    return ChatRequest(
        messages=[normalise_message(f"messages[{i}]", m) for i, m in enumerate(messages)],
        tools=_tools(obj.get("tools")),
        model=str(obj.get("model") or ""),
        max_tokens=_positive(obj, "max_completion_tokens") or _positive(obj, "max_tokens"),
        stop=_stop(obj.get("stop")),
        stream=_flag(obj, "stream"),
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        temperature=_number(obj, "temperature", 0.0, 2.0),
        top_p=_number(obj, "top_p", 0.0, 1.0),
        top_k=_integer(obj, "top_k"),
        seed=_integer(obj, "seed"),
        logprobs=_flag(obj, "logprobs"),
    )


def normalise_message(at: str, m: Any) -> Message:
    """A message as the chat template takes it: text content (never None), tool-call arguments as objects."""
    if not isinstance(m, dict):
        raise bad_request(f"{at} must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"{at}.role is {role!r}; accepted: {', '.join(ROLES)}")
    out: Message = {"role": "system" if role == "developer" else role, "content": _text(at, m.get("content"))}
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    calls = m.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise bad_request(f"{at}.tool_calls must be a list of tool calls")
        out["tool_calls"] = [_tool_call(f"{at}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return out


def _text(at: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise bad_request(
        f"{at}.content must be text or a list of text parts (type 'text'); other parts are not served"
    )


def _tool_call(at: str, c: Any) -> Message:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            f'{at} must be {{"type": "function", "function": {{"name": str, "arguments": str}}}}'
        )
    args = fn.get("arguments", {})
    if isinstance(args, str):  # the API carries arguments as JSON text; templates render them as an object
        with contextlib.suppress(ValueError):  # not JSON: the template shows what the agent wrote
            args = json.loads(args) if args.strip() else {}
    return {
        "id": str(c.get("id", "")),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def _tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("field 'tools' must be a list of function tools")
    tools = []
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}'
            )
        if not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}].function.name must be a string")
        tools.append(Tool(fn["name"], "", {"type": "function", "function": fn}))
    return tools


def _positive(obj: dict[str, Any], key: str) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise bad_request(f"field {key!r} is {v!r}; expected an integer >= 1")
    return v


def _integer(obj: dict[str, Any], key: str) -> int | None:
    v = obj.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise bad_request(f"field {key!r} is {v!r}; expected an integer")
    return v


def _number(obj: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad_request(f"field {key!r} is {v!r}; expected a number from {lo} to {hi}")
    return float(v)


def _flag(obj: dict[str, Any], key: str) -> bool:
    v = obj.get(key, False)
    if not isinstance(v, bool) and v is not None:
        raise bad_request(f"field {key!r} is {v!r}; expected true or false")
    return bool(v)


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise bad_request(f"field 'stop' is {v!r:.60}; expected a string or a list of strings")
