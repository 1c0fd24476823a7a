"""Prompt file formats (chat messages, nested fields, extra fields, Arrow dataset directories), prompt templates and
system prompts, the checks `shardrl init` runs on them, and a chat-format math run's prompts and rewards on the
tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from buffer.config import ConfigError, DataConfig, RewardConfig, ShardRLConfig, load_toml
from rollout_worker.checks import validate_prompts_file
from rollout_worker.engines.base import Completion
from rollout_worker.prompts import (
    EncodedPrompt,
    Prompt,
    PromptError,
    load_prompts,
    make_encoder,
)
from rollout_worker.rewards import Scorer

VERL_ROWS = [  # the row shape of verl-style math datasets: chat prompt, answer nested under reward_model
    {
        "data_source": "gsm8k",
        "prompt": [
            {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. Total?"}
        ],
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "math",
        "prompt": [
            {"role": "system", "content": "Think, then answer."},
            {"role": "user", "content": "What is 1/2 + 1/4?"},
        ],
        "reward_model": {"style": "rule", "ground_truth": "\\frac34"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(path: Path, **kw: Any) -> DataConfig:
    return DataConfig.model_validate({"task": "file", "prompts_file": str(path), **kw})


def _cfg(path: Path, function: str = "math_answer", model: str = "tiny", **data: Any) -> ShardRLConfig:
    return ShardRLConfig.model_validate(
        {
            "model": {"path": model},
            "data": {"task": "file", "prompts_file": str(path), **data},
            "reward": {"function": function},
        }
    )


# ---------------------------------------------------------------------------------------------- rows and fields


def test_chat_rows_nested_answer_and_extra_fields(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "math.jsonl", VERL_ROWS)
    got = load_prompts(_data(path, answer_field="reward_model.ground_truth", system_prompt="Be brief."))
    assert [p.answer for p in got] == ["72", "\\frac34"]
    # the run's system prompt goes first unless the row brings its own
    assert got[0].messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": VERL_ROWS[0]["prompt"][0]["content"]},
    )
    assert got[1].messages == tuple(VERL_ROWS[1]["prompt"])
    assert got[1].text == "What is 1/2 + 1/4?"  # the last user message
    # every other field of the row reaches the reward function
    assert got[0].extra == {
        "data_source": "gsm8k",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    }


def test_nested_prompt_field_and_template(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"q": {"text": "2+2?"}, "answer": 4, "id": 7}])
    got = load_prompts(_data(path, prompt_field="q.text", prompt_template="Question: {prompt}\nAnswer:"))
    assert got == [Prompt(0, "Question: 2+2?\nAnswer:", "4", None, {"q": {"text": "2+2?"}, "id": 7})]
    # a string prompt through the chat template: one user turn, after the system prompt
    chat = load_prompts(_data(path, prompt_field="q.text", chat_template=True, system_prompt="S"))
    assert chat[0].messages == ({"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"})
    # the template rewrites the last user message of a chat prompt
    rows = [
        {
            "prompt": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ]
        }
    ]
    templated = load_prompts(_data(_jsonl(tmp_path / "c.jsonl", rows), prompt_template="[{prompt}]"))
    assert [m["content"] for m in templated[0].messages or ()] == ["a", "b", "[c]"]


def test_built_in_tasks_take_the_template_too() -> None:
    got = load_prompts(DataConfig(task="max_digit", prompt_template="Q: {prompt}"))
    assert got[39] == Prompt(39, "Q: max(3,9)=", "9")


@pytest.mark.parametrize("template", ["{question}", "no placeholder", "{prompt} {0}", "{prompt"])
def test_a_bad_template_is_one_config_line(tmp_path: Path, template: str) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(f'[reward]\nfunction = "math_answer"\n[data]\nprompt_template = {json.dumps(template)}\n')
    with pytest.raises(ConfigError) as e:
        load_toml(toml)
    assert str(e.value).startswith(f"{toml}: field data.prompt_template:") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": [{"role": "user"}]}, "line 2: field 'prompt': message 0 is {'role': 'user'}, expected"),
        (
            {"prompt": [{"role": "system", "content": "s"}]},
            "line 2: field 'prompt': no message with role 'user'",
        ),
        ({"prompt": []}, "line 2: field 'prompt' is an empty list of messages"),
        ({"prompt": {"text": "x"}}, "line 2: field 'prompt' is dict"),
        ({"prompt": ""}, "line 2: field 'prompt' is an empty string"),
        ({"question": "x"}, "line 2: field 'prompt' missing (data.prompt_field; fields present: question)"),
    ],
)
def test_bad_rows_name_the_file_row_and_field(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(PromptError) as e:
        load_prompts(_data(path))
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_system_prompt_needs_chat_rendering(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(PromptError, match=r"data.system_prompt needs the chat template.*line 1"):
        load_prompts(_data(path, system_prompt="S"))


# ---------------------------------------------------------------------------------------------- file formats


def test_parquet_with_chat_messages(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(VERL_ROWS)
    assert pa.types.is_list(
        table.schema.field("prompt").type
    )  # list<struct<role, content>>, as datasets writes
    pq.write_table(table, tmp_path / "math.parquet")
    got = load_prompts(_data(tmp_path / "math.parquet", answer_field="reward_model.ground_truth"))
    assert [p.answer for p in got] == ["72", "\\frac34"] and got[1].messages == tuple(VERL_ROWS[1]["prompt"])
    assert got[0].extra["extra_info"] == {"split": "train", "index": 0}


def _save_to_disk_by_hand(root: Path, rows: list[dict[str, Any]], files: int = 2) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC *stream* files listed in state.json."""
    root.mkdir()
    names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
    per = -(-len(rows) // files)
    for i, name in enumerate(names):
        table = pa.Table.from_pylist(rows[i * per : (i + 1) * per])
        with pa.OSFile(str(root / name), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (root / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names], "_split": "train"})
    )
    (root / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return root


def test_arrow_dataset_directory(tmp_path: Path) -> None:
    rows = [{"problem": f"{i}+1=?", "solution": f"\\boxed{{{i + 1}}}", "level": i % 3} for i in range(5)]
    root = _save_to_disk_by_hand(tmp_path / "ds", rows)
    got = load_prompts(_data(root, prompt_field="problem", answer_field="solution"))
    assert [p.text for p in got] == [r["problem"] for r in rows]  # the order of state.json's files
    assert [p.extra for p in got] == [{"level": i % 3} for i in range(5)]

    # a DatasetDict directory: point at one split
    (tmp_path / "dd").mkdir()
    _save_to_disk_by_hand(tmp_path / "dd" / "train", rows)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(
        PromptError, match=r"a DatasetDict with splits train; point data.prompts_file at one split"
    ):
        load_prompts(_data(tmp_path / "dd", prompt_field="problem"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptError, match=r"a directory without \*.arrow files"):
        load_prompts(_data(tmp_path / "empty"))
    (root / "data-00000-of-00002.arrow").write_bytes(b"not arrow")
    with pytest.raises(PromptError, match="not a readable Arrow IPC stream or file"):
        load_prompts(_data(root, prompt_field="problem"))


def test_arrow_dataset_written_by_datasets(tmp_path: Path) -> None:
    import datasets  # in the dev extra: this test runs in every default run

    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(str(tmp_path / "ds"))
    got = load_prompts(_data(tmp_path / "ds", answer_field="reward_model.ground_truth"))
    assert [p.answer for p in got] == ["72", "\\frac34"]


# ---------------------------------------------------------------------------------------------- init checks


def test_init_checks_reward_answers_and_chat_template(tmp_path: Path) -> None:
    chat = _jsonl(tmp_path / "math.jsonl", VERL_ROWS)
    ok = validate_prompts_file(_cfg(chat, answer_field="reward_model.ground_truth"))
    assert len(ok) == 2
    with pytest.raises(
        PromptError, match=r"no row has an answer at 'answer' \(data.answer_field\), which reward"
    ):
        validate_prompts_file(_cfg(chat))
    assert validate_prompts_file(_cfg(chat, function="my.module:fn"))  # user functions decide themselves
    with pytest.raises(ConfigError, match="'math_anwser' is not a known reward"):
        validate_prompts_file(_cfg(chat, function="math_anwser"))

    tok = tmp_path / "tok"  # a tokenizer directory without a chat template
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    with pytest.raises(PromptError) as e:
        validate_prompts_file(_cfg(chat, model=str(tok), answer_field="reward_model.ground_truth"))
    line = str(e.value)
    assert line.startswith(f"{tok / 'tokenizer_config.json'}: the tokenizer has no chat template")
    assert f"{chat} prompt 0 (field 'prompt') is chat messages" in line and "\n" not in line
    (tok / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert validate_prompts_file(_cfg(chat, model=str(tok), answer_field="reward_model.ground_truth"))


def test_init_refuses_a_bad_prompts_file_before_creating_the_run(tmp_path: Path) -> None:
    from shardrl.runs import init_run

    with pytest.raises(PromptError, match="prompts file not found"):
        init_run(tmp_path / "run", _cfg(tmp_path / "missing.jsonl"))
    assert not (tmp_path / "run").exists()


def test_reward_function_must_be_named(tmp_path: Path) -> None:
    for text, field in (
        ("[data]\ntask = 'mod_add'\n", "reward"),
        ("[reward]\nreward_model_weight = 1.0\n", "reward.function"),
    ):
        toml = tmp_path / "c.toml"
        toml.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_toml(toml)
        # one line naming the file and the field, and what would be accepted there
        assert str(e.value).startswith(f"{toml}: field {field}: Field required; expected ")
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- the tiny model


def test_chat_math_prompts_render_on_the_tiny_tokenizer_and_score(
    tmp_path: Path, tiny_model_untied: Path
) -> None:
    """A chat-format math prompts file with `math_answer` on the tiny model: load, render, score."""
    from transformers import AutoTokenizer

    path = _jsonl(tmp_path / "math.jsonl", VERL_ROWS)
    cfg = _cfg(
        path,
        model=str(tiny_model_untied),
        answer_field="reward_model.ground_truth",
        system_prompt="Put the final answer in \\boxed{}.",
        prompt_template="{prompt} Answer briefly.",
    )
    prompts = validate_prompts_file(cfg)
    tok = AutoTokenizer.from_pretrained(tiny_model_untied)
    encode = make_encoder(tok, cfg.data.chat_template, cfg.data)
    text0, ids0 = encode(prompts[0])
    assert text0 == (
        "<|im_start|>system\nPut the final answer in \\boxed{}.<|im_end|>\n"
        f"<|im_start|>user\n{VERL_ROWS[0]['prompt'][0]['content']} Answer briefly.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.decode(ids0) == text0 and ids0.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    text1, _ = encode(prompts[1])
    assert text1.startswith(
        "<|im_start|>system\nThink, then answer.<|im_end|>"
    )  # the row's own system message

    def done(text: str, cut: bool = False) -> Completion:
        return Completion(ids0, tok(text)["input_ids"], [-0.1], "length" if cut else "stop", text)

    groups = [EncodedPrompt(prompts[0], ids0, text0), EncodedPrompt(prompts[1], ids0, text1)]
    outputs = [
        [done("48 + 24 = \\boxed{72}"), done("So 72"), done("maybe 71"), done("so far 72", cut=True)],
        [done("\\boxed{\\dfrac{3}{4}}"), done("\\boxed{0.75}"), done("\\boxed{\\frac12}"), done("")],
    ]
    scored = Scorer(RewardConfig(function="math_answer")).score_batch(groups, outputs)
    assert [g.rewards for g in scored] == [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    tiny_cut = Scorer(RewardConfig(function="math_answer", truncated_reward=-0.5)).score_batch(
        groups, outputs
    )
    assert tiny_cut[0].rewards == [1.0, 1.0, 0.0, -0.5]
