"""The `env` section: multi-turn episodes (tools, an agent through the worker's endpoint, or a verifiers
environment) and the limits of one episode."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .sections import _Section


def _names_a_function(name: str) -> bool:
    """Whether ``name`` reads `package.module:function`."""
    module, _, attr = name.partition(":")
    return bool(module) and attr.isidentifier()


class EnvConfig(_Section):
    """Multi-turn episodes (rollout_worker/envs): tools the model may call, an agent that calls the model through
    an OpenAI-compatible endpoint, or a verifiers environment, and the limits of one episode; off while `tools` is
    empty and `agent` and `verifiers` unset."""

    tools: list[str] = Field(
        default_factory=list,
        description="Tool functions `package.module:function`, shown to the model through the chat template "
        "(`tools=`) and called in a child process; a row's `tools` field may name a subset.",
    )
    agent: str | None = Field(
        None,
        description="An agent `package.module:function`, called per episode as `fn(base_url, row) -> str | None` "
        "with an OpenAI-compatible base URL of the worker's own endpoint; it runs its own tools, and its final "
        "answer is scored by reward.function.  Exclusive with `tools`.",
    )
    verifiers: str | None = Field(
        None,
        description="A verifiers (v0.4, `verifiers.v1`) environment: a taskset id, or `package.module:function` "
        "returning a `verifiers.v1.Env`; its tasks are the prompts (data.task = 'env') and its rubric the reward "
        "(reward.function unset).  The `verifiers` extra.  Exclusive with `tools` and `agent`.",
    )
    verifiers_args: dict[str, Any] = Field(
        default_factory=dict,
        description="The environment's config (the `[env]` block of `vf-eval`), e.g. `{taskset = {num_tasks = "
        '100}, agent = {runtime = {type = "subprocess"}}}`; for a function, its keyword arguments.',
    )
    verifiers_max_tasks: int | None = Field(
        None,
        ge=1,
        description="Train on the first N tasks of env.verifiers' taskset; required when the taskset is infinite.",
    )
    agent_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="Wall time of one agent run; past it the episode ends with reward 0 and its later calls "
        "fail.",
    )
    max_turns: int = Field(
        8,
        ge=1,
        le=1000,
        description="Assistant turns (an agent's model calls) per episode; one past it ends the episode as "
        "truncated.",
    )
    max_turn_tokens: int | None = Field(
        None,
        ge=1,
        description="Generated tokens per assistant turn (an agent's call); default "
        "rollout.sampling.max_response_length.",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Wall time of one tool call; past it the call is killed and reported.",
    )
    tool_memory_mb: int = Field(
        1024, ge=64, description="Address-space limit of the child process running one tool call (MiB)."
    )
    tool_output_chars: int = Field(
        4096, ge=16, description="Characters of a tool's result kept; the rest is cut and the cut is said."
    )

    @field_validator("tools")
    @classmethod
    def _module_function(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _names_a_function(name):
                raise ValueError(f"{name!r} is not `package.module:function`")
        if len(set(v)) != len(v):
            raise ValueError(f"{v!r} names a tool twice")
        return v

    @field_validator("agent")
    @classmethod
    def _agent_module_function(cls, v: str | None) -> str | None:
        if v is not None and not _names_a_function(v):
            raise ValueError(f"{v!r} is not `package.module:function`")
        return v

    @field_validator("verifiers")
    @classmethod
    def _taskset_or_function(cls, v: str | None) -> str | None:
        module, colon, attr = (v or "id").partition(":")
        if not module.strip() or (colon and not attr.isidentifier()):
            raise ValueError(f"{v!r} is neither a taskset id nor `package.module:function`")
        return v

    @model_validator(mode="after")
    def _agent_or_tools(self) -> EnvConfig:
        if self.agent is not None and self.tools:
            raise ValueError(
                "env.agent and env.tools are exclusive: an agent runs its own tools; set one of them"
            )
        if self.verifiers is not None and (self.agent is not None or self.tools):
            raise ValueError(
                "env.verifiers is exclusive with env.agent and env.tools: the environment runs its own agent and "
                "tools; set one of them"
            )
        return self
