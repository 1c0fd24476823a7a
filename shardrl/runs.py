"""Run creation for the application: the storage contract's ``init_run`` plus the built-in tiny model."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from importlib import metadata
from pathlib import Path

from buffer.config import ConfigError, ShardRLConfig
from buffer.fsio import fsync_dir, tmp_name
from buffer.layout import RunLayout
from buffer.run import Run
from buffer.run import init_run as _contract_init_run

# A directory of built (and pretrained) tiny bases, reused by every run whose config builds the same one: the lookup
# demo's base takes minutes to pretrain on two cores, and a second demo or a test suite need not pay that again.
# Opt-in: a base is keyed by the settings that shape it and by the code and library versions that build it.
CACHE_ENV = "SHARDRL_TINY_CACHE"
_BUILDER_MODULES = ("shardrl.tiny_model", "rollout_worker.tasks", "rollout_worker.envs.episode")


def build_base_model(layout: RunLayout, cfg: ShardRLConfig) -> None:
    cache = os.environ.get(CACHE_ENV)
    if not cache:
        _build(layout.base_model, cfg)
        return
    entry = cached_base(Path(cache), cfg)
    shutil.copytree(entry, layout.base_model, dirs_exist_ok=True)  # copy2: the files keep the run's modes
    for f in layout.base_model.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(layout.base_model)


def cached_base(cache: Path, cfg: ShardRLConfig) -> Path:
    """The tiny base ``cfg`` builds, from ``cache`` or built into it once (processes that ask together wait for the
    first one's build under a lock, so a base is never built twice nor read half-written)."""
    from filelock import FileLock

    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / _key(cfg)
    with FileLock(f"{entry}.lock"):
        if not entry.exists():
            tmp = tmp_name(entry)
            shutil.rmtree(tmp, ignore_errors=True)
            _build(tmp / "base", cfg)
            os.rename(tmp / "base", entry)  # whole or absent: pretraining rewrites the weights in place
            shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _key(cfg: ShardRLConfig) -> str:
    from .tiny_model import pretraining_task

    code = hashlib.sha256()
    for name in _BUILDER_MODULES:  # their source, found without importing them
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        code.update(Path(spec.origin).read_bytes())
    for dist in ("torch", "transformers", "tokenizers"):
        code.update(metadata.version(dist).encode())
    m = cfg.model
    task = pretraining_task(cfg.data.task) if m.tiny_pretrain_steps else "none"
    tied = "tied" if m.path == "tiny-tied" else "untied"
    return f"{tied}-seed{cfg.run.seed}-std{m.tiny_init_std}-{task}{m.tiny_pretrain_steps}-{code.hexdigest()[:16]}"


def _build(out: Path, cfg: ShardRLConfig) -> None:
    from .tiny_model import build_tiny_model, pretrain, pretraining_task

    build_tiny_model(
        out, tied=cfg.model.path == "tiny-tied", seed=cfg.run.seed, init_std=cfg.model.tiny_init_std
    )
    if cfg.model.tiny_pretrain_steps:
        if cfg.data.task == "file":
            raise ConfigError(
                "model.tiny_pretrain_steps: needs a built-in task (data.task max_digit, mod_add or lookup), not a prompts file"
            )
        task = pretraining_task(cfg.data.task)
        pretrain(out, task, cfg.model.tiny_pretrain_steps, seed=cfg.run.seed, progress=True)


def init_run(root: str | Path, cfg: ShardRLConfig) -> Run:
    """`shardrl init`: create the run directory, building the tiny model into it when the config asks for it.

    The prompts file is read and checked first, so that no run is created that its workers could not start.
    """
    from rollout_worker.checks import validate_prompts_file

    validate_prompts_file(cfg)
    return _contract_init_run(root, cfg, build_base_model)
