"""Loading a config (TOML or the run's resolved config.json) into a ``ShardRLConfig``, with every failure one line
naming the file or the flag, the field and what would be accepted."""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .fields import fields_at, sections_of, type_text
from .overrides import ConfigError, apply_overrides, flatten
from .rules import PER_PROCESS_FIELDS, ShardRLConfig


def _setting(loc: tuple[Any, ...]) -> str:
    """The dotted key of an error location, without the tags pydantic adds for the variant of a union."""
    models: list[type[BaseModel]] = [ShardRLConfig]
    keys: list[str] = []
    for part in map(str, loc):
        if not any(part in m.model_fields for m in models):
            continue  # a variant's tag, as in algorithm.grpo.clip_low
        keys.append(part)
        models = [
            s for m in models if part in m.model_fields for s in sections_of(m.model_fields[part].annotation)
        ]
    return ".".join(keys)


def _one_line(err: ValidationError, source: str, overrides: dict[str, str], override_source: str) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if not loc and e["type"] == "value_error":  # a cross-field rule: its message names the fields itself
        return f"{source}: {e['ctx']['error']}{more}"
    key = _setting(e["loc"])
    if e["type"] == "extra_forbidden":  # an unknown key is not a setting: name it as it was written
        key = ".".join(filter(None, (_setting(e["loc"][:-1]), str(e["loc"][-1]))))
        flag = next((k for k in overrides if k == key or k.startswith(key + ".")), None)
        if flag is not None:  # a misspelt flag: the file is not at fault
            return f"command line: --{flag}: {key} is not a config key{_accepted(e)}{more}"
        return f"{source}: field {loc}: not a config key{_accepted(e)}{more}"
    if key in overrides:  # the bad value came from the command line, not from the file
        return f"{override_source}: --{key} {overrides[key]}: {e['msg']}{_accepted(e)}{more}"
    return f"{source}: field {loc}: {e['msg']}{_accepted(e)}{more}"


def _accepted(e: Any) -> str:
    """What is accepted, where pydantic's message does not say: the keys of the section an unknown key is in, the
    type and meaning of a missing field."""
    if e["type"] == "extra_forbidden":
        keys = _section_keys(e["loc"][:-1])
        if not keys:
            return ""
        close = difflib.get_close_matches(str(e["loc"][-1]), keys, n=1, cutoff=0.6)
        guess = f" (did you mean {close[0]}?)" if close else ""
        return f"{guess}; accepted keys here: {', '.join(keys)}"
    if e["type"] == "missing":
        fields = fields_at(_setting(e["loc"]))
        if fields:
            f = fields[0]
            return f"; expected {type_text(f.annotation)}" + (f": {f.description}" if f.description else "")
    return ""


def _section_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys of the section at ``loc`` (of the variant a union's tag in ``loc`` names)."""
    models: list[type[BaseModel]] = [ShardRLConfig]
    for part in map(str, loc):
        inner = [
            s for m in models if part in m.model_fields for s in sections_of(m.model_fields[part].annotation)
        ]
        if inner:
            models = inner
            continue
        tagged = [m for m in models if "name" in m.model_fields and m.model_fields["name"].default == part]
        models = tagged or models
    return sorted({k for m in models for k in m.model_fields})


def validate(
    data: dict[str, Any],
    source: str,
    overrides: dict[str, str] | None = None,
    override_source: str = "command line",
) -> ShardRLConfig:
    """The config in ``data``; one ConfigError line naming ``source``, or the flag when an override is at fault."""
    try:
        return ShardRLConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_one_line(err, source, overrides or {}, override_source)) from None


def load_toml(path: str | Path, overrides: dict[str, str] | None = None) -> ShardRLConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); a config is a TOML file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    overrides = overrides or {}
    return validate(apply_overrides(data, overrides), str(path), overrides)


def load_run_config(run_config_json: Path, overrides: dict[str, str] | None = None) -> ShardRLConfig:
    """The run's resolved config with per-process overrides; a change to a run-wide field is refused."""
    try:
        base = json.loads(run_config_json.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{run_config_json}: missing; create the run with `shardrl init RUN --config CFG.toml`"
        ) from None
    overrides = overrides or {}
    source = f"{run_config_json} + command line"
    cfg = validate(apply_overrides(json.loads(json.dumps(base)), overrides), source, overrides, source)
    before, after = flatten(base), flatten(cfg.model_dump(mode="json"))
    for key in overrides:
        if key not in PER_PROCESS_FIELDS and before.get(key) != after.get(key):
            raise ConfigError(
                f"command line: --{key} would change the run-wide setting in {run_config_json} "
                f"({before.get(key)!r} -> {after.get(key)!r}); only per-process settings may differ: "
                + ", ".join(sorted(PER_PROCESS_FIELDS))
            )
    return cfg
