"""Run creation for the application: the storage contract's ``init_run`` plus the built-in tiny model."""

from __future__ import annotations

from pathlib import Path

from buffer.config import ConfigError, ShardRLConfig
from buffer.layout import RunLayout
from buffer.run import Run
from buffer.run import init_run as _contract_init_run


def build_base_model(layout: RunLayout, cfg: ShardRLConfig) -> None:
    from .tiny_model import build_tiny_model, pretrain, pretraining_task

    build_tiny_model(
        layout.base_model,
        tied=cfg.model.path == "tiny-tied",
        seed=cfg.run.seed,
        init_std=cfg.model.tiny_init_std,
    )
    if cfg.model.tiny_pretrain_steps:
        if cfg.data.task == "file":
            raise ConfigError(
                "model.tiny_pretrain_steps: needs a built-in task (data.task max_digit, mod_add or lookup), not a prompts file"
            )
        task = pretraining_task(cfg.data.task)
        pretrain(layout.base_model, task, cfg.model.tiny_pretrain_steps, seed=cfg.run.seed, progress=True)


def init_run(root: str | Path, cfg: ShardRLConfig) -> Run:
    """`shardrl init`: create the run directory, building the tiny model into it when the config asks for it.

    The prompts file is read and checked first, so that no run is created that its workers could not start.
    """
    from rollout_worker.checks import validate_prompts_file

    validate_prompts_file(cfg)
    return _contract_init_run(root, cfg, build_base_model)
