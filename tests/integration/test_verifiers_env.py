"""A ``verifiers`` environment (tests/integration/_verifiers_envs.py) run by ``VerifiersTask`` over a real engine
(transformers, on the CPU): verifiers' own chat program, through verifiers' interception server, calls the worker's
endpoint; the rows hold exactly the ids and logprobs the engine produced, each gets the reward verifiers' rubric
gave its trace, and they pass the shard validation.  With the environment's MCP tool server the episode is
multi-turn: the tool's result is an environment turn, masked out.  From the run config (``env.verifiers``,
``data.task = "env"``), a real worker process publishes the environment's episodes as shards.  Skipped where
verifiers is not installed (the ``verifiers`` extra)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers")

from buffer import shards
from buffer.config import VERIFIERS_REWARD, ConfigError, ShardRLConfig
from rollout_worker.engines.base import Completion, SamplingSpec
from rollout_worker.engines.hf import HFEngine
from rollout_worker.engines.spec import EngineSpec
from rollout_worker.envs.endpoint import Complete
from rollout_worker.envs.episode import ChatRenderer
from rollout_worker.envs.verifiers_env import (
    TASK_KEY,
    VerifiersConfigError,
    VerifiersTask,
    configured_env,
    env_prompts,
    load_env,
)
from rollout_worker.prompts import EncodedPrompt, Prompt
from rollout_worker.worker import USER_ERRORS, preflight
from shardrl.runs import init_run

from ..unit.buffer_helpers import make_layout
from ..unit.test_envs_calls import TEMPLATE
from ._common import importable
from ._rollout_helpers import ready_rows, spawn, stop, tail, wait_for
from .test_endpoint import TOL, ToolCallFirst, batched, model_logprob_gap, row_turns

HERE = Path(__file__).parent
ENV = "_verifiers_envs"  # the taskset id: verifiers resolves ids as top-level modules
PLAIN = "_verifiers_plain"  # a taskset without a harness of its own
LOCAL = {"agent": {"runtime": {"type": "subprocess"}}}  # the harness runs here, not in a remote sandbox


@pytest.fixture(scope="module", autouse=True)
def envs_importable() -> Iterator[None]:
    """The helper modules importable by their ids, here and in the tool server's process."""
    with importable(HERE):
        yield


@pytest.fixture(scope="module")
def engine(tiny_model_untied: Path) -> Iterator[HFEngine]:
    e = HFEngine(EngineSpec("hf", tiny_model_untied, max_model_len=512, device="cpu"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def lm(tiny_model_untied: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_untied, dtype=torch.float32).eval()


class Recorder:
    """A ``Complete`` that keeps every completion it hands out."""

    def __init__(self, complete: Complete):
        self.complete = complete
        self.made: list[Completion] = []
        self.lock = threading.Lock()

    def __call__(self, prompt_ids: list[int], spec: SamplingSpec) -> Completion:
        c = self.complete(prompt_ids, spec)
        with self.lock:
            self.made.append(c)
        return c


def config(**env: Any) -> ShardRLConfig:
    return ShardRLConfig.model_validate(
        {
            "reward": {"function": "exact_match"},  # not used: the rubric scores
            "env": {"agent_timeout_s": 240, **env},
            "rollout": {"sampling": {"max_response_length": 300, "n": 2}},
            "data": {"max_prompt_length": 64},
        }
    )


def rubric(reply: str, answer: str) -> float:
    """What the environment's two rewards give a final reply, by their weights."""
    from _verifiers_envs import brevity

    reply = reply.strip()  # verifiers' Trace.last_reply
    return 1.0 * float(reply == answer) + 0.5 * brevity(reply)


def run(task: VerifiersTask, complete: Complete, prompts: list[Prompt], n: int) -> tuple[Any, int]:
    return task.run_batch(
        complete,
        [EncodedPrompt(p, [1]) for p in prompts],
        SamplingSpec(n=n, seed=7),
        lambda: 3,
        group_prefix="w0.v.0",
        epoch=1,
    )


def stored(rows: list[dict[str, Any]], tmp_path: Path, vocab: int) -> None:
    writer = shards.ShardWriter(make_layout(tmp_path), "run", "w0")
    for r in rows:
        writer.add(r)
    path = writer.flush()
    assert path is not None
    assert shards.read_shard(path, vocab_size=vocab).num_rows == len(rows)


def test_single_turn_rows_are_the_engines_ids_scored_by_the_rubric(engine: HFEngine, tmp_path: Path) -> None:
    args = {**LOCAL, "taskset": {"num_tasks": 2}}
    task = VerifiersTask(
        config(max_turn_tokens=24), engine.tokenizer, ENV, env_args=args, chat_template=TEMPLATE
    )
    complete = Recorder(batched(engine))
    prompts = task.prompts()
    try:
        scored, generated = run(task, complete, prompts, n=2)
        foreign, _ = run(task, complete, [Prompt(5, "What is 1+1?", "2")], n=1)
    finally:
        complete.complete.close()
        task.close()
    assert [(p.index, p.text, p.answer) for p in prompts] == [
        (0, "What is 2+3?", "5"),
        (1, "What is 3+4?", "7"),
    ]
    assert not scored.errors and [len(g) for g in scored.groups] == [2, 2]
    rows = [r for g in scored.groups for r in g]
    assert len(complete.made) == 4 and generated == sum(len(c.response_ids) for c in complete.made)
    renderer = ChatRenderer(engine.tokenizer, TEMPLATE)
    for p, group in zip(prompts, scored.groups, strict=True):
        # verifiers' harness sent the task's prompt, and the endpoint rendered it as the template does
        question = renderer.render([{"role": "user", "content": p.text}], [], generation_prompt=True)
        for r in group:
            assert engine.tokenizer.decode(r["prompt_ids"]) == question
            c = next(
                c
                for c in complete.made
                if c.prompt_ids + c.response_ids == r["prompt_ids"] + r["response_ids"]
            )
            assert r["response_ids"] == c.response_ids  # the engine's ids, as it produced them
            assert r["response_logprobs"] == [min(x, 0.0) for x in c.response_logprobs]
            assert r["loss_mask"] == [1] * len(c.response_ids) and r["turn_versions"] == [3]
            assert r["reward"] == pytest.approx(rubric(c.response_text, str(p.answer)), abs=1e-12)
            record = json.loads(r["episode"])
            assert record["agent"] == "verifiers:_verifiers_envs" and record["ended"] == "done"
            assert record["verifiers"]["stop"] == "agent_completed" and record["verifiers"]["turns"] == 1
            assert sum(record["verifiers"]["rewards"].values()) == pytest.approx(r["reward"])
    assert len({r["reward"] for r in rows}) > 1  # the rubric saw each reply, not one constant
    stored(rows, tmp_path, len(engine.tokenizer))
    # a prompt that is not one of the taskset's runs nothing and drops its group, one line saying why
    assert not foreign.groups and "not task 5" in foreign.errors[0]


def test_a_taskset_without_a_harness_plays_with_verifiers_bash_harness_offline(
    engine: HFEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verifiers' default harness (``bash``) provisions its chat program with ``uv`` (installed with pip, else
    downloaded) and the program's packages from the network: a node without one (here: an empty home, so no uv, and
    every proxy a closed port, so neither pip nor curl gets out) failed every episode.  The worker runs the program
    with its own interpreter instead."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(var, "127.0.0.1,localhost")  # the endpoint and verifiers' interception server
    args = {**LOCAL, "taskset": {"num_tasks": 2}}
    task = VerifiersTask(
        config(max_turn_tokens=24), engine.tokenizer, PLAIN, env_args=args, chat_template=TEMPLATE
    )
    harnesses = task.env.config.agent_harnesses()
    assert [type(h).__name__ for h in harnesses.values()] == ["BashHarnessConfig"]  # verifiers' own default
    complete = Recorder(batched(engine))
    try:
        scored, _ = run(task, complete, task.prompts(), n=1)
    finally:
        complete.complete.close()
        task.close()
    rows = [r for g in scored.groups for r in g]
    assert not scored.errors and len(rows) == 2, scored.errors
    for r in rows:
        record = json.loads(r["episode"])
        assert "error" not in record, record
        assert record["verifiers"]["stop"] == "agent_completed" and record["verifiers"]["turns"] >= 1


def test_tool_episode_through_the_mcp_server_is_one_masked_sample(
    engine: HFEngine, lm: Any, tmp_path: Path
) -> None:
    args = {"num_tasks": 1, "tools": True}
    task = VerifiersTask(
        config(max_turn_tokens=96), engine.tokenizer, f"{ENV}:sum_env", env_args=args, chat_template=TEMPLATE
    )
    first = ToolCallFirst(engine, lm)  # the tiny model never writes a tool call: its first turn is scripted
    complete = Recorder(first)
    try:
        scored, generated = run(task, complete, task.prompts(), n=1)
    finally:
        first.complete.close()
        task.close()
    assert not scored.errors and [len(g) for g in scored.groups] == [1]
    (r,) = scored.groups[0]
    call, answer = complete.made
    assert r["turn_versions"] == [3, -1, 3] and r["prompt_ids"] == call.prompt_ids
    model, env, last = list(row_turns(r))
    assert model.ids == call.response_ids and last.ids == answer.response_ids
    assert answer.prompt_ids == call.prompt_ids + call.response_ids + env.ids
    # the call went to verifiers' MCP server, whose result came back as the tool message
    assert engine.tokenizer.decode(env.ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert r["loss_mask"] == [1] * len(model.ids) + [0] * len(env.ids) + [1] * len(last.ids)
    assert generated == len(model.ids) + len(last.ids)
    from rollout_worker.envs.calls import Split

    s = Split(r["prompt_ids"])
    s.turns = [model, env, last]
    assert model_logprob_gap(lm, s) < TOL
    assert r["reward"] == pytest.approx(rubric(answer.response_text, "5"), abs=1e-12)
    record = json.loads(r["episode"])
    assert (record["calls"], record["verifiers"]["turns"], record["splits"]) == (2, 2, 1)
    stored([r], tmp_path, len(engine.tokenizer))


def test_a_call_the_endpoint_refuses_fails_the_episode_with_zero(engine: HFEngine, lm: Any) -> None:
    """``env.max_turns`` = 1: the endpoint refuses the call after the tool's result; verifiers records the failed
    rollout, and its one call is a row with reward 0 and verifiers' error."""
    env = load_env(f"{ENV}:sum_env", {"num_tasks": 1, "tools": True})
    task = VerifiersTask(
        config(max_turn_tokens=96, max_turns=1), engine.tokenizer, env, chat_template=TEMPLATE
    )
    first = ToolCallFirst(engine, lm)
    try:
        scored, _ = run(task, first, task.prompts(), n=1)
    finally:
        first.complete.close()
        task.close()
    (r,) = scored.groups[0]
    record = json.loads(r["episode"])
    assert r["reward"] == 0.0 and r["finish_reason"] == "length" and r["turn_versions"] == [3]
    assert record["ended"] == "error" and "env.max_turns" in record["refused"]
    assert record["error"].startswith("VerifiersRolloutError: ProviderError: upstream 400")
    assert "env.max_turns" in record["error"]


def test_environments_it_cannot_run_are_one_line_errors(engine: HFEngine) -> None:
    with pytest.raises(VerifiersConfigError, match=r"'_verifiers_envs' has no function 'nothing'"):
        load_env(f"{ENV}:nothing")
    with pytest.raises(
        VerifiersConfigError, match=r"'no_such_taskset': cannot load it \(ModuleNotFoundError: taskset"
    ):
        load_env("no_such_taskset")
    with pytest.raises(VerifiersConfigError, match=r"declares 2 agents \(solver, checker\)"):
        VerifiersTask(config(), engine.tokenizer, f"{ENV}:pair_env")


def env_run(root: Path, model: Path, spec: str = ENV) -> Any:
    """A run of ``spec`` from the config alone: no reward section (the rubric scores), two tasks, single turns."""
    cfg = ShardRLConfig.model_validate(
        {
            "model": {"path": str(model)},
            "data": {"task": "env", "max_prompt_length": 64},
            "env": {"verifiers": spec, "verifiers_args": {**LOCAL, "taskset": {"num_tasks": 2}}},
            "run": {"heartbeat_interval_s": 0.5},
            "rollout": {
                "engine": "hf",
                "prompts_per_batch": 2,
                "shard_samples": 4,
                "flush_interval_s": 0.5,
                "max_backlog_samples": 1_000_000,
                "sampling": {"n": 2, "max_response_length": 16},
            },
        }
    )
    return init_run(root, cfg)


def test_a_worker_runs_the_environment_the_config_names(tiny_model_untied: Path, tmp_path: Path) -> None:
    run = env_run(tmp_path / "run", tiny_model_untied)
    assert run.config.reward.function == VERIFIERS_REWARD  # what RUN/config.json says scores
    expected = {p.index: p for p in env_prompts(run.config)}
    assert [(p.text, p.answer) for p in expected.values()] == [("What is 2+3?", "5"), ("What is 3+4?", "7")]
    log = tmp_path / "worker.log"
    proc = spawn(["rollout_worker.worker", "--run", str(run.layout.root), "--slot", "0"], log)
    try:
        rows = wait_for(
            "a shard of episodes", lambda: ready_rows(run) or None, 240, alive=lambda: proc.poll() is None
        )
    finally:
        assert stop(proc, timeout=60) == 0, tail(log)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run.tokenizer_dir))
    assert {json.loads(r["extra"])["prompt_index"] for r in rows} == set(expected)  # a batch is both tasks
    for r in rows:
        p = expected[json.loads(r["extra"])["prompt_index"]]
        assert p.text in r["prompt_text"] and r["answer"] == p.answer  # the taskset's task was the prompt
        record = json.loads(r["episode"])
        assert (
            record["agent"] == "verifiers:_verifiers_envs"
            and record["verifiers"]["task"] == p.extra[TASK_KEY]
        )
        assert set(record["verifiers"]["rewards"]) == {"correct", "brevity"}
        reply = tok.decode(r["response_ids"], skip_special_tokens=True)  # the endpoint's reply to the harness
        assert r["reward"] == pytest.approx(rubric(reply, str(p.answer)), abs=1e-6)  # float32 in the shard


def test_an_environment_that_cannot_load_fails_preflight_in_one_line(
    tiny_model_untied: Path, tmp_path: Path
) -> None:
    good = env_run(tmp_path / "good", tiny_model_untied)
    # init loads the environment now (test_init_loads_the_environment_and_names_every_bad_field); a config edited
    # after init, or an environment gone since, still fails the worker's preflight in one line
    env = good.config.env.model_copy(update={"verifiers": "no_such_taskset"})
    run = dataclasses.replace(good, config=good.config.model_copy(update={"env": env}))
    with pytest.raises(USER_ERRORS) as e:
        preflight(run)
    assert isinstance(e.value, VerifiersConfigError) and "\n" not in str(e.value)
    assert "'no_such_taskset': cannot load it" in str(e.value)
    # preflight's load is the one _start uses: the worker builds its task from the same loaded environment
    loaded, _ = configured_env(good.config)
    from transformers import AutoTokenizer

    from rollout_worker.sources.episodes import make_task

    task = make_task(good.config, AutoTokenizer.from_pretrained(tiny_model_untied))
    try:
        assert task.env is loaded
    finally:
        task.close()
    from rollout_worker.evaluator import eval_prompts

    with pytest.raises(
        ConfigError, match=r"^env.verifiers \('_verifiers_envs'\): the evaluator \(--eval\) does"
    ):
        eval_prompts(good.config)


def test_init_loads_the_environment_and_names_every_bad_field(
    tiny_model_untied: Path, tmp_path: Path
) -> None:
    """``shardrl init`` loads ``env.verifiers`` with its arguments, so a wrong taskset name or argument fails there,
    in one line that names each field pydantic refused, and no run directory is made."""
    with pytest.raises(VerifiersConfigError, match=r"no-such-taskset.*cannot load it") as bad_name:
        env_run(tmp_path / "a", tiny_model_untied, spec="no-such-taskset")
    assert "\n" not in str(bad_name.value) and not (tmp_path / "a").exists()
    from rollout_worker.checks import validate_prompts_file

    cfg = ShardRLConfig.model_validate(
        {
            "model": {"path": str(tiny_model_untied)},
            "data": {"task": "env", "max_prompt_length": 64},
            "env": {"verifiers": ENV, "verifiers_args": {**LOCAL, "taskset": {"num_tasks": 2, "bogus": 1}}},
        }
    )

    with pytest.raises(VerifiersConfigError) as bad_arg:
        validate_prompts_file(cfg)
    message = str(bad_arg.value)
    assert "ValidationError" in message and "bogus" in message and "\n" not in message, message
