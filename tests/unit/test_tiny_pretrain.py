"""Pretraining the built-in tiny model on the other built-in task (``model.tiny_pretrain_steps``, used by
``shardrl demo --lora``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from buffer.config import ConfigError, ShardRLConfig
from rollout_worker.tasks import task_prompts
from shardrl.runs import init_run
from shardrl.tiny_model import build_tiny_model, pretrain


def _digit_probs(model_dir: Path, task: str) -> torch.Tensor:
    """[prompts, 10]: the probability of each digit token after each of ``task``'s prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tok(t.prompt)["input_ids"] for t in task_prompts(task)])
    digits = torch.tensor([tok(str(d))["input_ids"][0] for d in range(10)])
    with torch.no_grad():
        return model(ids).logits[:, -1].softmax(-1)[:, digits]


def test_pretraining_teaches_the_answer_format(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", tied=True)
    before = float(_digit_probs(base, "max_digit").sum(-1).mean())
    taught = shutil.copytree(base, tmp_path / "taught")
    pretrain(taught, "mod_add", 80, seed=3)  # the format is in by 60 (own 0.9997; the other task 0.143)
    own = float(_digit_probs(taught, "mod_add").sum(-1).mean())
    after = _digit_probs(
        taught, "max_digit"
    )  # the task it was not trained on: the format carries over in part
    assert before < 0.1 and own > 0.8 and float(after.sum(-1).mean()) > 2 * before, (
        before,
        own,
        after.sum(-1),
    )
    assert not list(taught.glob(".tmp*")) and (taught / "tokenizer.json").is_file()


def test_pretraining_is_deterministic(tmp_path: Path) -> None:
    """Twenty steps twice from the same base and seed give the same model to the bit, and one that moved."""
    base = build_tiny_model(tmp_path / "base", tied=True)
    for name in ("one", "two"):
        pretrain(shutil.copytree(base, tmp_path / name), "mod_add", 20, seed=3)
    one, two = (_digit_probs(tmp_path / name, "max_digit") for name in ("one", "two"))
    assert torch.equal(one, two) and not torch.equal(one, _digit_probs(base, "max_digit"))


def test_pretraining_needs_a_built_in_task(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "answer": "1"}\n')
    cfg = ShardRLConfig.model_validate(
        {
            "model": {"path": "tiny", "tiny_pretrain_steps": 5},
            "data": {"task": "file", "prompts_file": str(prompts)},
            "reward": {"function": "exact_match"},
        }
    )
    with pytest.raises(ConfigError, match=r"model\.tiny_pretrain_steps"):
        init_run(tmp_path / "run", cfg)


def test_pretraining_shows_its_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's first minutes are the base's pretraining: it says so on stderr, the last step always."""
    model = build_tiny_model(tmp_path / "m", seed=0, init_std=0.02)
    pretrain(model, "lookup", 3, seed=0, progress=True)
    err = capsys.readouterr().err
    assert "pretraining the tiny base on lookup: step 3/3, loss" in err
    pretrain(model, "mod_add", 2, seed=0)  # without progress: silent
    assert "pretraining the tiny base" not in capsys.readouterr().err
