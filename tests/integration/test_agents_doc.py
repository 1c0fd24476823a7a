"""docs/AGENTS.md's three examples, run as they stand there: every block under a ``<!-- file: NAME -->`` line is
written out unchanged, the configs are loaded as ``shardrl init`` loads them (``--model.path`` the one override),
and one batch of each environment runs on a real engine (transformers, the tiny model, on the CPU) through the
task the worker builds from the config.  The tiny random model rarely writes a well-formed call, so the tool
example's tool is also run through the worker's sandbox, and its reward on a conversation that used it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from buffer.config import ShardRLConfig, load_toml
from rollout_worker.engines.base import SamplingSpec
from rollout_worker.engines.hf import HFEngine
from rollout_worker.engines.spec import EngineSpec
from rollout_worker.envs.tools import resolve_tools
from rollout_worker.prompts import EncodedPrompt, load_prompts
from rollout_worker.sources.episodes import make_complete, make_task

from ._common import importable

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "AGENTS.md"
BLOCK = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", re.S)


def doc_files() -> dict[str, str]:
    return dict(BLOCK.findall(DOC.read_text()))


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The doc's files in one directory, importable here and in the processes the worker starts."""
    where = tmp_path_factory.mktemp("agents-doc")
    for name, text in doc_files().items():
        (where / name).write_text(text)
    with importable(where):
        yield where


@pytest.fixture(scope="module")
def engine(tiny_model_untied: Path) -> Iterator[HFEngine]:
    e = HFEngine(EngineSpec("hf", tiny_model_untied, max_model_len=1024, device="cpu"))
    yield e
    e.close()


def config(examples: Path, name: str, model: Path, monkeypatch: pytest.MonkeyPatch) -> ShardRLConfig:
    monkeypatch.chdir(examples)  # relative paths in the configs, as when `shardrl init` runs there
    return load_toml(examples / name, {"model.path": str(model)})


def prompts(cfg: ShardRLConfig) -> list[EncodedPrompt]:
    if cfg.data.task == "env":
        from rollout_worker.envs.verifiers_env import env_prompts

        return [EncodedPrompt(p, [1]) for p in env_prompts(cfg)]
    return [EncodedPrompt(p, [1]) for p in load_prompts(cfg.data)]


def close(*parts: Any) -> None:
    """As the worker's episode source closes its task and completer: those that have something to close."""
    for part in parts:
        getattr(part, "close", lambda: None)()


def rows_of(scored: Any) -> list[dict[str, Any]]:
    assert not scored.errors, scored.errors
    return [r for g in scored.groups for r in g]


def endpoint_batch(cfg: ShardRLConfig, engine: HFEngine, prefix: str) -> tuple[list[Any], int]:
    """One batch of an endpoint environment (an agent, a verifiers harness), as the worker's episode source runs
    it on a batch engine: the groups' rows and the tokens generated."""
    task = make_task(cfg, engine.tokenizer)
    complete = make_complete(engine, engine.tokenizer, streaming=False)
    try:
        scored, generated = task.run_batch(
            complete, prompts(cfg), SamplingSpec(n=2, seed=5), lambda: 0, group_prefix=prefix, epoch=1
        )
    finally:
        close(complete, task)
    rows_of(scored)
    return scored.groups, generated


def test_the_doc_names_every_file_its_configs_use() -> None:
    files = doc_files()
    assert set(files) == {
        "letters.py",
        "count_letter.schema.json",
        "letters.jsonl",
        "letters.toml",
        "checker.py",
        "checker.toml",
        "spelling.py",
        "spelling.toml",
    }


def test_the_tool_example(
    examples: Path, engine: HFEngine, tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(examples, "letters.toml", tiny_model_untied, monkeypatch)
    # the schema the doc shows is the one the worker derives from the function
    shown = json.loads((examples / "count_letter.schema.json").read_text())
    assert [t.schema for t in resolve_tools(cfg.env.tools)] == [shown]
    task = make_task(cfg, engine.tokenizer)
    try:
        result = task.runner.run("letters:count_letter", {"word": "strawberry", "letter": "r"})
        scored, generated = task.run_batch(
            engine.generate,
            prompts(cfg),
            SamplingSpec(n=2, seed=5),
            lambda: 0,
            group_prefix="w0.d.0",
            epoch=1,
        )
    finally:
        close(task)
    assert (result.error, result.content) == (None, "3")
    rows = rows_of(scored)
    assert [len(g) for g in scored.groups] == [2, 2] and generated > 0
    assert all(r["reward"] in (0.0, 0.5, 1.0) and json.loads(r["episode"])["turns"] >= 1 for r in rows)

    import letters  # the doc's reward: the whole conversation decides, not only the last reply

    used = SimpleNamespace(messages=[{"role": "tool", "content": "3"}])
    assert letters.reward("It occurs 3", "3", extra={}, sample=used) == 1.0
    assert letters.reward("It occurs 3", "3", extra={}, sample=object()) == 0.5
    assert letters.reward("It occurs 2", "3", extra={}, sample=used) == 0.0


def test_the_agent_example(
    examples: Path, engine: HFEngine, tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(examples, "checker.toml", tiny_model_untied, monkeypatch)
    groups, generated = endpoint_batch(cfg, engine, "w0.d.1")
    rows = [r for g in groups for r in g]
    assert len(groups) == 2 and generated > 0
    for r in rows:
        record = json.loads(r["episode"])
        assert record["calls"] == 2 and "error" not in record, record  # the answer, then the check
        assert "Check your answer" in r["prompt_text"] + r["response_text"] or record["splits"] > 1


def test_the_verifiers_example(
    examples: Path, engine: HFEngine, tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("verifiers")
    cfg = config(examples, "spelling.toml", tiny_model_untied, monkeypatch)
    groups, generated = endpoint_batch(cfg, engine, "w0.d.2")
    rows = [r for g in groups for r in g]
    assert [len(g) for g in groups] == [2, 2] and generated > 0
    for r in rows:
        record = json.loads(r["episode"])
        assert "error" not in record and record["verifiers"]["stop"] == "agent_completed", record
        assert set(record["verifiers"]["rewards"]) == {"reversed_word"}


def test_the_readmes_verifiers_example_is_the_one_run_here() -> None:
    readme = (ROOT / "README.md").read_text()
    indented = "".join(
        ("  " + line if line.strip() else line) for line in doc_files()["spelling.toml"].splitlines(True)
    )
    assert indented in readme
