"""Tools: resolving the functions ``env.tools`` names, describing them to the chat template, and reading the model's
tool calls back out of its text.

A tool is a plain Python function ``package.module:function`` whose keyword arguments are JSON values and whose
result is text (anything else is ``json.dumps``-ed, or ``str``-ed).  The worker imports it only to describe it (name,
first docstring line, parameters from the signature and an ``Args:`` docstring section) as the JSON schema chat
templates take in ``tools=``; calls run in a child process (``sandbox.ToolRunner``).

Tool calls are read in Qwen2.5's (and Hermes') format, which its template teaches the model:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn.  Every way a call can be wrong
(bad JSON, no name, arguments that are not an object, a tag never closed) is a ``ToolCall`` with ``error`` set, which
the environment answers as a tool error message: the model's mistakes are part of what it learns from, never a
crash.  This module imports nothing heavy.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from buffer.config import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolConfigError(ConfigError):
    """A tool that ``env.tools`` names cannot be used; the message is one line."""


@dataclass(frozen=True)
class Tool:
    name: str  # what the model calls it: the function's own name
    target: str  # ``package.module:function``, what the child process imports
    schema: dict[str, Any]  # the OpenAI-style function description chat templates render


@dataclass(frozen=True)
class ToolCall:
    """One call read from an assistant turn; ``error`` says why it cannot be made (then name/arguments may be empty)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def resolve_tools(targets: list[str]) -> list[Tool]:
    """The tools ``env.tools`` names, or a one-line ToolConfigError naming the first that cannot be imported."""
    tools = [_resolve(t) for t in targets]
    names = [t.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolConfigError(
            f"config: field env.tools: two tools are called {dupes[0]!r}; the model could not tell them apart"
        )
    return tools


def _resolve(target: str) -> Tool:
    module_name, _, attr = target.partition(":")
    at = f"config: field env.tools: {target!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ToolConfigError(f"{at}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ToolConfigError(f"{at}: {module_name!r} has no function {attr!r}")
    return Tool(attr, target, function_schema(attr, fn))


def function_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """``{"type": "function", "function": {name, description, parameters}}`` from ``fn``'s signature and docstring."""
    doc = inspect.getdoc(fn) or ""
    described = _arg_docs(doc)
    props: dict[str, Any] = {}
    required = []
    for p in _signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop: dict[str, Any] = {}
        kind = _JSON_TYPES.get(_origin(p.annotation))
        if kind is not None:
            prop["type"] = kind
        if p.name in described:
            prop["description"] = described[p.name]
        props[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc.split("\n\n", 1)[0].replace("\n", " "),
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    try:  # postponed annotations (``from __future__ import annotations``) are strings until evaluated
        return inspect.signature(fn, eval_str=True)
    except Exception:
        return inspect.signature(fn)


def _origin(annotation: Any) -> Any:
    return getattr(annotation, "__origin__", annotation)  # list[int] -> list


def _arg_docs(doc: str) -> dict[str, str]:
    """``name: text`` lines of a Google-style ``Args:`` section."""
    out: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if m:
                out[m.group(1)] = m.group(2).strip()
            elif line.strip() and not line.startswith((" ", "\t")):
                in_args = False
    return out


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of an assistant turn, in order; an unclosed one is an error call."""
    calls = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            calls.append(ToolCall(error=f"{OPEN} without {CLOSE}"))
            break
        calls.append(_call(text[start + len(OPEN) : end].strip()))
        pos = end + len(CLOSE)
    return calls


def _call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolCall(error=f"tool call is not valid JSON ({e}): {body[:200]!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(
            error=f'tool call must be a JSON object {{"name": str, "arguments": object}}, got {body[:200]!r}'
        )
    args = obj.get("arguments", {})
    if isinstance(
        args, str
    ):  # some models write the arguments as a JSON string, as the OpenAI API carries them
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            return ToolCall(obj["name"], error=f"tool call arguments are not valid JSON ({e})")
    if not isinstance(args, dict):
        return ToolCall(
            obj["name"], error=f"tool call arguments must be a JSON object, got {type(args).__name__}"
        )
    return ToolCall(obj["name"], args)
