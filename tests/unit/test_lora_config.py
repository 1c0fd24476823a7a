"""LoRA settings, the base fingerprint and what an engine does with a weights directory (no model is built)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from buffer import weights
from buffer.config import LORA_TARGETS, ConfigError, apply_overrides, reference_markdown, validate
from buffer.layout import RunLayout
from rollout_worker.engines.base import EngineError, plan_load
from rollout_worker.engines.vllm import llm_kwargs, max_lora_rank
from trainer.lora import base_name, is_adapter_param, peft_name

BASE = {"reward": {"function": "max_digit"}}


def _cfg(**overrides: str):  # type: ignore[no-untyped-def]
    return validate(apply_overrides(json.loads(json.dumps(BASE)), overrides), "test")


def test_lora_is_off_by_default_and_one_flag_turns_it_on() -> None:
    off = _cfg()
    assert off.model.lora.rank == 0 and not off.model.lora.enabled
    assert off.model.lora.target_modules == list(LORA_TARGETS)
    assert not off.trainer.critic_lora.enabled
    on = _cfg(**{"model.lora.rank": "8", "trainer.critic_lora.rank": "4", "trainer.critic_lora.alpha": "8"})
    assert on.model.lora.enabled and on.model.lora.rank == 8 and on.model.lora.merge_every == 0
    assert (on.trainer.critic_lora.rank, on.trainer.critic_lora.alpha) == (4, 8.0)
    assert (
        "`model.lora.rank`" in reference_markdown() and "`trainer.critic_lora.rank`" in reference_markdown()
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model.lora.merge_every": "2"}, "field model.lora: Value error, merge_every (2) needs rank > 0"),
        ({"model.lora.rank": "-1"}, "field model.lora.rank"),
        ({"model.lora.rank": "8", "model.lora.dropout": "1"}, "field model.lora.dropout"),
        ({"model.lora.rank": "8", "model.lora.target_modules": "[]"}, "field model.lora.target_modules"),
        ({"model.lora.ranks": "8"}, "field model.lora.ranks"),
    ],
)
def test_bad_lora_settings_are_one_line(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        _cfg(**overrides)
    assert "\n" not in str(err.value)


def test_adapter_names_are_peft_names() -> None:
    name = "model.layers.3.mlp.down_proj.lora_B.default.weight"
    assert is_adapter_param(name) and not is_adapter_param("model.layers.3.mlp.down_proj.base_layer.weight")
    assert peft_name(name) == "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
    assert (
        base_name("model.layers.3.mlp.down_proj.base_layer.weight") == "model.layers.3.mlp.down_proj.weight"
    )
    assert base_name("model.norm.weight") == "model.norm.weight"


def test_vllm_gets_lora_at_a_rank_it_has_kernels_for() -> None:
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(EngineError, match="above the largest LoRA rank"):
        max_lora_rank(1000)
    kwargs = llm_kwargs(Path("m"), dtype="float32", seed=0, max_model_len=64, options={}, lora_rank=4)
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (True, 8, 1)
    assert "enable_lora" not in llm_kwargs(Path("m"), dtype="float32", seed=0, max_model_len=64, options={})


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen2"}')
    (base / "model.safetensors").write_bytes(b"x" * 100)
    return base


def test_base_hash_sees_config_and_file_sizes_not_times(tmp_path: Path) -> None:
    base = _base(tmp_path)
    h = weights.base_model_hash(base)
    os.utime(base / "model.safetensors", (1, 1))
    (base / "README.md").write_text("not a weight")
    assert weights.base_model_hash(base) == h
    (base / "model.safetensors").write_bytes(b"x" * 101)
    assert weights.base_model_hash(base) != h
    (base / "model.safetensors").write_bytes(b"x" * 100)
    (base / "config.json").write_text('{"model_type": "llama"}')
    assert weights.base_model_hash(base) != h
    with pytest.raises(weights.WeightsError, match=r"config\.json: missing"):
        weights.base_model_hash(tmp_path)


def _adapter_files(d: Path, rank: int = 8) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "peft_type": "LORA"}))
    (d / "adapter_model.safetensors").write_bytes(b"\0" * 16)


def _publish(layout: RunLayout, version: int, kind: str, base_sha: str | None) -> Path:
    staging = weights.staging_dir(layout, version)
    adapter = None
    if kind in ("adapter", "merged"):
        adapter = "." if kind == "adapter" else "adapter"
        _adapter_files(staging / adapter)
    if kind in ("full", "merged"):
        (staging / "model.safetensors").write_bytes(b"\0" * 16)
    weights.commit_version(
        layout, version, staging, step=version, dtype="float32",
        kind="adapter" if kind == "adapter" else "full", adapter=adapter, base_model="b", base_sha256=base_sha,
    )  # fmt: skip
    return layout.weight_version(version)


def test_what_an_engine_does_with_each_kind_of_version(tmp_path: Path) -> None:
    base = _base(tmp_path)
    sha = weights.base_model_hash(base)
    layout = RunLayout.of(tmp_path / "run")
    adapter, merged = _publish(layout, 1, "adapter", sha), _publish(layout, 2, "merged", sha)
    full, foreign = _publish(layout, 3, "full", None), _publish(layout, 4, "adapter", "0" * 64)
    lora = {"lora_rank": 8, "base_sha256": sha, "base_dir": base}
    plain = {"lora_rank": 0, "base_sha256": None, "base_dir": base}

    assert (plan_load(adapter, **lora).what, plan_load(adapter, **lora).path) == ("adapter", adapter)
    assert plan_load(merged, **lora).path == merged / "adapter"  # a LoRA engine keeps its base
    assert plan_load(merged, **plain).what == "full" and plan_load(full, **plain).path == full
    with pytest.raises(EngineError, match="trained on another base model; refused"):
        plan_load(foreign, **lora)
    with pytest.raises(EngineError, match=r"full weights without a LoRA adapter"):
        plan_load(full, **lora)
    with pytest.raises(EngineError, match=r"started without LoRA \(model.lora.rank = 0\)"):
        plan_load(adapter, **plain)
    with pytest.raises(EngineError, match=r"field r is 8, above the rank this engine was started for \(4"):
        plan_load(adapter, **{**lora, "lora_rank": 4})
    handmade = tmp_path / "handmade"  # no manifest (a benchmark's directory): no base to check
    _adapter_files(handmade)
    assert plan_load(handmade, **lora).what == "adapter"
    manifest = json.loads((adapter / weights.MANIFEST).read_text())
    assert (manifest["kind"], manifest["adapter"], manifest["base_sha256"]) == ("adapter", ".", sha)


def test_plan_load_refuses_a_delta_version_in_one_line(tmp_path: Path) -> None:
    from buffer.deltas import DELTA_RECORD

    delta = tmp_path / "v000002"
    delta.mkdir()
    (delta / DELTA_RECORD).write_text("{}")
    with pytest.raises(EngineError, match=r"v000002: a delta version .*NodeCache\.materialise"):
        plan_load(delta, lora_rank=0, base_sha256=None, base_dir=tmp_path)
