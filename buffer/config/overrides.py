"""Dotted command-line overrides (``--trainer.lr 1e-6``), typed by their target field, and the argparse helpers
every command shares."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from .fields import default_cell, field_annotations, members


class ConfigError(ValueError):
    """A user-caused configuration error; its message is one line naming the file and the field."""


def resolve_dtype(dtype: str, cuda: bool) -> str:
    """``model.dtype`` in one process: ``auto`` is bfloat16 where CUDA is visible, float32 on a CPU.

    Resolved per process, not at `shardrl init` (often run on a login node without GPUs): a GPU trainer then
    publishes bf16 and a GPU engine loads bf16, while the CPU demo stays in fp32.
    """
    if dtype != "auto":
        return dtype
    return "bfloat16" if cuda else "float32"


def refuse_sections(overrides: dict[str, str], sections: tuple[str, ...], prog: str, hint: str) -> None:
    """One line for an override of a section this process never reads (it would otherwise pass unnoticed).

    ``hint`` says where a per-process setting goes; a run-wide one can go nowhere but the config of a new run."""
    from .rules import PER_PROCESS_FIELDS  # imported here: rules need the sections, which need this module

    for key in overrides:
        if key.split(".", 1)[0] in sections:
            where = hint
            if key not in PER_PROCESS_FIELDS:
                where = (
                    "it is a run-wide setting, fixed in RUN/config.json by `shardrl init`: set it in the TOML "
                    "config of a new run (no process may change it on a live run)"
                )
            raise ConfigError(
                f"command line: --{key} is a {key.split('.', 1)[0]} setting, which {prog} does not read; {where}"
            )


RUN_ENV = "SHARDRL_RUN"  # the run directory, for every command that takes one

OVERRIDES_HELP = (
    "Config overrides: --section.key VALUE (or --section.key=VALUE), read by the field's type: text fields take "
    "VALUE as it is, other fields as JSON (1e-6, true, [0.9, 0.95]); null clears an optional field."
)


def add_run_dir_option(parser: Any, *aliases: str, required: bool = True) -> None:
    """``--run-dir RUN`` (plus ``aliases``), defaulting to $SHARDRL_RUN: the one spelling of every command."""
    parser.add_argument(
        "--run-dir",
        *aliases,
        dest="run_dir",
        type=Path,
        default=os.environ.get(RUN_ENV) or None,
        required=required and not os.environ.get(RUN_ENV),
        metavar="RUN",
        help=f"the run directory made by `shardrl init` (default ${RUN_ENV})"
        + (f"; {', '.join(aliases)} is the same" if aliases else ""),
    )


def options_help(keys: list[tuple[str, Any]]) -> str:
    """``--key VALUE  description (default ...)`` lines for a command's ``--help``."""
    return "\n".join(
        f"  --{key} VALUE  {f.description or ''} (default {default_cell(f).strip('`')})" for key, f in keys
    )


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["--trainer.lr", "1e-6", "--x.y=2"]`` -> ``{"trainer.lr": "1e-6", "x.y": "2"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"command line: unexpected argument {arg!r}; overrides look like --section.key VALUE"
            )
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {arg} needs a value")
            key, value = arg[2:], args[i + 1]
            i += 2
        out[key] = value
    return out


def split_overrides(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The ``--section.key VALUE`` overrides of a command line, wherever they stand, and the other arguments.

    Taken out before argparse sees the line: an override's value would otherwise be read as a positional RUN.
    """
    picked: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            width = 1 if "=" in arg else 2
            picked += argv[i : i + width]
            i += width
        else:
            rest.append(arg)
            i += 1
    return parse_overrides(picked), rest


def _takes_text(ann: Any) -> bool:
    for m in members(ann):
        if m is str or (get_origin(m) is Literal and any(isinstance(v, str) for v in get_args(m))):
            return True
    return False


def coerce(dotted: str, raw: str) -> Any:
    """A command-line value typed by its target field: text stays text where the field takes text
    (``--model.tokenizer 2024`` is the string "2024"), ``null`` is None where the field allows it, and any other
    field reads the value as JSON (``1e-6``, ``true``, ``[0.9, 0.95]``); what does not parse is left for the
    field's validation to refuse in one line."""
    annotations = field_annotations(dotted)
    if raw == "null" and any(type(None) in members(a) for a in annotations):
        return None
    if not annotations or any(_takes_text(a) for a in annotations):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    """Set each dotted key in ``data`` (a config as TOML/JSON data).  Choosing ``rollout.engine = hf`` here drops the
    file's vLLM section unless the same command line sets a ``rollout.vllm`` key: the command line picks another
    engine, and the settings of the one it replaces do not apply to it."""
    for dotted, raw in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            if node.get(p) is None:  # a section absent, or null in a resolved config (an hf run's vllm)
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"command line: --{dotted}: {p} is not a section")
        node[leaf] = coerce(dotted, raw)
    if overrides.get("rollout.engine") == "hf" and not any(k.startswith("rollout.vllm.") for k in overrides):
        data["rollout"].pop("vllm", None)
    return data


def flatten(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
