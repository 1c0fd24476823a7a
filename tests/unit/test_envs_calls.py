"""Agent episodes through the OpenAI-compatible endpoint, with a scripted engine: calls that extend one another
merge into one sample and the rest split, the mask's zero spans are exactly the environment's ids, decoding gives
the rendered conversation, the engine's ids are kept as it produced them (never re-tokenised), the rows pass the
shard validation, the endpoint answers errors in one line, and an agent that fails scores 0 without stopping
anything.

The script stands in for the engine: the tiny random model never writes a tool call, and these tests need exact
replies (a tool call, a reasoning block, ids the tokenizer would not produce)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from buffer import shards
from buffer.config import ShardRLConfig
from rollout_worker.engines.base import Completion, SamplingSpec
from rollout_worker.envs import episode_stats
from rollout_worker.envs.agent import AgentTask
from rollout_worker.envs.calls import Call, Split, split_calls, split_rows
from rollout_worker.envs.endpoint import ChatEndpoint, EpisodeLog
from rollout_worker.envs.episode import ENV_VERSION, ChatRenderer, Limits
from rollout_worker.envs.tools import Tool
from rollout_worker.prompts import EncodedPrompt, Prompt

from ..integration import _agents

openai = pytest.importorskip("openai")

# Qwen2.5's layout, tool names only: tool calls as <tool_call> blocks after the content, consecutive tool results in
# one user turn of <tool_response> blocks.
TEMPLATE = r"""
{%- if tools %}{{ '<|im_start|>system\nTools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}{% endfor %}
{{- '<|im_end|>\n' }}{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
{%- elif m['role'] == 'assistant' and m['tool_calls'] %}{{ '<|im_start|>assistant' }}
{%- if m['content'] %}{{ '\n' + m['content'] }}{% endif %}
{%- for c in m['tool_calls'] %}
{{- '\n<tool_call>\n{"name": "' + c['function']['name'] + '", "arguments": ' }}
{{- c['function']['arguments'] | tojson + '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}
{%- else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""
# A reasoning template in Qwen3's manner: an assistant turn before the last user turn loses its <think> block, so a
# follow-up question rewrites the turn the model wrote.
THINK_TEMPLATE = r"""
{%- set ns = namespace(last=-1) %}
{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}{% set text = m['content'] %}
{%- if m['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in text %}
{%- set text = text.split('</think>')[-1].lstrip() %}{% endif %}
{{- '<|im_start|>' + m['role'] + '\n' + text + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""
ADD_TOOL = [Tool("add", "", _agents.ADD)]
TOOL_REPLY = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_untied: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_untied)


@dataclass
class Script:
    """``complete`` for the endpoint: the k-th assistant turn of a conversation is ``replies[k]``, as the
    tokenizer's ids (or one id per character with ``chars``: ids the tokenizer would never produce) and ``end``."""

    tokenizer: Any
    replies: list[str]
    end: str = "<|im_end|>"
    chars: bool = False
    outputs: list[list[int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, prompt_ids: list[int], spec: SamplingSpec) -> Completion:
        turn = self.tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        text = self.replies[min(turn, len(self.replies) - 1)]
        ids = self.encode(text)
        if self.chars:
            ids = [i for t in ids for i in self._pieces(t)]
        ids = [*ids, self.tokenizer.convert_tokens_to_ids(self.end)]
        finish = "stop"
        if len(ids) > spec.max_tokens:
            ids, finish = ids[: spec.max_tokens], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        with self.lock:
            self.outputs.append(ids)
        return Completion(
            list(prompt_ids), ids, [-0.25 - 0.01 * (i % 7) for i in range(len(ids))], finish, text
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _pieces(self, token: int) -> list[int]:
        """A token as its one-byte tokens, where the vocabulary has them."""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        ids = self.tokenizer.convert_tokens_to_ids(list(piece))
        return [token] if len(piece) == 1 or None in ids or self.tokenizer.unk_token_id in ids else list(ids)


def _run(
    endpoint: ChatEndpoint, complete: Any, agent: Any, *, limits: Limits | None = None
) -> tuple[str | None, EpisodeLog]:
    eid = endpoint.open(complete, version=lambda: 3, sampling=SamplingSpec(max_tokens=96), limits=limits)
    answer = agent(endpoint.base_url(eid), {"messages": [dict(m) for m in QUESTION]})
    return answer, endpoint.close(eid)


def _assert_faithful(split: Split, calls: list[Call]) -> None:
    """Each call's prompt is the sample up to its turn, its completion is that model turn unchanged, and the mask
    is 0 on exactly the ids between them."""
    so_far, turns = list(split.prompt_ids), list(split.turns)
    for k in split.calls:
        c = calls[k]
        if len(c.prompt_ids) > len(so_far):
            env = turns.pop(0)
            assert env.version == ENV_VERSION and env.logprobs == [0.0] * len(env.ids)
            assert so_far + env.ids == c.prompt_ids
            so_far += env.ids
        assert so_far == c.prompt_ids
        model = turns.pop(0)
        assert (model.ids, model.logprobs, model.version) == (c.completion_ids, c.logprobs, c.version)
        so_far += model.ids
    assert not turns
    mask = split.loss_mask
    pos = 0
    for t in split.turns:
        assert mask[pos : pos + len(t.ids)] == [int(t.model)] * len(t.ids)
        pos += len(t.ids)


def _rows(splits: list[Split], tokenizer: Any, reward: float = 1.0) -> list[dict[str, Any]]:
    rows = split_rows(
        splits,
        group_id="g",
        reward=reward,
        finish_reason="stop",
        prompt=Prompt(0, "What is 2+3?", "5"),
        record={"episode_id": "e"},
        decode=lambda ids: tokenizer.decode(ids),
    )
    for i, r in enumerate(rows):
        r["sample_id"] = f"s{i}"
    table = shards.build_table(rows, "run", "w0", 0)
    assert shards.schema_problem(table.schema) is None
    assert shards._value_problem(table, len(tokenizer)) is None
    return rows


def test_calls_merge_where_they_extend_and_split_where_they_do_not() -> None:
    lp = [-0.5, -0.25]
    calls = [
        Call([1, 2, 3], [10, 11], lp, 4, "stop"),
        Call([1, 2, 3, 10, 11, 20, 21], [12, 13], lp, 5, "stop"),  # a tool result, then a turn: merged
        Call([1, 2, 3, 10, 99], [14, 15], lp, 5, "stop"),  # the history edited: a new sample
        Call(
            [1, 2, 3, 10, 11, 20, 21, 12, 13], [16, 17], lp, 6, "stop"
        ),  # back to the first: nothing in between
        Call([1, 2, 3, 10, 99, 14, 15, 30], [18, 19], lp, 6, "length"),
    ]
    first, second = split_calls(calls)
    assert first.calls == [0, 1, 3] and second.calls == [2, 4]
    assert [(t.ids, t.version) for t in first.turns] == [
        ([10, 11], 4),
        ([20, 21], ENV_VERSION),
        ([12, 13], 5),
        ([16, 17], 6),
    ]
    assert first.loss_mask == [1, 1, 0, 0, 1, 1, 1, 1] and second.prompt_ids == [1, 2, 3, 10, 99]
    for s in (first, second):
        _assert_faithful(s, calls)
    # A merge that would take the response past the budget starts a new sample holding the history as its prompt.
    short = split_calls(calls[:2], max_response=5)
    assert [s.prompt_ids for s in short] == [[1, 2, 3], calls[1].prompt_ids]
    # Ids are compared as the engine produced them: a model that ended with <|endoftext|> (2) does not continue
    # into a history re-rendered with <|im_end|> (1) in its place.
    assert (
        len(split_calls([Call([5], [6, 2], lp, 0, "stop"), Call([5, 6, 1, 7], [8], [-1.0], 0, "stop")])) == 2
    )


@pytest.mark.parametrize("agent", [_agents.calculator, _agents.streaming_calculator])
def test_an_sdk_agent_with_a_tool_call_gives_one_faithful_sample(tokenizer: Any, agent: Any) -> None:
    script = Script(tokenizer, [TOOL_REPLY, "5"])
    with ChatEndpoint(ChatRenderer(tokenizer, TEMPLATE)) as endpoint:
        answer, log = _run(endpoint, script, agent)
    assert answer == "5" and len(log.exchanges) == 2
    tool_reply = log.exchanges[0].reply
    assert tool_reply["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in tool_reply["tool_calls"]] == [{"a": 2, "b": 3}]
    (sample,) = split_calls(log.calls)
    _assert_faithful(sample, log.calls)
    assert [t.model for t in sample.turns] == [True, False, True]
    env = tokenizer.decode(sample.turns[1].ids)
    assert (
        env == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Decoding the ids gives the conversation as the template renders it (less the newline after the model's
    # last <|im_end|>, which nobody produced).
    messages = [*log.exchanges[-1].messages, {"role": "assistant", "content": "5"}]
    rendered = ChatRenderer(tokenizer, TEMPLATE).render(messages, ADD_TOOL, generation_prompt=False)
    assert tokenizer.decode(sample.ids()) + "\n" == rendered
    (row,) = _rows([sample], tokenizer)
    assert row["turn_versions"] == [3, -1, 3] and row["policy_version"] == 3
    assert json.loads(row["episode"]) == {"episode_id": "e", "split": 0, "splits": 1, "split_calls": 2}


def test_the_engines_ids_are_kept_not_retokenised(tokenizer: Any) -> None:
    """Replies in ids the tokenizer would not produce, ended with <|endoftext|> where the template writes
    <|im_end|>: the sample holds them as they were, and still merges into one."""
    script = Script(tokenizer, [TOOL_REPLY, "hello world"], end="<|endoftext|>", chars=True)
    with ChatEndpoint(ChatRenderer(tokenizer, TEMPLATE)) as endpoint:
        _, log = _run(endpoint, script, _agents.calculator)
    (sample,) = split_calls(log.calls)
    _assert_faithful(sample, log.calls)
    model_turns = [t.ids for t in sample.turns if t.model]
    assert model_turns == script.outputs and model_turns[0][-1] == tokenizer.convert_tokens_to_ids(
        "<|endoftext|>"
    )
    assert tokenizer.decode(sample.turns[1].ids).startswith("<|im_end|>\n<|im_start|>user")
    rendered = ChatRenderer(tokenizer, TEMPLATE).render(
        log.exchanges[-1].messages, ADD_TOOL, generation_prompt=True
    )
    assert (
        Script(tokenizer, []).encode(rendered) != log.calls[-1].prompt_ids
    )  # what re-tokenising would have given
    _rows([sample], tokenizer)


def test_a_template_that_rewrites_an_earlier_turn_splits(tokenizer: Any) -> None:
    script = Script(tokenizer, ["<think>2 and 3</think>5", "Yes: 5"])
    renderer = ChatRenderer(tokenizer, THINK_TEMPLATE)
    with ChatEndpoint(renderer) as endpoint:
        _, log = _run(endpoint, script, _agents.follow_up)
    first, second = split_calls(log.calls)
    assert (first.calls, second.calls) == ([0], [1])
    for s in (first, second):
        _assert_faithful(s, log.calls)
    # The second sample's prompt is the conversation as the template now renders it: the reasoning dropped.
    again = renderer.render(log.exchanges[1].messages, [], generation_prompt=True)
    assert tokenizer.decode(second.prompt_ids) == again and "<think>" not in again
    rows = _rows([first, second], tokenizer, reward=0.5)
    assert [json.loads(r["episode"])["split"] for r in rows] == [0, 1] and {r["reward"] for r in rows} == {
        0.5
    }


def test_a_new_history_or_the_response_budget_splits(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer, TEMPLATE)
    with ChatEndpoint(renderer) as endpoint:
        _, restarted = _run(endpoint, Script(tokenizer, ["5"]), _agents.restarting)
        budget = Limits(max_turns=8, max_turn_tokens=16, max_response=12, context=400)
        _, long = _run(
            endpoint, Script(tokenizer, ["5 is the sum", "Yes, it is five"]), _agents.follow_up, limits=budget
        )
    assert [s.calls for s in split_calls(restarted.calls)] == [[0], [1]]
    splits = split_calls(long.calls, max_response=budget.max_response)
    assert [s.calls for s in splits] == [[0], [1]]
    assert all(len(s.response_ids) <= budget.max_response for s in splits)
    assert (
        splits[1].prompt_ids == long.calls[1].prompt_ids
    )  # the history, as the engine saw it, is the new prompt
    assert splits[1].prompt_ids[: splits[0].length] == splits[0].ids()
    _rows(splits, tokenizer)


def test_the_endpoint_refuses_in_one_openai_shaped_line(tokenizer: Any) -> None:
    with ChatEndpoint(ChatRenderer(tokenizer, TEMPLATE), model_name="tiny") as endpoint:
        eid = endpoint.open(Script(tokenizer, ["5"]), limits=Limits(1, 8, 100, 400))

        def post(body: Any, path: str = f"/episodes/{eid}/v1/chat/completions") -> tuple[int, dict[str, Any]]:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            status, _, data = endpoint.handle("POST", path, raw)
            return status, json.loads(data)

        assert post(b"{not json")[0] == 400
        status, out = post({"messages": QUESTION, "n": 2})
        assert (
            status == 400 and "only n = 1" in out["error"]["message"] and "\n" not in out["error"]["message"]
        )
        assert (
            "accepted: system"
            in post({"messages": [{"role": "robot", "content": "hi"}]})[1]["error"]["message"]
        )
        assert post({"messages": QUESTION}, "/episodes/nope/v1/chat/completions")[0] == 404
        assert post({"messages": QUESTION}, "/v1/chat/completions")[1]["error"]["code"] == "no_route"
        status, _, models = endpoint.handle("GET", f"/episodes/{eid}/v1/models", b"")
        assert status == 200 and json.loads(models)["data"][0]["id"] == "tiny"
        assert post({"messages": QUESTION})[0] == 200
        status, out = post({"messages": QUESTION})  # past max_turns (1)
        assert status == 400 and out["error"]["code"] == "turn_limit"
        client = openai.OpenAI(base_url=endpoint.base_url("gone"), api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="is not open on this endpoint"):
            client.chat.completions.create(model="m", messages=QUESTION)
        log = endpoint.close(eid)
    assert len(log.exchanges) == 1 and log.refused and "env.max_turns" in log.refused[0]


def test_logprobs_are_served_or_refused_never_ignored(tokenizer: Any) -> None:
    with ChatEndpoint(ChatRenderer(tokenizer, TEMPLATE), model_name="tiny") as endpoint:
        eid = endpoint.open(Script(tokenizer, ["5", "7"]), limits=Limits(4, 8, 100, 400))
        path = f"/episodes/{eid}/v1/chat/completions"

        def post(body: Any) -> tuple[int, bytes]:
            status, _, data = endpoint.handle("POST", path, json.dumps(body).encode())
            return status, data

        status, data = post({"messages": QUESTION, "top_logprobs": 2})
        assert status == 400 and "top_logprobs" in json.loads(data)["error"]["message"]
        status, data = post({"messages": QUESTION, "logprobs": True})
        assert status == 200
        content = json.loads(data)["choices"][0]["logprobs"]["content"]
        call = endpoint.close(eid).calls[0]
        assert [c["logprob"] for c in content] == call.logprobs  # what the sample is trained with
        assert "".join(c["token"] for c in content) == tokenizer.decode(
            call.completion_ids, skip_special_tokens=False
        )
        eid = endpoint.open(Script(tokenizer, ["5"]), limits=Limits(4, 8, 100, 400))
        path = f"/episodes/{eid}/v1/chat/completions"
        status, data = post({"messages": QUESTION, "logprobs": True, "stream": True})
        first = json.loads(data.decode().split("\n\n")[0].removeprefix("data: "))
        assert status == 200 and len(first["choices"][0]["logprobs"]["content"]) == len(call.completion_ids)
        status, data = post({"messages": QUESTION})
        assert json.loads(data)["choices"][0]["logprobs"] is None  # not asked for


def test_agent_failures_score_zero_and_never_stop_the_batch(tokenizer: Any) -> None:
    cfg = ShardRLConfig.model_validate(
        {
            "reward": {"function": "exact_match"},
            "env": {
                "agent": "tests.integration._agents:by_mode",
                # the sleeping agent sleeps 10 s of wall time, so it always passes 6 s; the others' two HTTP calls
                # take well under a second, 6 s is their margin under load
                "agent_timeout_s": 6,
                "max_turn_tokens": 96,
            },
            "rollout": {"sampling": {"max_response_length": 300}},
            "data": {"max_prompt_length": 100},
        }
    )
    task = AgentTask(cfg, tokenizer, chat_template=TEMPLATE)
    modes = ["calculator", "raise", "sleep", "number", "silent"]
    prompts = [
        EncodedPrompt(Prompt(i, "What is 2+3?", "5", tuple(QUESTION), {"mode": m}), [1])
        for i, m in enumerate(modes)
    ]
    try:
        scored, generated = task.run_batch(
            Script(tokenizer, [TOOL_REPLY, "5"]), prompts, SamplingSpec(n=2), lambda: 7, group_prefix="w0.i.1"
        )
    finally:
        task.close()
    assert [g[0]["group_id"] for g in scored.groups] == [f"w0.i.1.{i}" for i in range(4)]
    assert len(scored.errors) == 1 and "prompt 4" in scored.errors[0] and "before calling" in scored.errors[0]
    records = [[json.loads(r["episode"]) for r in g] for g in scored.groups]
    assert [r["reward"] for r in scored.groups[0]] == [1.0, 1.0] and records[0][0]["calls"] == 2
    # the calculator agent's first reply asked for the tool: counted from the recorded replies, shown per episode
    assert records[0][0]["tool_calls"] == 1 and episode_stats(scored.groups[:1])["tool_calls"] == 2
    assert [rec[0]["ended"] for rec in records] == ["done", "error", "timeout", "error"]
    assert "the agent broke" in records[1][0]["error"] and "agent_timeout_s" in records[2][0]["error"]
    assert "returned int" in records[3][0]["error"]
    assert all(r["reward"] == 0.0 for g in scored.groups[1:] for r in g)
    assert generated == sum(sum(r["loss_mask"]) for g in scored.groups for r in g)
    for i, r in enumerate(x for g in scored.groups for x in g):
        r["sample_id"] = f"s{i}"
    table = shards.build_table([r for g in scored.groups for r in g], "run", "w0", 0)
    assert shards._value_problem(table, len(tokenizer)) is None
