"""Introspection of the config models: the alternatives of an annotation, the fields at a dotted key, a field's
type and default as text.  Shared by the override parser, the error lines and the generated reference."""

from __future__ import annotations

import json
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from .rules import ShardRLConfig


def members(ann: Any) -> list[Any]:
    """The alternatives of an annotation: ``A | B``, ``Optional[A]`` and ``Annotated[...]`` unwrapped."""
    if get_origin(ann) is Annotated:
        return members(get_args(ann)[0])
    if get_origin(ann) in (Union, types.UnionType):
        return [m for arg in get_args(ann) for m in members(arg)]
    return [ann]


def sections_of(ann: Any) -> list[type[BaseModel]]:
    return [m for m in members(ann) if isinstance(m, type) and issubclass(m, BaseModel)]


def field_annotations(dotted: str) -> list[Any]:
    """The annotations of the field at ``dotted`` (several where a section is a union of models); [] if unknown."""
    models: list[type[BaseModel]] = [ShardRLConfig]
    *parents, leaf = dotted.split(".")
    for part in parents:
        models = [
            s for m in models if part in m.model_fields for s in sections_of(m.model_fields[part].annotation)
        ]
    return [m.model_fields[leaf].annotation for m in models if leaf in m.model_fields]


def fields_at(dotted: str) -> list[Any]:
    models: list[type[BaseModel]] = [ShardRLConfig]
    *parents, leaf = dotted.split(".")
    for part in parents:
        models = [
            s for m in models if part in m.model_fields for s in sections_of(m.model_fields[part].annotation)
        ]
    return [m.model_fields[leaf] for m in models if leaf in m.model_fields]


def type_text(ann: Any) -> str:
    parts = []
    for m in members(ann):
        if get_origin(m) is Literal:
            parts.append("one of " + ", ".join(repr(v) for v in get_args(m)))
        elif isinstance(m, type) and issubclass(m, BaseModel):
            parts.append(f"a section ({', '.join(m.model_fields)})")
        else:
            parts.append("null" if m is type(None) else getattr(m, "__name__", str(m)))
    return " or ".join(parts)


def section_fields(section: str) -> list[tuple[str, Any]]:
    """``(dotted key, pydantic field)`` of every setting under ``section`` (e.g. "trainer", "rollout"), nested
    sections and the variants of a union included, each key once."""
    out: dict[str, Any] = {}

    def walk(models: list[type[BaseModel]], prefix: str) -> None:
        for model in models:
            for name, f in model.model_fields.items():
                subs = sections_of(f.annotation)
                if subs:
                    walk(subs, f"{prefix}.{name}")
                else:
                    out.setdefault(f"{prefix}.{name}", f)

    walk(sections_of(ShardRLConfig.model_fields[section].annotation), section)
    return list(out.items())


def discriminator(variants: list[type[BaseModel]]) -> str | None:
    """The field that tells the variants of a union apart: a one-value Literal in each of them."""
    for name in variants[0].model_fields:
        if all(
            name in v.model_fields
            and get_origin(v.model_fields[name].annotation) is Literal
            and len(get_args(v.model_fields[name].annotation)) == 1
            for v in variants
        ):
            return name
    return None


def default_cell(f: Any) -> str:
    return "required" if f.is_required() else f"`{json.dumps(f.get_default(call_default_factory=True))}`"
