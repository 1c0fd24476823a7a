"""What a worker checks before its engine starts: every error a user can make, as one line."""

from __future__ import annotations

from pathlib import Path

from buffer.config import ConfigError, ShardRLConfig
from buffer.run import Run
from rollout_worker.checks import require_answers
from rollout_worker.engines import resolve_kind
from rollout_worker.engines.base import EngineError, require_model_dir
from rollout_worker.envs import check_tools
from rollout_worker.prompts import Prompt, PromptError, load_prompts
from rollout_worker.rewards import RewardConfigError, Scorer, make_scorer

USER_ERRORS = (ConfigError, PromptError, RewardConfigError, EngineError)


def preflight(run: Run) -> tuple[list[Prompt], Scorer]:
    """Every check a user can fail before any engine starts: model, prompts, reward, tools.  One-line errors."""
    cfg = run.config
    resolve_kind(cfg.rollout.engine)
    require_model_dir(run.model_dir, "model directory (model.path)")
    if cfg.model.tokenizer:
        require_model_dir(run.tokenizer_dir, "tokenizer directory (model.tokenizer)")
    prompts = run_prompts(cfg)
    scorer = make_scorer(cfg.reward)
    check_tools(cfg)
    require_answers(cfg, prompts)
    if cfg.reward.reward_model and not (Path(cfg.reward.reward_model) / "config.json").is_file():
        raise RewardConfigError(
            f"{cfg.reward.reward_model}: reward.reward_model is not a HF model directory (no config.json)"
        )
    return prompts, scorer


def run_prompts(cfg: ShardRLConfig) -> list[Prompt]:
    """The run's prompts: the data source's, or with ``env.verifiers`` the environment's tasks (loaded here first,
    and kept for ``_start``: ``verifiers_env.configured_env``)."""
    if cfg.env.verifiers is None:
        return load_prompts(cfg.data)
    from rollout_worker.envs.verifiers_env import env_prompts

    return env_prompts(cfg)
