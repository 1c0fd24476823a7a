"""The README's config reference is generated from the config models; this keeps the two from drifting."""

from __future__ import annotations

from pathlib import Path

from buffer.config import reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


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
