"""The OpenAI-compatible endpoint over a real engine (transformers, on the CPU): an agent written with the
``openai`` package makes a tool call, runs the tool itself and sends the result back; the recorded ids decode to
the rendered conversation, the mask covers exactly the environment's ids, and the engine's logprobs on the model's
tokens match the model's own recomputation.  ``AgentTask.run_batch`` then yields rows that pass the shard
validation."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from buffer import shards
from buffer.config import ShardRLConfig
from rollout_worker.engines.base import Completion, SamplingSpec
from rollout_worker.engines.completer import Batcher
from rollout_worker.engines.hf import HFEngine
from rollout_worker.engines.spec import EngineSpec
from rollout_worker.envs.agent import AgentTask
from rollout_worker.envs.calls import Split, split_calls
from rollout_worker.envs.endpoint import ChatEndpoint
from rollout_worker.envs.episode import ChatRenderer, Limits
from rollout_worker.envs.tools import Tool
from rollout_worker.prompts import EncodedPrompt, Prompt

from ..unit.buffer_helpers import make_layout
from ..unit.test_envs_calls import TEMPLATE, TOOL_REPLY
from . import _agents

pytest.importorskip("openai")

TOL = 1e-4  # the same float32 model, with and without a KV cache


@pytest.fixture(scope="module")
def engine(tiny_model_untied: Path) -> Iterator[HFEngine]:
    e = HFEngine(EngineSpec("hf", tiny_model_untied, max_model_len=512, device="cpu"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def lm(tiny_model_untied: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_untied, dtype=torch.float32).eval()


def recomputed(lm: Any, ids: list[int], start: int) -> list[float]:
    """Log-softmax (temperature 1) of each of ``ids[start:]`` given the ids before it, in one forward pass."""
    with torch.no_grad():
        logp = torch.log_softmax(lm(input_ids=torch.tensor([ids])).logits.float()[0], dim=-1)
    return [logp[j - 1, ids[j]].item() for j in range(start, len(ids))]


def model_logprob_gap(lm: Any, s: Split) -> float:
    """The largest |engine logprob - recomputed logprob| over the sample's model tokens (0 where it has none)."""
    again = recomputed(lm, s.ids(), len(s.prompt_ids))
    return max(
        (abs(a - b) for a, b, m in zip(s.response_logprobs, again, s.loss_mask, strict=True) if m),
        default=0.0,
    )


def batched(engine: HFEngine) -> Batcher:
    """The engine as the worker serves it to the endpoint: concurrent calls batched."""
    return Batcher(engine.generate, lambda ids: str(engine.tokenizer.decode(ids, skip_special_tokens=True)))


class ToolCallFirst:
    """Stands in for the model's first turn of a conversation: the tiny random model never writes a tool call, so
    that turn is the ids of one (its logprobs from a forward pass of the same weights, what the engine would report
    at temperature 1); every later turn is the real engine's."""

    def __init__(self, engine: HFEngine, lm: Any):
        self.engine, self.lm = engine, lm
        self.complete = batched(engine)
        self.lock = threading.Lock()

    def __call__(self, prompt_ids: list[int], spec: SamplingSpec) -> Completion:
        tok = self.engine.tokenizer
        if tok.decode(prompt_ids).count("<|im_start|>assistant") > 1:
            return self.complete(prompt_ids, spec)
        ids = [
            *tok(TOOL_REPLY, add_special_tokens=False)["input_ids"],
            tok.convert_tokens_to_ids("<|im_end|>"),
        ]
        assert len(ids) <= spec.max_tokens
        with self.lock:
            logprobs = recomputed(self.lm, prompt_ids + ids, len(prompt_ids))
        return Completion(list(prompt_ids), ids, logprobs, "stop", TOOL_REPLY)


def test_an_sdk_agent_on_a_real_engine_is_token_faithful(engine: HFEngine, lm: Any) -> None:
    renderer = ChatRenderer(engine.tokenizer, TEMPLATE)
    complete = ToolCallFirst(engine, lm)
    limits = Limits(max_turns=4, max_turn_tokens=96, max_response=400, context=512)
    with ChatEndpoint(renderer) as endpoint:
        eid = endpoint.open(complete, version=lambda: 2, sampling=SamplingSpec(seed=5), limits=limits)
        _agents.calculator(
            endpoint.base_url(eid), {"messages": [{"role": "user", "content": "What is 2+3?"}]}
        )
        log = endpoint.close(eid)
    complete.complete.close()
    assert len(log.exchanges) == 2 and log.exchanges[0].reply["tool_calls"][0]["function"]["name"] == "add"
    last = log.exchanges[-1]
    assert last.messages[-1] == {
        "role": "tool",
        "tool_call_id": last.messages[-2]["tool_calls"][0]["id"],
        "content": "5",
    }
    (sample,) = split_calls(log.calls)
    assert [t.version for t in sample.turns] == [2, -1, 2]
    # What the engine was given for its own turn is the agent's conversation, tool result included, as the template
    # renders it; the sample is that and the engine's ids.
    tools = [Tool("add", "", _agents.ADD)]
    prompt = renderer.render(last.messages, tools, generation_prompt=True)
    assert engine.tokenizer.decode(last.call.prompt_ids) == prompt
    assert sample.ids() == last.call.prompt_ids + last.call.completion_ids
    env = sample.turns[1]
    assert engine.tokenizer.decode(env.ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert sample.loss_mask == [1] * len(sample.turns[0].ids) + [0] * len(env.ids) + [1] * len(
        sample.turns[2].ids
    )
    # Only the last turn's logprobs test the engine: the first turn is scripted (ToolCallFirst), its logprobs
    # computed by ``lm`` itself, so on those tokens this compares ``lm`` with ``lm``.  The last turn's come from the
    # engine over the whole context, tool result included: that is the comparison that can fail.
    last_turn = sample.turns[2]
    offset = len(sample.turns[0].ids) + len(sample.turns[1].ids)
    assert (
        last_turn.model and len(last_turn.ids) >= 1 and offset + len(last_turn.ids) == len(sample.loss_mask)
    )
    gap = model_logprob_gap(lm, sample)
    print(f"max |engine logprob - recomputed| on model tokens = {gap:.2e}")
    assert gap < TOL


def test_agent_task_on_a_real_engine_gives_valid_rows(
    engine: HFEngine, lm: Any, tiny_model_untied: Path, tmp_path: Path
) -> None:
    cfg = ShardRLConfig.model_validate(
        {
            "reward": {"function": "exact_match"},
            "env": {
                "agent": "tests.integration._agents:follow_up",
                "agent_timeout_s": 120,
                "max_turn_tokens": 32,
            },
            "rollout": {"sampling": {"max_response_length": 200, "n": 2}},
            "data": {"max_prompt_length": 64},
        }
    )
    task = AgentTask(cfg, engine.tokenizer, chat_template=TEMPLATE)
    complete = Batcher(
        engine.generate, lambda ids: str(engine.tokenizer.decode(ids, skip_special_tokens=True))
    )
    prompts = [
        EncodedPrompt(
            Prompt(i, f"max({i},{i + 5})=", str(i + 5), ({"role": "user", "content": f"max({i},{i + 5})="},)),
            [1],
        )
        for i in range(2)
    ]
    try:
        scored, generated = task.run_batch(
            complete, prompts, SamplingSpec(n=2, seed=11), lambda: 0, group_prefix="w0.i.0", epoch=1
        )
    finally:
        complete.close()
        task.close()
    assert not scored.errors and [len(g) for g in scored.groups] == [2, 2]  # one sample per episode: merged
    rows = [r for g in scored.groups for r in g]
    assert generated == sum(sum(r["loss_mask"]) for r in rows)
    for r in rows:
        record = json.loads(r["episode"])
        assert (record["calls"], record["splits"], record["ended"]) == (2, 1, "done")
        assert [v for v in r["turn_versions"] if v >= 0] == [0, 0] and r["turn_versions"][1] == -1
        s = Split(r["prompt_ids"])
        s.turns = list(row_turns(r))
        assert model_logprob_gap(lm, s) < TOL
    writer = shards.ShardWriter(make_layout(tmp_path), "run", "w0")
    for r in rows:
        writer.add(r)
    path = writer.flush()
    assert path is not None
    assert shards.read_shard(path, vocab_size=len(engine.tokenizer)).num_rows == 4


def row_turns(row: dict[str, Any]) -> Iterator[Any]:
    """The turns of a shard row, rebuilt from its columns."""
    from rollout_worker.envs.episode import Turn

    pos = 0
    for n, v in zip(row["turn_lengths"], row["turn_versions"], strict=True):
        yield Turn(row["response_ids"][pos : pos + n], row["response_logprobs"][pos : pos + n], v)
        pos += n
