"""A config a user would write for a real model, run end to end on the tiny model: a model directory path (not the
built-in `tiny`), a chat-format JSONL prompts file with nested answers, and the `math_answer` reward.

Everything goes through the user's commands: `shardrl tiny-model`, `shardrl init`, the rollout supervisor and the
trainer as separate processes.  The audit recomputes every stored reward with the grader from the published text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from buffer import plans, shards
from buffer.layout import RunLayout
from rollout_worker.rewards import Sample, math_answer

from ._common import shardrl
from ._rollout_helpers import spawn, tail, wait_for

QUESTIONS = [("What is 2+3?", "5"), ("Half of 1?", "\\frac12"), ("10^3 = ?", "1000"), ("7-7?", "0")]


def _config(tmp: Path, model: Path) -> Path:
    prompts = tmp / "math.jsonl"
    with prompts.open("w") as f:
        for q, a in QUESTIONS:
            row = {
                "messages": [{"role": "user", "content": q}],
                "reward_model": {"ground_truth": a},
                "source": "hand",
            }
            f.write(json.dumps(row) + "\n")
    cfg = tmp / "math.toml"
    cfg.write_text(
        f"""
[model]
path = "{model}"
dtype = "float32"
[data]
task = "file"
prompts_file = "{prompts}"
prompt_field = "messages"
answer_field = "reward_model.ground_truth"
chat_template = true
max_prompt_length = 64
[reward]
function = "math_answer"
[rollout]
engine = "hf"
prompts_per_batch = 2
shard_samples = 8
flush_interval_s = 1.0
max_backlog_samples = 64
[rollout.sampling]
n = 4
max_response_length = 12
[trainer]
samples_per_step = 8
max_staleness = 100
total_steps = 2
save_every = 100
lr = 1e-4
"""
    )
    return cfg


def test_chat_prompts_with_math_answer_train_end_to_end(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    shardrl("tiny-model", model, cwd=tmp_path, check=True)
    run = tmp_path / "run"
    shardrl("init", run, "--config", _config(tmp_path, model), cwd=tmp_path, check=True)
    layout = RunLayout.of(run)
    logs = tmp_path / "logs"
    logs.mkdir()
    sup = spawn(["rollout_worker", "--run-dir", str(run)], logs / "rollout.log")
    trainer = spawn(["trainer", "--run-dir", str(run), "--max-steps", "2"], logs / "trainer.log")
    try:
        assert trainer.wait(timeout=600) == 0, tail(logs / "trainer.log")
        wait_for("two plans", lambda: len(plans.valid_plans(layout)) >= 2, 30)
    finally:
        for p in (sup, trainer):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)

    tables = [shards.read_shard(layout.ready_shard(s.name)) for s in shards.list_ready(layout)]
    rows = pa.concat_tables(tables).to_pylist()
    assert rows, tail(logs / "rollout.log")
    answers = {a for _, a in QUESTIONS}
    for r in rows:
        # the chat template rendered the messages, and the nested answer reached the shard
        assert "<|im_start|>user" in r["prompt_text"] and r["answer"] in answers
        sample = Sample(prompt=r["prompt_text"], finish_reason=r["finish_reason"])
        expected = math_answer(r["response_text"], r["answer"], extra={"source": "hand"}, sample=sample)
        assert r["reward"] == expected, r
    consumed = {i for p in plans.valid_plans(layout).values() for i in plans.sample_ids_of(layout, p)}
    assert len(consumed) == 16 and consumed <= {r["sample_id"] for r in rows}
