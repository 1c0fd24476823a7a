"""Prompts for the rollout workers: where they come from, how they are tokenized, and which ones each worker draws.

Sources: the built-in demo tasks (``data.task = max_digit | mod_add``) or a file (``data.task = file``): JSONL (one
JSON object per line) or Parquet, with the prompt in ``data.prompt_field`` and an optional answer in
``data.answer_field``.  A bad file is one ``PromptError`` line naming the file and what is accepted.

Which prompts a worker draws: each worker walks its own permutation of the *whole* prompt set, reshuffled every
epoch, seeded by (run seed, slot, epoch).  The usual alternative, one shared permutation per epoch of which worker k
takes every K-th prompt, is a partition only while K stays fixed: here workers come and go at any time (control.json,
preemption, crash restarts), and a changed K makes the strided shares overlap and leave gaps mid-epoch, unless every
worker agrees on K and on the epoch boundary, which would take coordination the design avoids.  Independent
permutations need none: the stream of a slot is deterministic, every prompt is drawn exactly once per epoch of every
worker whatever the worker count does, so in the long run all prompts are sampled at the same rate.  What this gives
up is a global "each prompt exactly once per pass" guarantee: two workers may draw the same prompt at about the same
time, which in RL only means more samples of that prompt, in separate groups.  A restarted worker resumes its slot's
stream where the previous incarnation stopped (the cursor is kept in its status record), so crash loops do not
over-sample the first prompts of an epoch.

This module imports nothing heavy; the tokenizer is passed in.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buffer.config import DataConfig

from .tasks import task_prompts


class PromptError(ValueError):
    """A user-caused problem with the prompts (file, field, length); the message is one line."""


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the source, stable across epochs and workers
    text: str
    answer: str | None


@dataclass(frozen=True)
class EncodedPrompt:
    prompt: Prompt
    ids: list[int]


def derive_seed(*parts: object) -> int:
    """A 31-bit seed from the run seed and any labels (slot, epoch, batch); stable across Python processes."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def load_prompts(data: DataConfig) -> list[Prompt]:
    """All prompts of the run's data source, in source order."""
    if data.task != "file":
        return [Prompt(i, p.prompt, p.answer) for i, p in enumerate(task_prompts(data.task))]
    if not data.prompts_file:
        raise PromptError("config: field data.prompts_file is required when data.task is 'file'")
    path = Path(data.prompts_file)
    accepted = (
        f"accepted: JSONL (one JSON object per line) or Parquet (.parquet) with a string field "
        f"{data.prompt_field!r} (data.prompt_field) and optionally {data.answer_field!r} (data.answer_field)"
    )
    if not path.is_file():
        raise PromptError(f"{path}: prompts file not found (data.prompts_file); {accepted}")
    if path.suffix.lower() in (".parquet", ".pq"):
        prompts = _load_parquet(path, data, accepted)
    else:
        prompts = _load_jsonl(path, data, accepted)
    if not prompts:
        raise PromptError(f"{path}: no prompts in the file; {accepted}")
    return prompts


def _answer(value: Any) -> str | None:
    return None if value is None else str(value)


def _load_jsonl(path: Path, data: DataConfig, accepted: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                hint = " (a JSON array is not JSONL)" if lineno == 1 and line.lstrip().startswith("[") else ""
                raise PromptError(
                    f"{path}: line {lineno}: not valid JSON ({getattr(e, 'msg', e)}){hint}; {accepted}"
                ) from None
            if not isinstance(rec, dict):
                hint = " (a JSON array is not JSONL)" if isinstance(rec, list) else ""
                raise PromptError(f"{path}: line {lineno}: expected a JSON object{hint}; {accepted}")
            prompts.append(_record(path, f"line {lineno}", rec, data, accepted, len(prompts)))
    return prompts


def _load_parquet(path: Path, data: DataConfig, accepted: str) -> list[Prompt]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        if data.prompt_field not in names:
            raise PromptError(
                f"{path}: field {data.prompt_field!r} missing (data.prompt_field); columns: "
                f"{', '.join(names)}; {accepted}"
            )
        columns = [data.prompt_field] + ([data.answer_field] if data.answer_field in names else [])
        rows = pq.read_table(path, columns=columns).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise PromptError(f"{path}: not a readable Parquet file ({e}); {accepted}") from None
    return [_record(path, f"row {i}", rec, data, accepted, i) for i, rec in enumerate(rows)]


def _record(path: Path, where: str, rec: dict, data: DataConfig, accepted: str, index: int) -> Prompt:
    text = rec.get(data.prompt_field)
    if data.prompt_field not in rec:
        fields = ", ".join(map(str, list(rec)[:8])) or "none"
        raise PromptError(
            f"{path}: {where}: field {data.prompt_field!r} missing (data.prompt_field; fields present: {fields}); "
            f"{accepted}"
        )
    if not isinstance(text, str) or not text:
        raise PromptError(
            f"{path}: {where}: field {data.prompt_field!r} is {type(text).__name__} {text!r:.40}, "
            f"expected a non-empty string"
        )
    return Prompt(index, text, _answer(rec.get(data.answer_field)))


def make_encoder(tokenizer: Any, chat_template: bool) -> Callable[[str], list[int]]:
    """prompt text -> token ids, optionally through the tokenizer's chat template (one user turn)."""
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            f"{getattr(tokenizer, 'name_or_path', 'tokenizer')}: data.chat_template is true but the tokenizer "
            "has no chat template; set data.chat_template = false or use a tokenizer that has one"
        )

    def encode(text: str) -> list[int]:
        if chat_template:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            # the template already wrote any BOS it wants
            return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        return list(tokenizer(text)["input_ids"])

    return encode


def epoch_order(n: int, seed: int, slot: int, epoch: int) -> list[int]:
    """The order in which slot ``slot`` draws ``n`` prompts during ``epoch``: a permutation of range(n)."""
    order = list(range(n))
    random.Random(derive_seed(seed, "prompts", slot, epoch)).shuffle(order)
    return order


class PromptStream:
    """One worker's endless stream of tokenized prompts: its own permutation per epoch, too-long ones skipped."""

    def __init__(
        self,
        prompts: list[Prompt],
        encode: Callable[[str], list[int]],
        *,
        seed: int,
        slot: int,
        max_tokens: int,
        epoch: int = 0,
        cursor: int = 0,
    ):
        if not prompts:
            raise PromptError("no prompts")
        self.prompts = prompts
        self.encode = encode
        self.seed = seed
        self.slot = slot
        self.max_tokens = max_tokens
        self.epoch = epoch
        self.cursor = min(max(cursor, 0), len(prompts))
        self.skipped_too_long = 0
        self._order = epoch_order(len(prompts), seed, slot, epoch)
        self._kept_in_epoch = self._skipped_in_epoch = 0

    def _next_index(self) -> int:
        if self.cursor >= len(self._order):
            if self._kept_in_epoch == 0 and self._skipped_in_epoch == len(self.prompts):
                raise PromptError(
                    f"all {len(self.prompts)} prompts are longer than {self.max_tokens} tokens "
                    "(data.max_prompt_length, or the engine's max_model_len - 1)"
                )
            self.epoch += 1
            self.cursor = 0
            self._kept_in_epoch = self._skipped_in_epoch = 0
            self._order = epoch_order(len(self.prompts), self.seed, self.slot, self.epoch)
        i = self._order[self.cursor]
        self.cursor += 1
        return i

    def next_batch(self, size: int) -> list[EncodedPrompt]:
        """The next ``size`` prompts that fit (may cross into the next epoch)."""
        batch: list[EncodedPrompt] = []
        while len(batch) < size:
            prompt = self.prompts[self._next_index()]
            ids = self.encode(prompt.text)
            if not ids or len(ids) > self.max_tokens:
                self.skipped_too_long += 1
                self._skipped_in_epoch += 1
                continue
            self._kept_in_epoch += 1
            batch.append(EncodedPrompt(prompt, ids))
        return batch
