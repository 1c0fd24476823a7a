"""rollout_worker/envs tools and sandbox: the tool-call parser, tool descriptions, the config's refusal of a tool that
does not exist, and every way a tool call can fail turning into an error result instead of a crash."""

from __future__ import annotations

import time

import pytest

from buffer.config import ShardRLConfig
from rollout_worker.envs import check_tools
from rollout_worker.envs.sandbox import ToolRunner, cut
from rollout_worker.envs.tools import ToolCall, ToolConfigError, parse_tool_calls, resolve_tools

from .envs_helpers import TOOLS

pytestmark = pytest.mark.proc  # the tools run in sandbox processes


def test_parser_reads_every_call_in_order() -> None:
    text = (
        'Let me look. <tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call> and '
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    )
    assert parse_tool_calls(text) == [ToolCall("lookup", {"key": "alpha"}), ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("The answer is 7.") == []
    assert parse_tool_calls('<tool_call>{"name": "add"}</tool_call>') == [ToolCall("add", {})]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "arguments must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "arguments are not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": {}}', "without </tool_call>"),
    ],
)
def test_parser_turns_malformed_calls_into_errors(text: str, why: str) -> None:
    (call,) = parse_tool_calls(text)
    assert call.error is not None and why in call.error


def test_tool_schema_comes_from_the_signature_and_docstring() -> None:
    lookup, add = resolve_tools([f"{TOOLS}:lookup", f"{TOOLS}:add"])
    assert lookup.schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The value stored under a key.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "description": "which entry to read"}},
                "required": ["key"],
            },
        },
    }
    assert add.schema["function"]["parameters"]["required"] == ["a"]
    assert add.target == f"{TOOLS}:add"


def _cfg(tools: list[str]) -> ShardRLConfig:
    return ShardRLConfig.model_validate({"reward": {"function": "exact_match"}, "env": {"tools": tools}})


@pytest.mark.parametrize(
    ("target", "said"),
    [(f"{TOOLS}:nope", "has no function 'nope'"), ("no_such_pkg.mod:f", "cannot import 'no_such_pkg.mod'")],
)
def test_a_config_naming_a_missing_tool_is_refused_in_one_line(target: str, said: str) -> None:
    with pytest.raises(ToolConfigError) as e:
        check_tools(_cfg([target]))
    msg = str(e.value)
    assert "\n" not in msg and "env.tools" in msg and said in msg


def test_tool_names_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ValueError, match=r"package\.module:function"):
        _cfg(["just_a_name"])
    with pytest.raises(ValueError, match="must not exceed"):
        ShardRLConfig.model_validate(
            {
                "reward": {"function": "exact_match"},
                "env": {"max_turn_tokens": 99},
                "rollout": {"sampling": {"max_response_length": 50}},
            }
        )


def test_a_tool_result_comes_back() -> None:
    r = ToolRunner(timeout_s=20).run(f"{TOOLS}:add", {"a": 2, "b": 5})
    assert (r.content, r.error, r.timed_out) == ("7", None, False)


def test_sandbox_failures_become_error_results() -> None:
    """A hang (killed at its limit), a raise, megabytes of output (capped), memory past the limit, an interpreter
    that dies and bad arguments each give an error result, and the runner stays usable."""
    runner = ToolRunner(timeout_s=1.0, memory_mb=256, max_chars=100)
    t0 = time.monotonic()
    hang = runner.run(f"{TOOLS}:hang", {})
    assert hang.timed_out and hang.error and "timed out after 1 s" in hang.content
    assert time.monotonic() - t0 < 5
    boom = runner.run(f"{TOOLS}:boom", {})
    assert boom.content == "error: ValueError: the tool failed on purpose"
    flood = runner.run(f"{TOOLS}:flood", {})
    assert flood.error is None and flood.truncated and flood.content.startswith("r" * 100)
    assert len(flood.content) < 200 and "4999900 more characters cut" in flood.content
    assert "out of memory" in (runner.run(f"{TOOLS}:hog", {}).error or "")
    assert "exited with status 7" in (runner.run(f"{TOOLS}:vanish", {}).error or "")
    bad_args = runner.run(f"{TOOLS}:add", {"c": 1})
    assert bad_args.error is not None and "TypeError" in bad_args.content
    assert runner.run(f"{TOOLS}:add", {"a": 1}).content == "1"


def test_cut_says_how_much_it_cut() -> None:
    assert cut("abc", 5) == ("abc", False)
    assert cut("abcdefgh", 3) == ("abc\n[... 5 more characters cut]", True)
