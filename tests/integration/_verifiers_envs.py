"""A small environment of the ``verifiers`` library (its v1 API) for tests/integration/test_verifiers_env.py,
written as an environment author would write one, with nothing of shardrl in it.

The module is a verifiers taskset package: ``__all__`` exports its ``Taskset`` and the harness it plays with, and
its name is the taskset id, ``_verifiers_envs``.  verifiers resolves an id as a top-level module, so this
directory must be on ``sys.path`` (and on ``PYTHONPATH`` for the tool server's process).  Tasks ask for a sum;
the rubric is two weighted rewards on the final reply.  With ``taskset.task.tools = true`` each rollout also gets
an MCP tool server (``AddToolset``, started as ``python -m _verifiers_envs``) offering ``add``.  ``sum_env``
builds the environment in code; ``pair_env`` is one with two agents per episode.

``LocalChatHarness`` is verifiers' own ``null`` harness (its bundled chat program: streaming Chat Completions,
MCP tools, the tool gate), run by this interpreter instead of an interpreter that ``uv`` provisions from the
network.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

PROGRAM = "vf_chat_program.py"  # in the rollout's runtime directory


class SumData(vf.TaskData):
    answer: str


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is advertised as plain ``add``

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumTaskConfig(vf.TaskConfig):
    tools: bool = False
    """Give each rollout the ``add`` tool server."""
    toolset: vf.ToolsetConfig = vf.ToolsetConfig()


class SumTask(vf.Task[SumData, vf.State, SumTaskConfig]):
    @classmethod
    def toolsets(cls, config: SumTaskConfig) -> list[vf.Toolset]:
        return [AddToolset(config.toolset)] if config.tools else []

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        return brevity(trace.last_reply)


def brevity(reply: str) -> float:
    """The ``brevity`` reward of a final reply (the test recomputes it from the engine's text)."""
    return 1.0 / (1.0 + len(reply))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 3
    task: SumTaskConfig = SumTaskConfig()


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [
            SumTask(SumData(prompt=f"What is {i + 2}+{i + 3}?", answer=str(2 * i + 5)), self.config.task)
            for i in range(self.config.num_tasks)
        ]


class LocalChatHarness(NullHarness):
    """The ``null`` harness's chat program, run by ``sys.executable`` (which has its few packages)."""

    async def setup(self, runtime: vf.Runtime) -> None:
        await runtime.write(PROGRAM, CHAT_PROGRAM_SOURCE.encode())

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        argv = [
            sys.executable,
            PROGRAM,
            f"--base-url={endpoint}",
            f"--api-key={secret}",
            f"--model={ctx.model}",
        ]
        if tool_interception_url:
            argv.append(f"--tool-interception-url={tool_interception_url}")
        if system_prompt:
            argv.append(f"--system-prompt={system_prompt}")
        if mcp_urls:
            servers = {
                name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()
            }
            argv.append("--mcp-config=" + json.dumps({"mcpServers": servers}))
        if isinstance(prompt, str):
            argv.append(f"--prompt={prompt}")
        elif prompt is not None:
            path = f"initial-messages-{trace.id}.json"
            await runtime.write(path, json.dumps([message_to_wire(m) for m in prompt]).encode())
            argv.append(f"--initial-messages-file={path}")
        return await runtime.run_program(argv, dict(self.config.resolved_env))


def sum_env(num_tasks: int = 2, tools: bool = False, **env: Any) -> vf.Env:
    """The environment built in code (the ``package.module:function`` form): this taskset, its harness on the
    local machine, and ``env``'s other settings."""
    config = {
        **env,
        "taskset": {"id": __name__, "num_tasks": num_tasks, "task": {"tools": tools}},
        "agent": {"runtime": {"type": "subprocess"}, **env.get("agent", {})},
    }
    return vf.load_environment(vf.resolve_env_config(config))


class PairConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    checker: vf.AgentConfig = vf.AgentConfig()


class PairEnv(vf.Env[PairConfig]):
    """Two agents per episode: one solves, the other checks."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.solver.run(task)
        await agents.checker.run(task)


def pair_env() -> vf.Env:
    return PairEnv(PairConfig(taskset={"id": __name__, "num_tasks": 1}))


__all__ = ["LocalChatHarness", "SumTaskset"]

if __name__ == "__main__":
    AddToolset.run()
