"""The checks a user can fail before any engine starts, shared by ``shardrl init`` (``validate_prompts_file``) and
every rollout worker's preflight (``require_answers``), so that both refuse a run with the same line.

Kept apart from ``prompts.py`` and ``rewards.py`` because the checks need both, and neither needs the other's checks.
This module imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

from buffer.config import ShardRLConfig

from .envs import check_tools
from .prompts import Prompt, PromptError, has_chat_template, load_prompts, no_template_message
from .rewards import check_reward_name, needs_answers


def require_answers(cfg: ShardRLConfig, prompts: list[Prompt]) -> None:
    """A one-line ``PromptError`` when ``reward.function`` needs answers and no prompt has one."""
    if needs_answers(cfg.reward.function) and all(p.answer is None for p in prompts):
        raise PromptError(
            f"{cfg.data.prompts_file or cfg.data.task}: no row has an answer at {cfg.data.answer_field!r} "
            f"(data.answer_field), which reward.function = {cfg.reward.function!r} needs"
        )


def validate_prompts_file(cfg: ShardRLConfig) -> list[Prompt]:
    """What ``shardrl init`` checks before it creates a run: the prompts load and render, the reward can score,
    every tool of ``env.tools`` imports, and the environment of ``env.verifiers`` loads with its arguments.

    One-line ``PromptError`` (a ``ConfigError``) naming the file, the row and the field.  The chat template is checked
    on the tokenizer's files when the tokenizer directory already exists (the built-in tiny one is built later and
    has a template).
    """
    check_reward_name(cfg.reward.function)
    check_tools(cfg)
    if cfg.env.verifiers is not None:  # the environment loads here: a wrong taskset or argument fails at init
        from rollout_worker.envs.verifiers_env import env_prompts

        return env_prompts(cfg)
    prompts = load_prompts(cfg.data)
    chat = next((p for p in prompts if p.messages is not None), None)
    tok_dir = Path(cfg.model.tokenizer or cfg.model.path)
    if chat is not None and (tok_dir / "tokenizer_config.json").is_file() and not has_chat_template(tok_dir):
        raise PromptError(no_template_message(str(tok_dir / "tokenizer_config.json"), cfg.data, chat))
    require_answers(cfg, prompts)
    return prompts
