"""Reward functions (registry, math answers, user functions, failures) and the prompt streams of the workers."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

from buffer.config import DataConfig, RewardConfig
from rollout_worker.engines.base import Completion
from rollout_worker.prompts import EncodedPrompt, Prompt, PromptError, PromptStream, epoch_order, load_prompts
from rollout_worker.rewards import (
    RewardConfigError,
    RewardError,
    RewardFunction,
    Sample,
    Scorer,
    exact_match,
    math_answer,
    resolve_reward,
    score_group,
)

# ---------------------------------------------------------------------------------------------- rewards

STOP, CUT = Sample("q"), Sample("q", "length")


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("The answer is 72.", "72", 1.0),
        ("The answer is 71.", "72", 0.0),
        ("so 3 apples and then 5", "5", 1.0),  # the last number counts
        (r"First 10, then \boxed{12}. Check: 13", "12", 1.0),  # the box wins over later numbers
        (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),
        (r"\boxed{10^{3}}", "1000", 1.0),
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        (r"\boxed{0.75}", r"\frac{3}{4}", 1.0),
        (r"\boxed{\dfrac{1}{3}}", "1/3", 1.0),
        (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
        ("It costs $1,234.", "1234", 1.0),
        ("-3.50", "-3.5", 1.0),
        (r"\boxed{x^{2}+1}", "x^{2} + 1", 1.0),  # expressions compare symbolically
        (r"\boxed{x^{2}+2}", "x^{2} + 1", 0.0),
        (r"\boxed{(x+1)^2}", "x^2 + 2x + 1", 1.0),
        ("Natalia sold 48 + 24 = 72 clips", "She sold 48/2 = 24 in May ... #### 72", 1.0),  # GSM8K answer
        (r"so \boxed{7}", r"We get $3+4$, so \boxed{7}.", 1.0),  # a worked reference with a box
        (r"\boxed{12", "12", 0.0),  # an unclosed box is no answer
        ("no number at all", "4", 0.0),
        ("", "4", 0.0),
    ],
)
def test_math_answer(response: str, answer: str, reward: float) -> None:
    assert math_answer(response, answer, extra={}, sample=STOP) == reward


def test_math_answer_gives_a_cut_off_response_no_last_number_fallback() -> None:
    # the same text scores when the model stopped by itself, not when it hit the length limit mid-thought
    assert math_answer("so 3 apples and then 5", "5", extra={}, sample=STOP) == 1.0
    assert math_answer("so 3 apples and then 5", "5", extra={}, sample=CUT) == 0.0
    # a closed box before the cut is still an answer
    assert math_answer(r"\boxed{5} and then we check 7", "5", extra={}, sample=CUT) == 1.0
    assert math_answer(r"\boxed{5} and then we check 7", "7", extra={}, sample=CUT) == 0.0


def test_exact_match_and_digit_tasks() -> None:
    assert exact_match("  Paris\n", "Paris", extra={}, sample=STOP) == 1.0
    assert exact_match("paris", "Paris", extra={}, sample=STOP) == 0.0
    digits = resolve_reward("max_digit")
    assert resolve_reward("mod_add") is digits
    # the older call form (prompt, response, answer) still works on every resolved function
    assert digits("max(3,9)=", " 9", "9") == 1.0
    assert digits("max(3,9)=", "3", "9") == 0.1  # another digit: the shaping reward
    assert digits("max(3,9)=", "x9", "9") == 0.0
    assert resolve_reward("math_answer")("q", r"\boxed{\frac12}", "0.5") == 1.0


def _group(
    text: str = "p", answer: str | None = None, extra: dict | None = None, index: int = 0
) -> EncodedPrompt:
    return EncodedPrompt(Prompt(index, text, answer, None, extra or {}), [1, 2], f"<{text}>")


def _outs(*responses: str, cut: tuple[int, ...] = ()) -> list[Completion]:
    return [
        Completion([1, 2], [5] * (j + 1), [-0.5] * (j + 1), "length" if j in cut else "stop", r)
        for j, r in enumerate(responses)
    ]


def test_user_functions_old_new_and_batched_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "from rollout_worker.rewards import batched\n"
        "def length(prompt, response, answer):\n    return float(len(response))\n"
        "def with_extra(response, answer, *, extra, sample):\n"
        "    return extra['weight'] * len(response) + len(sample.response_ids) / 10\n"
        "@batched\n"
        "def batch(responses, answers, *, extras, samples):\n"
        "    batch.calls.append(len(responses))\n"
        "    return [float(s.prompt_index) for s in samples]\n"
        "batch.calls = []\n"
        "def plain_marked(responses, answers, *, extras, samples):\n    return [0.5] * len(responses)\n"
        "plain_marked.shardrl_batched = True\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fn = resolve_reward("my_rewards:length")
        assert score_group(fn, "p", ["ab", "abcd"], None) == [2.0, 4.0]
        assert Scorer(RewardConfig(function="my_rewards:length")).score_batch(
            [_group()], [_outs("ab", "abc")]
        )[0].rewards == [2.0, 3.0]
        # the row's extra fields and the sample reach the function
        scored = Scorer(RewardConfig(function="my_rewards:with_extra")).score_batch(
            [_group(extra={"weight": 2})], [_outs("ab", "abc")]
        )
        assert scored[0].rewards == [4.1, 6.2]
        # a batched function is called once for the whole batch, with lists
        scorer = Scorer(RewardConfig(function="my_rewards:batch"))
        out = scorer.score_batch([_group(index=3), _group(index=8)], [_outs("a", "b"), _outs("c", "d", "e")])
        assert [g.rewards for g in out] == [[3.0, 3.0], [8.0, 8.0, 8.0]]
        assert sys.modules["my_rewards"].batch.calls == [5]
        marked = Scorer(RewardConfig(function="my_rewards:plain_marked"))
        assert marked.score_batch([_group()], [_outs("a")])[0].rewards == [0.5]
        with pytest.raises(RewardConfigError, match="has no function 'NOT_CALLABLE'"):
            resolve_reward("my_rewards:NOT_CALLABLE")
        with pytest.raises(RewardConfigError, match="has no function 'missing'"):
            resolve_reward("my_rewards:missing")
    finally:
        sys.modules.pop("my_rewards", None)


def test_truncated_reward_replaces_the_score_of_cut_off_responses() -> None:
    outs = _outs(r"\boxed{4}", r"\boxed{4}", "so it is 4", cut=(1, 2))
    normal = Scorer(RewardConfig(function="math_answer")).score_batch([_group(answer="4")], [outs])
    assert normal[0].rewards == [1.0, 1.0, 0.0]  # cut off: only the closed box counts
    fixed = Scorer(RewardConfig(function="math_answer", truncated_reward=-1.0))
    assert fixed.score_batch([_group(answer="4")], [outs])[0].rewards == [1.0, -1.0, -1.0]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "'nope' is not a known reward; accepted: math_answer, exact_match, max_digit, mod_add"),
        ("no_such_pkg.mod:fn", "cannot import 'no_such_pkg.mod' (ModuleNotFoundError"),
    ],
)
def test_unknown_reward_is_one_line(name: str, message: str) -> None:
    with pytest.raises(RewardConfigError) as e:
        resolve_reward(name)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "package.module:function" in str(e.value)


def test_a_failing_sample_fails_its_group() -> None:
    def raises_on_b(prompt: str, response: str, answer: str | None) -> float:
        if response == "b":
            raise KeyError("b")
        return 1.0

    assert score_group(raises_on_b, "p", ["a", "a"], None) == [1.0, 1.0]
    with pytest.raises(RewardError, match="raised KeyError"):
        score_group(raises_on_b, "p", ["a", "b", "a"], None)
    with pytest.raises(RewardError, match="returned nan"):
        score_group(lambda p, r, a: math.nan, "p", ["a"], None)
    with pytest.raises(RewardError, match="returned inf"):
        score_group(lambda p, r, a: math.inf, "p", ["a"], None)
    with pytest.raises(RewardError, match="raised TypeError"):
        score_group(lambda p, r, a: None, "p", ["a"], None)  # type: ignore[arg-type, return-value]
    with pytest.raises(RewardError, match="needs an answer"):
        score_group(resolve_reward("math_answer"), "p", ["1"], None)


def test_the_scorer_fails_only_the_group_that_fails() -> None:
    scorer = Scorer(RewardConfig(function="exact_match"))
    out = scorer.score_batch(
        [_group(answer="x"), _group(answer=None), _group(answer="y")], [_outs("x", "z")] * 3
    )
    assert out[0].rewards == [1.0, 0.0] and out[2].rewards == [0.0, 0.0]
    assert out[1].rewards is None and "needs an answer" in (out[1].error or "")

    def nan_for_b(responses, answers, *, extras, samples):  # type: ignore[no-untyped-def]
        return [math.nan if r == "b" else 1.0 for r in responses]

    scorer.function = RewardFunction("nan_for_b", nan_for_b, "batched")
    got = scorer.score_batch([_group(), _group()], [_outs("a", "a"), _outs("a", "b")])
    assert got[0].rewards == [1.0, 1.0] and got[1].rewards is None and "returned nan" in (got[1].error or "")

    def wrong_length(responses, answers, *, extras, samples):  # type: ignore[no-untyped-def]
        return [1.0]

    # one call for the whole batch: when it fails, every group of the batch fails
    scorer.function = RewardFunction("wrong_length", wrong_length, "batched")
    got = scorer.score_batch([_group(), _group()], [_outs("a", "a"), _outs("a")])
    assert all(g.rewards is None and "must return 3 values" in (g.error or "") for g in got)


def test_reward_model_scores_prompt_plus_response(tmp_path: Path, tiny_model_untied: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from rollout_worker.rewards import RewardModel

    lm = tiny_model_untied
    tok = AutoTokenizer.from_pretrained(lm)
    cfg = Qwen2Config.from_pretrained(lm)
    cfg.num_labels = 1
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(cfg).eval()
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")

    scorer = RewardModel(tmp_path / "rm", device="cpu", batch_size=3)
    prompts, responses = ["max(3,9)=", "1+1=", "max(0,0)=", "7+7="], ["9", " the answer is 2", "0", "4"]
    scores = scorer.score(prompts, responses)
    with torch.no_grad():  # one text at a time: no padding at all
        alone = [
            rm(**tok(p + r, return_tensors="pt")).logits[0, 0].item()
            for p, r in zip(prompts, responses, strict=True)
        ]
    assert scores == pytest.approx(alone, abs=1e-4)
    assert len(set(scores)) == 4

    rm2 = Qwen2ForSequenceClassification(Qwen2Config.from_pretrained(lm, num_labels=2))
    rm2.save_pretrained(tmp_path / "rm2")
    tok.save_pretrained(tmp_path / "rm2")
    with pytest.raises(RewardConfigError, match="num_labels = 1"):
        RewardModel(tmp_path / "rm2", device="cpu")


# ---------------------------------------------------------------------------------------------- prompts


def _data(**kw: object) -> DataConfig:
    return DataConfig.model_validate({"task": "file", **kw})


def test_demo_tasks_and_files(tmp_path: Path) -> None:
    demo = load_prompts(DataConfig(task="mod_add"))
    assert len(demo) == 100 and demo[39] == Prompt(39, "3+9=", "2")

    jl = tmp_path / "p.jsonl"
    jl.write_text('{"q": "a?", "a": 4}\n\n{"q": "b?"}\n')
    got = load_prompts(_data(prompts_file=str(jl), prompt_field="q", answer_field="a"))
    assert got == [Prompt(0, "a?", "4"), Prompt(1, "b?", None)]

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"prompt": ["x", "y"], "answer": ["1", None], "other": [1, 2]}), tmp_path / "p.parquet"
    )
    got = load_prompts(_data(prompts_file=str(tmp_path / "p.parquet")))
    assert got == [Prompt(0, "x", "1", None, {"other": 1}), Prompt(1, "y", None, None, {"other": 2})]


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.jsonl", "prompts file not found (data.prompts_file); accepted: JSONL"),
        ('{"prompt": "a"}\n{"prompt": \n', "bad.jsonl", "line 2: not valid JSON"),
        ('[{"prompt": "a"}]\n', "array.json", "line 1: expected a JSON object (a JSON array is not JSONL)"),
        ('{"prompt": "a"}\n{"question": "b"}\n', "field.jsonl", "line 2: field 'prompt' missing"),
        ('{"prompt": 3}\n', "type.jsonl", "line 1: field 'prompt' is int"),
        ('"just a string"\n', "scalar.jsonl", "line 1: expected a JSON object"),
        ("\n\n", "empty.jsonl", "no prompts in the file"),
        ("not parquet", "bad.parquet", "not a readable Parquet file"),
    ],
)
def test_bad_prompt_files_are_one_line(tmp_path: Path, content: str | None, name: str, message: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(PromptError) as e:
        load_prompts(_data(prompts_file=str(path)))
    assert str(e.value).startswith(str(path)) and message in str(e.value) and "\n" not in str(e.value)


def test_parquet_without_the_prompt_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["x"]}), tmp_path / "q.parquet")
    with pytest.raises(PromptError, match=r"field 'prompt' missing .*columns: question"):
        load_prompts(_data(prompts_file=str(tmp_path / "q.parquet")))


def _stream(n: int = 10, slot: int = 0, seed: int = 1, max_tokens: int = 100, **kw: int) -> PromptStream:
    prompts = [Prompt(i, "x" * (i + 1), None) for i in range(n)]
    return PromptStream(
        prompts,
        lambda p: (p.text, list(range(len(p.text)))),
        seed=seed,
        slot=slot,
        max_tokens=max_tokens,
        **kw,
    )


def _indices(stream: PromptStream, k: int) -> list[int]:
    return [p.prompt.index for p in stream.next_batch(k)]


def test_stream_is_deterministic_per_slot_and_reshuffles_each_epoch() -> None:
    first = _indices(_stream(), 30)
    assert first == _indices(_stream(), 30)  # same seed and slot: same stream
    epochs = [first[0:10], first[10:20], first[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # every prompt exactly once per epoch
    assert len({tuple(e) for e in epochs}) == 3  # in a new order each epoch
    assert _indices(_stream(slot=1), 10) != epochs[0]  # another slot walks another order
    assert _indices(_stream(seed=2), 10) != epochs[0]
    assert epoch_order(10, 1, 0, 0) == epochs[0]


def test_stream_resumes_where_a_previous_incarnation_stopped() -> None:
    whole = _indices(_stream(), 25)
    s = _stream()
    _indices(s, 13)
    resumed = _stream(epoch=s.epoch, cursor=s.cursor)
    assert _indices(resumed, 12) == whole[13:]


def test_stream_coverage_does_not_depend_on_the_worker_count() -> None:
    # whatever the number of workers and however it changes, each worker draws every prompt equally often
    counts: Counter[int] = Counter()
    for slot in range(3):
        counts.update(_indices(_stream(slot=slot), 50))
    counts.update(_indices(_stream(slot=7), 20))
    assert set(counts.values()) == {17}


def test_too_long_prompts_are_skipped_and_counted() -> None:
    s = _stream(n=10, max_tokens=4)  # prompt i has i + 1 tokens: 0..3 fit
    got = _indices(s, 8)
    assert sorted(got) == [0, 0, 1, 1, 2, 2, 3, 3]
    # six too long per full epoch, plus those passed so far in the current one
    in_this_epoch = sum(1 for i in epoch_order(10, 1, 0, s.epoch)[: s.cursor] if i >= 4)
    assert s.epoch == 1 and s.skipped_too_long == 6 + in_this_epoch
    with pytest.raises(PromptError, match="all 10 prompts are longer than 0 tokens"):
        _stream(max_tokens=0).next_batch(1)


def test_chat_template_is_applied_to_chat_prompts() -> None:
    from rollout_worker.prompts import make_encoder

    class Tok:
        chat_template = "yes"
        name_or_path = "tok"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):  # type: ignore[no-untyped-def]
            assert add_generation_prompt and not tokenize
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

        def __call__(self, text, add_special_tokens=True):  # type: ignore[no-untyped-def]
            return {"input_ids": [ord(c) for c in text] + ([0] if add_special_tokens else [])}

    chat = Prompt(0, "a", None, ({"role": "user", "content": "a"},))
    assert make_encoder(Tok(), chat_template=True)(chat) == (
        "<user>a<assistant>",
        [ord(c) for c in "<user>a<assistant>"],
    )
    assert make_encoder(Tok(), chat_template=False)(Prompt(0, "a", None)) == ("a", [ord("a"), 0])
    Tok.chat_template = ""
    with pytest.raises(PromptError, match="no chat template"):
        make_encoder(Tok(), chat_template=True)
    with pytest.raises(
        PromptError, match=r"tok: the tokenizer has no chat template .*prompt 0 \(field 'prompt'\)"
    ):
        make_encoder(Tok())(chat)


def test_config_json_round_trip_of_prompts(tmp_path: Path) -> None:
    # answers that are numbers in JSON become strings, as the reward functions expect
    (tmp_path / "n.jsonl").write_text(json.dumps({"prompt": "2+2", "answer": 4.0}) + "\n")
    assert load_prompts(_data(prompts_file=str(tmp_path / "n.jsonl")))[0].answer == "4.0"
    assert math_answer("4", "4.0", extra={}, sample=STOP) == 1.0
