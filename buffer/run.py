"""Creating and opening a run directory: run.json and the resolved config.

``shardrl init`` is the only writer of run.json and config.json; every later process opens the run and reads its
config from there (``open_run``), with per-process overrides only.

Opening a run is where its security model is applied (docs/RELIABILITY.md, "Trust"): a run directory (or its
checkpoints, weights, base model or config) that users other than its owner and group may write is refused in one
line, since every process loads what is there; and the process creates files and directories with the run's modes
from then on (``run.file_mode``/``run.dir_mode``/``run.group_shared``).
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import SCHEMA_VERSION
from .config import ConfigError, ShardRLConfig, flatten, load_run_config
from .control import init_state
from .fsio import create_json_exclusive, make_dirs, read_json_or_none, set_modes
from .layout import RunLayout

TINY = ("tiny", "tiny-tied")


@dataclass(frozen=True)
class Run:
    layout: RunLayout
    config: ShardRLConfig
    run_id: str

    @property
    def model_dir(self) -> Path:
        return model_dir(self.layout, self.config)

    @property
    def tokenizer_dir(self) -> Path:
        return Path(self.config.model.tokenizer) if self.config.model.tokenizer else self.model_dir


def model_dir(layout: RunLayout, cfg: ShardRLConfig) -> Path:
    return layout.base_model if cfg.model.path in TINY else Path(cfg.model.path)


def _absolutize(cfg: ShardRLConfig) -> ShardRLConfig:
    """Relative paths in a config are relative to where `shardrl init` ran; the run stores absolute ones."""
    data = cfg.model_dump(mode="json")
    if data["model"]["path"] not in TINY:
        data["model"]["path"] = str(Path(data["model"]["path"]).absolute())
    for section, key in (
        ("model", "tokenizer"),
        ("data", "prompts_file"),
        ("reward", "reward_model"),
        ("trainer", "critic_path"),
        ("eval", "prompts_file"),
    ):
        if data[section][key]:
            data[section][key] = str(Path(data[section][key]).absolute())
    return ShardRLConfig.model_validate(data)


def _with_model_facts(layout: RunLayout, cfg: ShardRLConfig) -> ShardRLConfig:
    mdir = model_dir(layout, cfg)
    cfg_path = mdir / "config.json"
    try:
        model_cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{cfg_path}: missing; model.path must be a HF model directory or `tiny`") from None
    vocab = model_cfg.get("vocab_size")
    if not isinstance(vocab, int):
        raise ConfigError(f"{cfg_path}: field vocab_size missing")
    if cfg.model.vocab_size not in (None, vocab):
        raise ConfigError(f"config: field model.vocab_size is {cfg.model.vocab_size}, the model has {vocab}")
    cfg = cfg.model_copy(deep=True)
    cfg.model.vocab_size = vocab
    return cfg


BaseModelBuilder = Callable[[RunLayout, ShardRLConfig], None]


def init_run(root: str | Path, cfg: ShardRLConfig, build_base_model: BaseModelBuilder | None = None) -> Run:
    """Create the run directory (idempotent for the same config; refuses a conflicting one).

    ``build_base_model`` is called (under the lock) when the config names the built-in tiny model and the run has
    none yet; the contract knows where the base model lives, the application knows how to build one.

    Two `shardrl init` of one run at once (a job array, a demo started twice) are serialised by a lock file: they
    would otherwise both build the tiny model.  flock works across nodes on NFS/Lustre only with locking enabled; the
    files themselves are still created exclusively, so without it the loser fails cleanly instead of corrupting.
    """
    from filelock import FileLock

    layout = RunLayout.of(root)
    set_modes(cfg.run.modes())
    if layout.root.exists():
        check_permissions(layout)
    make_dirs(layout.root)
    with FileLock(str(layout.init_lock), mode=cfg.run.modes().file):
        return _init_locked(layout, _absolutize(cfg), build_base_model)


def _init_locked(layout: RunLayout, cfg: ShardRLConfig, build_base_model: BaseModelBuilder | None) -> Run:
    root = layout.root
    if cfg.model.path in TINY and not (layout.base_model / "config.json").exists():
        if build_base_model is None:
            raise ConfigError(
                f"config: field model.path is {cfg.model.path!r}; the built-in tiny model is built by `shardrl init`"
            )
        build_base_model(layout, cfg)
    cfg = _with_model_facts(layout, cfg)
    resolved = cfg.model_dump(mode="json")
    existing = read_json_or_none(layout.config_json)
    if existing is not None:
        diff = _diff(existing, resolved)
        if diff:
            raise ConfigError(
                f"{layout.config_json}: the run exists with a different config ({diff}); use a new RUN"
            )
        return open_run(root)
    layout.create()
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    create_json_exclusive(layout.config_json, resolved)
    init_state(layout, cfg.run.initial_workers)
    create_json_exclusive(
        layout.run_json, {"run_id": run_id, "schema_version": SCHEMA_VERSION, "created_at": time.time()}
    )
    return open_run(root)


def _diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    fa, fb = flatten(a), flatten(b)
    keys = sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
    return ", ".join(f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in keys[:3]) + (
        " ..." if len(keys) > 3 else ""
    )


def read_run_json(layout: RunLayout) -> dict[str, Any]:
    """run.json of a run this shardrl can read; one ConfigError line otherwise."""
    meta = read_json_or_none(layout.run_json)
    if not isinstance(meta, dict):
        raise ConfigError(
            f"{layout.run_json}: missing or unreadable; create the run with `shardrl init RUN --config CFG`"
        )
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ConfigError(
            f"{layout.run_json}: field schema_version is {meta.get('schema_version')!r}; this shardrl reads run layout "
            f"{SCHEMA_VERSION} only: finish that run with the shardrl that made it, or start a new one with "
            f"`shardrl init NEW_RUN --config {layout.config_json}`"
        )
    return meta


def open_run(root: str | Path, overrides: dict[str, str] | None = None) -> Run:
    """Open an existing run; its config comes from the run directory, plus per-process overrides."""
    layout = RunLayout.of(root)
    meta = read_run_json(layout)
    check_permissions(layout)
    cfg = load_run_config(layout.config_json, overrides)
    set_modes(cfg.run.modes())
    return Run(layout, cfg, str(meta["run_id"]))


def check_permissions(layout: RunLayout) -> None:
    """One ConfigError line when the run directory, or what of it is loaded as code or weights, is writable by
    users other than its owner and group (DCP unpickles checkpoint metadata; weights and config.json are trusted)."""
    for p in (
        layout.root,
        layout.checkpoints,
        layout.weights,
        layout.base_model,
        layout.config_json,
        layout.run_json,
    ):
        try:
            mode = os.stat(p).st_mode
        except FileNotFoundError:
            continue
        if mode & stat.S_IWOTH:
            raise ConfigError(
                f"{p}: writable by every user (mode {stat.S_IMODE(mode):#o}); a run directory is trusted input "
                f"(checkpoints are unpickled, weights and config loaded), so it must be writable only by its "
                f"owner and group: chmod o-w {p}"
            )
