"""Multi-turn episodes with a scripted engine: the episode loop, the token-faithfulness invariant (the engine saw the
prompt and every turn so far; the shard's response is the turns back to back; the mask's zero spans are exactly the
environment's turns; decoding gives the rendered conversation), truncation, the shard's multi-turn columns and their
validation, and the trainer's use of the mask (no gradient reaches an environment token)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from buffer import shards
from buffer.config import ShardRLConfig
from buffer.schema import META_SAMPLE_VERSION, MULTITURN_NAMES, multiturn_problem
from rollout_worker.engines.base import SamplingSpec
from rollout_worker.envs import ToolTask
from rollout_worker.envs.episode import Episode, group_rows, run_episodes
from rollout_worker.prompts import Prompt
from trainer.batching import collate
from trainer.data import Sample, _samples

from .buffer_helpers import make_layout
from .envs_helpers import TOOL_TEMPLATE, TOOLS, ScriptedModel, call

pytestmark = pytest.mark.proc  # the tools run in sandbox processes

SCRIPTS = {
    "What is alpha?": [call("lookup", key="alpha"), "7"],
    "Add 2 and 3, and read beta.": [
        call("add", a=2, b=3) + " " + call("lookup", key="beta"),
        call("nope") + '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
        "5 3",
    ],
    "Loop.": [call("add", a=1, b=1)] * 10,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_untied: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_untied)


def _task(tokenizer: Any, response: int = 1500, **env: Any) -> ToolTask:
    cfg = ShardRLConfig.model_validate(
        {
            "reward": {"function": "exact_match", "truncated_reward": -1.0},
            "env": {"tools": [f"{TOOLS}:lookup", f"{TOOLS}:add"], "tool_timeout_s": 20, **env},
            "rollout": {"sampling": {"max_response_length": response}},
            "data": {"max_prompt_length": 1000},
        }
    )
    return ToolTask(cfg, tokenizer, chat_template=TOOL_TEMPLATE)


def _run(task: ToolTask, model: ScriptedModel, prompts: list[Prompt]) -> list[Episode]:
    episodes = [task.episode(p) for p in prompts]
    run_episodes(model, episodes, SamplingSpec(seed=1), task.limits, version=lambda: 4)
    return episodes


def _prompts(*users: str, answers: tuple[str, ...] = ("7", "5 3", "2")) -> list[Prompt]:
    return [
        Prompt(i, u, a, ({"role": "user", "content": u},))
        for i, (u, a) in enumerate(zip(users, answers, strict=False))
    ]


def test_tool_episodes_are_token_faithful(tokenizer: Any) -> None:
    task, model = _task(tokenizer), ScriptedModel(tokenizer, SCRIPTS)
    prompts = _prompts("What is alpha?", "Add 2 and 3, and read beta.")
    alpha, mixed = _run(task, model, prompts)
    assert [alpha.ended, mixed.ended] == ["done", "done"]
    assert [m["content"] for m in alpha.messages if m["role"] == "tool"] == ["7"]
    told = [m["content"] for m in mixed.messages if m["role"] == "tool"]
    assert told[:2] == ["5", "3"]  # two calls in one turn: two results in one environment turn
    assert told[2].startswith("error: unknown tool 'nope'") and "not valid JSON" in told[3]
    assert mixed.record()["tool_calls"] == 4 and mixed.record()["tool_errors"] == 2
    for e in (alpha, mixed):
        seen = [(p, out) for p, out in model.calls if p[: len(e.prompt_ids)] == e.prompt_ids]
        model_turns = [t for t in e.turns if t.model]
        assert len(seen) == len(model_turns)
        so_far = list(e.prompt_ids)
        for turn in e.turns:  # each engine call saw exactly the prompt and every turn before it
            if turn.model:
                assert (so_far, turn.ids) in seen
            so_far += turn.ids
        assert e.response_ids == [i for t in e.turns for i in t.ids]
        spans = [(t.model, len(t.ids)) for t in e.turns]
        mask = e.loss_mask
        pos = 0
        for is_model, n in spans:  # the mask's 0 spans are exactly the environment's turns
            assert mask[pos : pos + n] == [int(is_model)] * n
            pos += n
        assert [t.model for t in e.turns] == [True, False] * (len(e.turns) // 2) + [True]
        assert all(x == 0.0 for t in e.turns if not t.model for x in t.logprobs)
        # Decoding the ids gives the conversation as the template renders it (less the newline after the
        # model's last <|im_end|>, which nobody produced).
        rendered = task.renderer.render(e.messages, e.env.tools, generation_prompt=False)
        assert tokenizer.decode(e.prompt_ids + e.response_ids) + "\n" == rendered
    (rows_a, _), (rows_m, _) = (
        group_rows([e], f"g{i}", p) for i, (e, p) in enumerate(zip((alpha, mixed), prompts, strict=True))
    )
    assert rows_a is not None and rows_m is not None
    assert [rows_a[0]["reward"], rows_m[0]["reward"]] == [1.0, 1.0]
    assert rows_m[0]["turn_versions"] == [4, -1, 4, -1, 4] and rows_m[0]["policy_version"] == 4


def test_episodes_past_their_limits_end_truncated(tokenizer: Any) -> None:
    turns = _run(_task(tokenizer, max_turns=3), ScriptedModel(tokenizer, SCRIPTS), _prompts("Loop."))[0]
    assert turns.ended == "turn_limit" and sum(t.model for t in turns.turns) == 3 and turns.turns[-1].model
    # A response budget the third tool result does not fit in: ended before that turn, never cut through it.
    ctx = _run(_task(tokenizer, response=120), ScriptedModel(tokenizer, SCRIPTS), _prompts("Loop."))[0]
    assert ctx.ended in ("context_limit", "length") and len(ctx.response_ids) <= 120
    # A turn cut at max_turn_tokens goes on: the environment closes it and answers the cut call with an error.
    cut = _run(_task(tokenizer, max_turn_tokens=20), ScriptedModel(tokenizer, SCRIPTS), _prompts("Loop."))[0]
    assert cut.ended == "turn_limit" and [len(t.ids) for t in cut.turns if t.model] == [20] * 8
    closing = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert all(t.ids[: len(closing)] == closing for t in cut.turns if not t.model)
    assert cut.record()["tool_errors"] == 8 and "without </tool_call>" in cut.messages[2]["content"]
    for e, p in ((turns, "Loop."), (ctx, "Loop."), (cut, "Loop.")):
        rows, _ = group_rows([e], "g", _prompts(p)[0])
        assert rows is not None and rows[0]["finish_reason"] == "length" and rows[0]["reward"] == -1.0
        assert json.loads(rows[0]["episode"])["truncated"] is True


def test_a_failing_reward_is_a_recorded_zero(tokenizer: Any) -> None:
    task = _task(tokenizer)
    (e,) = _run(task, ScriptedModel(tokenizer, SCRIPTS), _prompts("What is alpha?"))

    def broken(*_a: Any, **_k: Any) -> float:
        raise RuntimeError("scorer down")

    e.env.reward = broken  # type: ignore[method-assign]
    rows, _ = group_rows([e], "g", _prompts("What is alpha?")[0])
    assert rows is not None and rows[0]["reward"] == 0.0
    assert "scorer down" in json.loads(rows[0]["episode"])["reward_error"]


def _multiturn_rows(tokenizer: Any) -> list[dict[str, Any]]:
    prompts = _prompts("What is alpha?", "Add 2 and 3, and read beta.")
    episodes = _run(_task(tokenizer), ScriptedModel(tokenizer, SCRIPTS), prompts)
    rows, _ = group_rows(episodes, "g", prompts[0])
    assert rows is not None
    return rows


def test_multiturn_shard_round_trip_to_the_trainers_batch(tmp_path: Path, tokenizer: Any) -> None:
    rows = _multiturn_rows(tokenizer)
    layout = make_layout(tmp_path)
    w = shards.ShardWriter(layout, "run", "w0")
    for r in rows:
        w.add(dict(r))
    path = w.flush()
    assert path is not None
    table = shards.read_shard(path, vocab_size=len(tokenizer))
    assert table.schema.metadata[META_SAMPLE_VERSION] == b"3"
    samples = _samples(table, path.name)
    assert [s.loss_mask for s in samples] == [r["loss_mask"] for r in rows]
    for packed in (False, True):
        b = collate(samples, pad_id=0, packed=packed)
        for i, s in enumerate(samples):
            p, n = len(s.prompt_ids), len(s.response_ids)
            assert b["response_mask"][i, p : p + n].tolist() == [float(x) for x in rows[i]["loss_mask"]]
            assert b["response_mask"][i, :p].sum() == 0
            assert b["attention_mask"][i, : p + n].sum() == p + n  # environment tokens are still context
            assert (b["behaviour_logp"][i][b["response_mask"][i] == 0] == 0).all()
    assert samples[1].loss_tokens == sum(rows[1]["loss_mask"]) < len(rows[1]["response_ids"])


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    for i, r in enumerate(rows):
        r.setdefault("sample_id", f"s{i}")
    return shards.build_table(rows, "run", "w0", 0)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda r: r.update(loss_mask=r["loss_mask"][:-1]), "loss_mask and response_ids differ"),
        (lambda r: r.update(turn_versions=r["turn_versions"][:-1]), "turn_versions and turn_lengths differ"),
        (lambda r: r.update(turn_lengths=[r["turn_lengths"][0] - 1, *r["turn_lengths"][1:]]), "do not sum"),
        (lambda r: r.update(loss_mask=[1] * len(r["loss_mask"])), "not 1 on exactly the model's turns"),
        (lambda r: r.update(turn_lengths=None), "set together"),
        (
            lambda r: r.update(response_logprobs=[-0.1] * len(r["response_logprobs"])),
            "not 0 on an environment token",
        ),
    ],
)
def test_inconsistent_multiturn_columns_are_refused(tokenizer: Any, change: Any, why: str) -> None:
    rows = _multiturn_rows(tokenizer)
    assert shards._value_problem(_table([dict(r) for r in rows]), None) is None
    change(rows[1])
    problem = shards._value_problem(_table(rows), None)
    assert problem is not None and why in problem


def test_single_turn_shards_old_and_new_still_validate() -> None:
    row = {
        "sample_id": "a",
        "group_id": "g",
        "prompt_ids": [1, 2],
        "response_ids": [3],
        "response_logprobs": [-0.5],
        "reward": 1.0,
        "policy_version": 0,
        "finish_reason": "stop",
    }
    new = shards.build_table([row], "run", "w0", 0)
    assert all(new[c].null_count == 1 for c in MULTITURN_NAMES)
    assert shards.schema_problem(new.schema) is None and shards._value_problem(new, None) is None
    old = new.drop_columns(
        MULTITURN_NAMES
    )  # as written before the multi-turn columns, with no sample version
    meta = {k: v for k, v in (new.schema.metadata or {}).items() if k != META_SAMPLE_VERSION}
    old = old.replace_schema_metadata(meta)
    assert shards.schema_problem(old.schema) is None and multiturn_problem(old) is None
    assert _samples(old)[0].loss_mask is None
    future = new.replace_schema_metadata({**(new.schema.metadata or {}), META_SAMPLE_VERSION: b"4"})
    assert "sample version" in (shards.schema_problem(future.schema) or "")


def test_environment_tokens_get_no_gradient() -> None:
    """The trainer's policy loss on a multi-turn sample has the gradient of a hand-written loss over the model's
    tokens alone, packed or padded; counting the environment's tokens too would give another gradient."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.logprobs import batch_logprobs
    from trainer.ppo import Normalisers, policy_loss

    cfg = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=50,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg).float()
    mask = [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1]
    resp = [11, 12, 30, 31, 32, 13, 14, 15, 33, 34, 16]
    a = Sample("a", "g", [3, 4, 5], resp, [-0.7 * m for m in mask], 1.0, 0, advantage=0.8, loss_mask=mask)
    b = Sample("b", "g", [8], [9, 10], [-0.5, -0.5], 0.0, 0, advantage=-0.3)

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        lm.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in lm.parameters() if p.grad is not None]

    def reference(counted: list[list[int]]) -> list[torch.Tensor]:
        """-A * logp summed over the counted response positions / their number (the PPO loss at ratio 1)."""
        total, n = torch.zeros(()), 0
        for s, keep in zip((a, b), counted, strict=True):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(lm(input_ids=ids).logits.float()[0], dim=-1)
            p = len(s.prompt_ids)
            for j, tok in enumerate(s.response_ids):
                if keep[j]:
                    total = total - s.advantage * logp[p + j - 1, tok]
                    n += 1
        return grads(total / n)

    want = reference([mask, [1, 1]])
    every = reference([[1] * len(resp), [1, 1]])
    for packed in (False, True):
        batch = collate([a, b], pad_id=0, packed=packed)
        logp, _ = batch_logprobs(lm, batch, chunk=4, with_entropy=False)
        loss, _ = policy_loss(
            logp,
            logp.detach(),
            batch["advantages"],
            batch["response_mask"],
            clip_low=0.2,
            clip_high=0.2,
            dual_clip=None,
            agg_mode="token-mean",
            norms=Normalisers(tokens=float(a.loss_tokens + b.loss_tokens)),
        )
        got = grads(loss)
        assert all(_close(g, w) for g, w in zip(got, want, strict=True)), packed
        assert not all(_close(g, e) for g, e in zip(got, every, strict=True))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 summation order, relative to the tensor's scale: an element-wise tolerance fails on
    elements near zero when another CPU sums in another order (3e-6 absolute seen on an AMD EPYC)."""
    return float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_run_batch_scores_whole_groups_and_drops_a_prompt_without_room(tokenizer: Any) -> None:
    from rollout_worker.prompts import EncodedPrompt

    task = _task(tokenizer)
    long = Prompt(5, "x" * 3000, None, ({"role": "user", "content": "x" * 3000},))
    prompts = [EncodedPrompt(p, [1]) for p in [*_prompts("What is alpha?"), long]]
    scored, generated = task.run_batch(
        ScriptedModel(tokenizer, SCRIPTS), prompts, SamplingSpec(n=2), lambda: 1, group_prefix="w0.i.3"
    )
    assert [[r["group_id"] for r in g] for g in scored.groups] == [["w0.i.3.0", "w0.i.3.0"]]
    assert generated == sum(sum(r["loss_mask"]) for r in scored.groups[0])
    assert len(scored.errors) == 1 and "prompt 5" in scored.errors[0] and "no room" in scored.errors[0]


# Drops the reasoning of every assistant message but the conversation's last, as reasoning models' templates do: the
# conversation so far is then no prefix of its next rendering.
DROPS_REASONING = TOOL_TEMPLATE.replace(
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}",
    "{% elif m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n"
    "{{ m['content'].split('</think>')[-1] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}",
)


def test_a_template_that_drops_reasoning_splits_the_episode_into_faithful_samples(tokenizer: Any) -> None:
    scripts = {"What is alpha?": ["<think>look it up</think>" + call("lookup", key="alpha"), "7"]}
    cfg = ShardRLConfig.model_validate(
        {
            "reward": {"function": "exact_match"},
            "env": {"tools": [f"{TOOLS}:lookup"], "tool_timeout_s": 20},
            "rollout": {"sampling": {"max_response_length": 1500}},
            "data": {"max_prompt_length": 1000},
        }
    )
    task = ToolTask(cfg, tokenizer, chat_template=DROPS_REASONING)
    model = ScriptedModel(tokenizer, scripts)
    (prompt,) = _prompts("What is alpha?")
    (e,) = [task.episode(prompt)]
    run_episodes(model, [e], SamplingSpec(seed=1), task.limits, version=lambda: 4)
    assert e.ended == "done" and len(e.closed) == 1
    rows, why = group_rows([e], "g", prompt)
    assert why is None and rows is not None and len(rows) == 2
    # each sample is exactly one call of the engine: the prompt it saw, the ids it drew
    for row, (seen, drawn) in zip(rows, model.calls, strict=True):
        assert row["prompt_ids"] == seen and row["response_ids"] == drawn
        assert row["loss_mask"] == [1] * len(drawn) and row["turn_versions"] == [4]
    assert "look it up" not in tokenizer.decode(rows[1]["prompt_ids"])  # the template dropped it
    assert "<tool_response>" in tokenizer.decode(rows[1]["prompt_ids"])
    records = [json.loads(r["episode"]) for r in rows]
    assert [(r["split"], r["splits"]) for r in records] == [(0, 2), (1, 2)]
    assert records[0]["episode_id"] == records[1]["episode_id"] and records[0]["model_turns"] == 2
    assert rows[0]["reward"] == rows[1]["reward"] == 1.0  # the episode's reward, of its last reply, on both
    table = pa.Table.from_pylist(
        [{**r, "sample_id": f"s{i}", "worker_id": "w", "created_at": 0} for i, r in enumerate(rows)]
    )
    assert multiturn_problem(table) is None
    # the trainer gives both samples the episode's advantage: one entry of its group
    samples = _samples(table)
    assert {s.episode_key for s in samples} == {records[0]["episode_id"]}


def test_a_cut_last_reply_ends_truncated_and_only_its_own_sample_says_length(tokenizer: Any) -> None:
    """A final reply cut at ``env.max_turn_tokens`` ends the episode as ``length`` (truncated, scored with
    ``reward.truncated_reward``), as a single-turn response cut at its budget is; when the template split the
    episode, the earlier sample, whose turns the model ended itself, stays ``stop``."""
    first = "<think>look it up</think>" + call("lookup", key="alpha")
    budget = len(tokenizer(first, add_special_tokens=False)["input_ids"]) + 8
    scripts = {"What is alpha?": [first, "7 " * budget]}
    cfg = ShardRLConfig.model_validate(
        {
            "reward": {"function": "exact_match", "truncated_reward": -1.0},
            "env": {"tools": [f"{TOOLS}:lookup"], "tool_timeout_s": 20, "max_turn_tokens": budget},
            "rollout": {"sampling": {"max_response_length": 1500}},
            "data": {"max_prompt_length": 1000},
        }
    )
    task = ToolTask(cfg, tokenizer, chat_template=DROPS_REASONING)
    (prompt,) = _prompts("What is alpha?")
    e = task.episode(prompt)
    run_episodes(ScriptedModel(tokenizer, scripts), [e], SamplingSpec(seed=1), task.limits, version=lambda: 4)
    assert e.ended == "length" and e.truncated and len(e.closed) == 1
    rows, why = group_rows([e], "g", prompt)
    assert why is None and rows is not None
    assert [r["finish_reason"] for r in rows] == ["stop", "length"]
    assert all(json.loads(r["episode"])["truncated"] for r in rows) and {r["reward"] for r in rows} == {-1.0}


def test_a_batch_counts_as_failed_only_when_every_episode_failed() -> None:
    import json as _json

    from rollout_worker.scoring import ScoredBatch
    from rollout_worker.sources.episodes import failure_of

    def row(error: str | None) -> dict:
        return {"episode": _json.dumps({"ended": "error", "error": error} if error else {"ended": "done"})}

    assert failure_of(ScoredBatch()) is None  # nothing ran at all (no prompt yet): not a failure
    assert failure_of(ScoredBatch(groups=[[row("boom"), row(None)]])) is None  # one episode ran
    assert failure_of(ScoredBatch(groups=[[row("boom\n  at line 3")]])) == "boom at line 3"
    dropped = ScoredBatch(errors=["prompt 0: no agent run made a model call (KeyError: 'q')"])
    assert failure_of(dropped) == "prompt 0: no agent run made a model call (KeyError: 'q')"
