"""What the environment tests share: a chat template with tools in Qwen2.5's shape (the tiny tokenizer's own template
has none), the tiny tokenizer, and a scripted stand-in for an engine."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rollout_worker.engines.base import Completion, SamplingSpec

# Qwen2.5's layout: the tools' JSON in the system turn, consecutive tool results in one user turn of
# <tool_response> blocks.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": N, "arguments": A}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = "tests.unit._env_tools"


def call(name: str, **args: Any) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


@dataclass
class ScriptedModel:
    """``generate`` for episodes: the reply of a conversation is ``scripts[its first user message][its turn]``.

    Each reply is tokenised here (the "engine" producing ids) and ended with <|im_end|>; ``calls`` keeps every prompt
    it was given and the ids it returned, so that a test can check what the engine saw.
    """

    tokenizer: Any
    scripts: dict[str, list[str]]
    calls: list[tuple[list[int], list[int]]] = field(default_factory=list)

    def __call__(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            user = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.S)
            assert user is not None
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.scripts[user.group(1)][turn]
            ids = [*self.tokenizer(reply, add_special_tokens=False)["input_ids"], end]
            finish = "stop"
            if len(ids) > spec.max_tokens:  # as an engine does: the text is then that of the ids it kept
                ids, finish = ids[: spec.max_tokens], "length"
                reply = self.tokenizer.decode(ids, skip_special_tokens=True)
            lps = [-0.25 - 0.01 * (i % 7) for i in range(len(ids))]
            self.calls.append((list(p), ids))
            out.append([Completion(list(p), ids, lps, finish, reply)])
        return out
