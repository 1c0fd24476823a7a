"""A ``verifiers`` taskset that ships no harness of its own, as most tasksets on the hub do: verifiers then plays
its episodes with its built-in ``bash`` harness, whose chat program it provisions with ``uv`` from the network.
For tests/integration/test_verifiers_env.py (its id is the module's name, ``_verifiers_plain``)."""

from __future__ import annotations

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def said_it(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 2


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        words = ["apple", "river", "stone", "cloud"]
        return [
            EchoTask(EchoData(prompt=f"Say {w}.", answer=w), vf.TaskConfig())
            for w in words[: self.config.num_tasks]
        ]


__all__ = ["EchoTaskset"]
