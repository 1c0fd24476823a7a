"""Prompts for the rollout workers: where they come from, how they are rendered and tokenized, and which ones each
worker draws.

Sources: the built-in demo tasks (``data.task = max_digit | mod_add``), a verifiers environment's tasks
(``data.task = env``: ``envs.verifiers_env.env_prompts`` lists them from ``env.verifiers``, which the data section
does not hold), or a file (``data.task = file``): JSONL (one JSON object per line), Parquet, or a directory written by
``datasets.Dataset.save_to_disk`` (its ``*.arrow`` files are Arrow IPC streams, read here with pyarrow alone).  Each row holds the prompt at ``data.prompt_field`` and optionally
an answer at ``data.answer_field``; both may be dotted paths into nested objects (``reward_model.ground_truth``).
A prompt is either a string or chat messages, a list of ``{"role", "content"}`` objects.  The row's other top-level
fields travel with the prompt (``Prompt.extra``) to the reward function.  docs/DATA.md shows every format.

Rendering: ``data.prompt_template`` (``str.format`` with ``{prompt}``) rewrites a string prompt, or the last user
message of a chat prompt.  Chat prompts, and string prompts when ``data.chat_template`` is true, go through the
tokenizer's chat template, with ``data.system_prompt`` as the first message unless the row brings its own.  A bad
file or row is one ``PromptError`` line naming the file, the row and the field; ``shardrl init`` runs the same
checks (``rollout_worker/checks.py``) so that a run never starts on a prompts file its workers cannot read.

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

This module imports nothing heavy; pyarrow is imported for tabular files only and the tokenizer is passed in.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.config import ConfigError, DataConfig

from .tasks import task_prompts

Message = dict[str, str]
# prompt -> (the text the model sees, its token ids)
Encoder = Callable[["Prompt"], tuple[str, list[int]]]


class PromptError(ConfigError):
    """A user-caused problem with the prompts (file, row, field, length); the message is one line."""


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the source, stable across epochs and workers
    text: str  # the prompt after data.prompt_template; for chat prompts the last user message
    answer: str | None
    # set when the prompt goes through the chat template: the whole conversation, system prompt included
    messages: tuple[Message, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the row's other fields, for the reward function


@dataclass(frozen=True)
class EncodedPrompt:
    prompt: Prompt
    ids: list[int]
    text: str = ""  # exactly what the model was given (chat template applied), detokenized form of ``ids``


def derive_seed(*parts: object) -> int:
    """A 31-bit seed from the run seed and any labels (slot, epoch, batch); stable across Python processes."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# ---------------------------------------------------------------------------------------------- loading


def load_prompts(data: DataConfig) -> list[Prompt]:
    """All prompts of the run's data source, in source order; none for ``data.task = "env"``, whose prompts are the
    environment's (``envs.verifiers_env.env_prompts``: the worker's preflight lists them)."""
    if data.task == "env":
        return []
    if data.task != "file":
        rows = ({"prompt": p.prompt, "answer": p.answer} for p in task_prompts(data.task))
        builtin = data.model_copy(update={"prompt_field": "prompt", "answer_field": "answer"})
        return [_build(i, "built-in task", f"prompt {i}", row, builtin) for i, row in enumerate(rows)]
    if not data.prompts_file:
        raise PromptError("config: field data.prompts_file is required when data.task is 'file'")
    path = Path(data.prompts_file)
    if not path.exists():
        raise PromptError(f"{path}: prompts file not found (data.prompts_file); {_accepted(data)}")
    prompts = [_build(i, str(path), where, row, data) for i, (where, row) in enumerate(_rows(path, data))]
    if not prompts:
        raise PromptError(f"{path}: no prompts in the file; {_accepted(data)}")
    return prompts


def _accepted(data: DataConfig) -> str:
    return (
        "accepted: JSONL (one JSON object per line), Parquet (.parquet), or a datasets.save_to_disk directory, "
        f"with the prompt (a string or a list of {{role, content}} messages) at {data.prompt_field!r} "
        f"(data.prompt_field) and optionally the answer at {data.answer_field!r} (data.answer_field)"
    )


def _rows(path: Path, data: DataConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of the file, ``where`` being ``line N`` or ``row N``."""
    if path.is_dir():
        return _table_rows(path, _read_arrow_dir(path, data), data)
    if path.suffix.lower() in (".parquet", ".pq"):
        return _table_rows(path, _read_parquet(path, data), data)
    if path.suffix.lower() == ".arrow":
        return _table_rows(path, _read_arrow_file(path, data), data)
    return _jsonl_rows(path, data)


def _jsonl_rows(path: Path, data: DataConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                hint = " (a JSON array is not JSONL)" if lineno == 1 and line.lstrip().startswith("[") else ""
                raise PromptError(
                    f"{path}: line {lineno}: not valid JSON ({getattr(e, 'msg', e)}){hint}; {_accepted(data)}"
                ) from None
            if not isinstance(rec, dict):
                hint = " (a JSON array is not JSONL)" if isinstance(rec, list) else ""
                raise PromptError(f"{path}: line {lineno}: expected a JSON object{hint}; {_accepted(data)}")
            yield f"line {lineno}", rec


def _read_parquet(path: Path, data: DataConfig) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise PromptError(f"{path}: not a readable Parquet file ({e}); {_accepted(data)}") from None


def _read_arrow_file(path: Path, data: DataConfig) -> Any:
    """One ``*.arrow`` file: an IPC stream (what ``save_to_disk`` writes) or an IPC file."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        with pa.memory_map(str(path)) as src:
            try:
                return ipc.open_stream(src).read_all()
            except pa.ArrowInvalid:
                src.seek(0)
                return ipc.open_file(src).read_all()
    except (pa.ArrowException, OSError) as e:
        raise PromptError(
            f"{path}: not a readable Arrow IPC stream or file ({e}); {_accepted(data)}"
        ) from None


def _read_arrow_dir(path: Path, data: DataConfig) -> Any:
    """A ``datasets.Dataset.save_to_disk`` directory: the data files that state.json lists, in its order."""
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        example = "train" if "train" in splits or not splits else splits[0]
        raise PromptError(
            f"{path}: a DatasetDict with splits {', '.join(splits) or 'none'}; point data.prompts_file at one "
            f"split's directory, e.g. {path / example}"
        )
    files = sorted(path.glob("*.arrow"))
    state = path / "state.json"
    if state.is_file():
        try:
            files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise PromptError(f"{state}: field _data_files unreadable ({e!r}); {_accepted(data)}") from None
    if not files:
        raise PromptError(f"{path}: a directory without *.arrow files; {_accepted(data)}")
    return pa.concat_tables([_read_arrow_file(f, data) for f in files])


def _table_rows(path: Path, table: Any, data: DataConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    names = table.schema.names
    if data.prompt_field not in names and data.prompt_field.split(".")[0] not in names:
        raise PromptError(
            f"{path}: field {data.prompt_field!r} missing (data.prompt_field); columns: {', '.join(names)}; "
            f"{_accepted(data)}"
        )
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


_MISSING = object()


def get_field(row: dict[str, Any], path: str) -> Any:
    """``row[path]``, else the dotted path followed into nested objects; ``_MISSING`` when absent."""
    if path in row:
        return row[path]
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _answer(value: Any) -> str | None:
    if value is None or value is _MISSING:
        return None
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def _build(index: int, source: str, where: str, row: dict[str, Any], data: DataConfig) -> Prompt:
    """One row -> a Prompt: template, chat messages and system prompt applied; a bad row is one line."""
    raw = get_field(row, data.prompt_field)
    at = f"{source}: {where}: field {data.prompt_field!r}"
    if raw is _MISSING:
        fields = ", ".join(map(str, list(row)[:8])) or "none"
        raise PromptError(f"{at} missing (data.prompt_field; fields present: {fields}); {_accepted(data)}")
    if isinstance(raw, str):
        if not raw:
            raise PromptError(f"{at} is an empty string")
        text = _templated(raw, data)
        messages = None
        if data.chat_template:
            messages = _with_system([{"role": "user", "content": text}], data)
        elif data.system_prompt is not None:
            raise PromptError(
                f"config: field data.system_prompt needs the chat template, but {source} {where} has a string "
                "prompt and data.chat_template is false; set data.chat_template = true or use data.prompt_template"
            )
    elif isinstance(raw, list):
        messages = _with_system(_templated_chat(_messages(raw, at), data, at), data)
        text = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    else:
        raise PromptError(
            f"{at} is {type(raw).__name__} {raw!r:.40}, expected a non-empty string or a list of "
            '{"role", "content"} messages'
        )
    extra = {k: v for k, v in row.items() if k not in (data.prompt_field, data.answer_field)}
    return Prompt(
        index,
        text,
        _answer(get_field(row, data.answer_field)),
        None if messages is None else tuple(messages),
        extra,
    )


def _templated(text: str, data: DataConfig) -> str:
    return text if data.prompt_template is None else data.prompt_template.format(prompt=text)


def _messages(raw: list[Any], at: str) -> list[Message]:
    if not raw:
        raise PromptError(f"{at} is an empty list of messages")
    out = []
    for j, m in enumerate(raw):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise PromptError(f'{at}: message {j} is {m!r:.60}, expected {{"role": str, "content": str}}')
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _templated_chat(messages: list[Message], data: DataConfig, at: str) -> list[Message]:
    users = [j for j, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise PromptError(f"{at}: no message with role 'user'")
    last = users[-1]
    messages[last] = {"role": "user", "content": _templated(messages[last]["content"], data)}
    return messages


def _with_system(messages: list[Message], data: DataConfig) -> list[Message]:
    if data.system_prompt is None or messages[0]["role"] == "system":
        return messages  # a row's own system message wins over the run-wide one
    return [{"role": "system", "content": data.system_prompt}, *messages]


# ---------------------------------------------------------------------------------------------- checks at init


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Whether a HF tokenizer directory carries a chat template (checked on its files: no transformers import)."""
    if (tokenizer_dir / "chat_template.jinja").is_file() or (tokenizer_dir / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def no_template_message(tokenizer: str, data: DataConfig, prompt: Prompt) -> str:
    why = (
        "data.chat_template is true"
        if data.chat_template
        else f"{data.prompts_file or 'the prompts file'} prompt {prompt.index} (field {data.prompt_field!r}) "
        "is chat messages"
    )
    return (
        f"{tokenizer}: the tokenizer has no chat template (field chat_template, or chat_template.jinja) but "
        f"{why}; use a tokenizer with a chat template, or string prompts with data.chat_template = false"
    )


# ---------------------------------------------------------------------------------------------- encoding


def make_encoder(tokenizer: Any, chat_template: bool = False, data: DataConfig | None = None) -> Encoder:
    """prompt -> (text the model sees, token ids); chat prompts go through the tokenizer's chat template.

    ``chat_template`` (``data.chat_template``) only makes a tokenizer without a template fail here, at once; which
    prompts are chat prompts was settled when they were loaded.  ``data`` names the file in that error.
    """
    name = str(getattr(tokenizer, "name_or_path", "tokenizer"))
    has_template = bool(getattr(tokenizer, "chat_template", None))
    data = data or DataConfig(chat_template=chat_template)
    if chat_template and not has_template:
        raise PromptError(
            f"{name}: data.chat_template is true but the tokenizer has no chat template; set "
            "data.chat_template = false or use a tokenizer that has one"
        )

    def encode(prompt: Prompt) -> tuple[str, list[int]]:
        if prompt.messages is None:
            return prompt.text, list(tokenizer(prompt.text)["input_ids"])
        if not has_template:
            raise PromptError(no_template_message(name, data, prompt))
        rendered = tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, tokenize=False
        )
        # the template already wrote any BOS it wants
        return rendered, list(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    return encode


# ---------------------------------------------------------------------------------------------- drawing


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
        encode: Encoder,
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
            text, ids = self.encode(prompt)
            if not ids or len(ids) > self.max_tokens:
                self.skipped_too_long += 1
                self._skipped_in_epoch += 1
                continue
            self._kept_in_epoch += 1
            batch.append(EncodedPrompt(prompt, ids, text))
        return batch
