"""The markdown config reference embedded in the README, generated from the models so that it cannot drift."""

from __future__ import annotations

import json
from typing import Any, get_args

from pydantic import BaseModel

from .fields import default_cell, discriminator, sections_of
from .rules import PER_PROCESS_FIELDS, ShardRLConfig


def reference_markdown() -> str:
    """The config reference, generated from the models so that it cannot drift from the code."""
    lines: list[str] = [
        "Per-process settings (a process may set them on its own command line; every other key is fixed in "
        "RUN/config.json by `shardrl init`): " + ", ".join(f"`{k}`" for k in sorted(PER_PROCESS_FIELDS)) + "."
    ]

    def table(title: str, doc: str | None, rows: list[str]) -> None:
        if rows:
            lines.append(f"\n**[{title}]**{doc}\n")
            lines.append("| key | default | meaning |\n|---|---|---|")
            lines.extend(rows)

    def walk(
        model: type[BaseModel], prefix: str, variant: str = "", skip: frozenset[str] = frozenset()
    ) -> None:
        rows = []
        subs = []
        for name, f in model.model_fields.items():
            sections = sections_of(f.annotation)
            if sections:
                subs.append((name, sections))
            elif name not in skip:
                rows.append(_row(prefix + name, f))
        table(prefix.rstrip("."), f"{variant} {(model.__doc__ or '').strip()}", rows)
        for name, sections in subs:
            key = discriminator(sections) if len(sections) > 1 else None
            if key is None:
                for sub in sections:
                    walk(sub, f"{prefix}{name}.")
                continue
            # The keys every variant has alike are listed once, before the variants, so that each variant's table
            # shows only what tells it apart (its tag and its own keys).
            shared = _shared(sections)
            base = next(c for c in sections[0].__mro__ if all(issubclass(s, c) for s in sections))
            doc = f" {(base.__doc__ or '').strip()}"
            table(
                f"{prefix}{name}",
                doc,
                [_row(f"{prefix}{name}.{k}", sections[0].model_fields[k]) for k in shared],
            )
            for sub in sections:
                tag = f" {key} = {json.dumps(get_args(sub.model_fields[key].annotation)[0])}:"
                walk(sub, f"{prefix}{name}.", tag, frozenset(shared))

    walk(ShardRLConfig, "")
    return "\n".join(lines).strip() + "\n"


def _row(key: str, f: Any) -> str:
    return f"| `{key}` | {default_cell(f)} | {f.description or ''} |"


def _shared(variants: list[type[BaseModel]]) -> list[str]:
    """The plain keys every variant of a union has with the same default and meaning."""
    first, *rest = variants
    return [
        name
        for name, f in first.model_fields.items()
        if not sections_of(f.annotation)
        and all(
            name in v.model_fields
            and default_cell(v.model_fields[name]) == default_cell(f)
            and v.model_fields[name].description == f.description
            for v in rest
        )
    ]
