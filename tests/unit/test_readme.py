"""The README's config reference is generated from the config models, and the demo settings it states are the demo
config's; these keep each from drifting."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from buffer.config import flatten, load_toml, reference_markdown

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEMO = ROOT / "shardrl" / "configs" / "demo.toml"


def test_config_reference_in_readme_is_current():
    text = README.read_text()
    begin, end = "<!-- config-reference:begin -->\n", "<!-- config-reference:end -->"
    embedded = text[text.index(begin) + len(begin) : text.index(end)]
    assert embedded.strip() == reference_markdown().strip(), (
        "README config reference is stale: regenerate it from buffer.config.reference_markdown()"
    )


def test_readme_starts_with_the_two_commands():
    head = README.read_text().split("\n## ")[0]
    assert "make demo" in head and "make test" in head


def _demo_settings_paragraph() -> str:
    paragraphs = README.read_text().split("\n\n")
    (para,) = [p for p in paragraphs if p.startswith("Settings chosen")]
    return para


def test_demo_settings_stated_in_the_readme_are_the_demo_config():
    para = " ".join(_demo_settings_paragraph().split())
    cfg = flatten(load_toml(DEMO).model_dump(mode="json"))
    stated = re.findall(r"`([a-z_]+(?:\.[a-z_]+)+) = ([^`]+)`", para)
    assert len(stated) >= 15, stated
    for key, value in stated:
        assert key in cfg, f"README names {key}, which the config does not have"
        assert cfg[key] == tomllib.loads(f"v = {value}")["v"], (
            f"README says {key} = {value}, demo.toml {cfg[key]!r}"
        )
    # the prose numbers too
    prompts, n = map(int, re.findall(r"(\d+) prompts x (\d+) samples per step", para)[0])
    assert (prompts, n) == (cfg["rollout.prompts_per_batch"], cfg["rollout.sampling.n"])
    assert "shardrl/configs/demo.toml" in para
