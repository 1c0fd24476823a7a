"""Ulysses sequence parallelism (``trainer.sequence_parallel``) on 2 and 4 torchrun ranks (CPU, gloo): the logprobs,
entropies, values, step metrics and gradients of a packed step at K = 2 (and K = 4, where the tiny model's 2 KV
heads are repeated) equal those at K = 1 on the same samples, in fp32; and a run checkpointed at K = 1 resumes at
K = 2 into the step that K = 1 would have trained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ._trainer_helpers import command, make_run, metrics, run_ok, safetensors_dir, synth, trainer_args

WORKER = Path(__file__).with_name("_sp_worker.py")


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), json.loads(meta["metrics"])


def _embedded(path: Path) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(json.loads(f.metadata()["embedded_tokens"]))


def _assert_engaged(out: Path, case: str, k: int) -> None:
    """Each rank embedded a K-th of the tokens it embeds at K = 1 (each rank has the whole row there), up to the
    row's padding to a multiple of K: the setting was not ignored."""
    whole = _embedded(out / f"{case}-k1.safetensors")
    assert len(set(whole)) == 1 and whole[0] > 0, whole
    for seen in _embedded(out / f"{case}-k{k}.safetensors"):
        assert whole[0] / k <= seen < whole[0] / k + k, f"{case} K={k}: {seen} tokens embedded of {whole[0]}"


def _assert_equal_runs(out: Path, case: str, k: int) -> None:
    _assert_engaged(out, case, k)
    one, m_one = _load(out / f"{case}-k1.safetensors")
    sp, m_sp = _load(out / f"{case}-k{k}.safetensors")
    assert one.keys() == sp.keys()
    parts = {key.split("/")[1] for key in one if key.startswith("first/")}
    assert parts == ({"actor", "critic"} if case == "ppo" else {"actor"})
    for key, ref in one.items():
        scale = ref.abs().max().item()
        # LoRA's B starts at zero, so A's gradient is zero until B has moved
        assert scale > 0 or ".lora_A." in key, f"{case} {key}: all zero"
        if key.startswith("last/") and case == "grpo":
            # the second update starts from weights one Adam step moved: near-zero gradients move weights by ~lr
            # each, which leaves ~1e-5 of the largest gradient (as in test_trainer_dist)
            rtol, atol = 1e-4, 2e-5 * scale
        else:
            rtol, atol = 1e-5, 1e-5 * scale
        torch.testing.assert_close(sp[key], ref, rtol=rtol, atol=atol, msg=f"{case} K={k} {key}")
    assert m_one.keys() == m_sp.keys()
    for name, value in m_one.items():
        assert m_sp[name] == pytest.approx(value, rel=1e-5, abs=1e-7), f"{case} K={k} metric {name}"


@pytest.mark.slow
def test_two_ranks_k2_equals_k1(tmp_path: Path, tiny_model_tied: Path) -> None:
    run_ok(command(2, WORKER, tiny_model_tied, tmp_path, "grpo:1,2", "ppo:1,2", "lora:1,2"), tmp_path / "log")
    for case in ("grpo", "ppo", "lora"):
        _assert_equal_runs(tmp_path, case, 2)
    logp = _load(tmp_path / "grpo-k2.safetensors")[0]["direct/logp"]
    assert (logp != 0).sum() > 50  # the samples' response tokens after the first, scored


@pytest.mark.slow
def test_four_ranks_k2_and_k4_equal_k1(tmp_path: Path, tiny_model_tied: Path) -> None:
    # K = 2: two data-parallel groups of two; K = 4: one group, the 2 KV heads repeated to 4
    run_ok(command(4, WORKER, tiny_model_tied, tmp_path, "grpo:1,2,4"), tmp_path / "log")
    for k in (2, 4):
        _assert_equal_runs(tmp_path, "grpo", k)


@pytest.mark.slow
def test_checkpoint_at_k1_resumes_at_k2(tmp_path: Path, tiny_model_tied: Path) -> None:
    # every version full weights (not a delta), so that both runs' step-2 weights read as safetensors
    layout = make_run(
        tmp_path / "k1",
        tiny_model_tied,
        trainer__save_every=1,
        trainer__max_tokens_per_microbatch=64,
        trainer__publish_full_every=1,
    )
    synth(layout, shards=2, samples=32)
    run_ok(command(2, *trainer_args(layout, "--max-steps", 1)), tmp_path / "first.log")
    shutil.copytree(layout.root, tmp_path / "k2")
    other = type(layout).of(tmp_path / "k2")
    run_ok(command(2, *trainer_args(layout, "--max-steps", 1)), tmp_path / "k1.log")
    args = trainer_args(other, "--max-steps", 1, "--trainer.sequence_parallel", 2)
    run_ok(command(2, *args), tmp_path / "k2.log")
    one, two = metrics(layout)[-1], metrics(other)[-1]
    assert one["step"] == two["step"] == 2
    for name in ("loss", "grad_norm", "entropy", "mismatch_kl"):
        assert two[name] == pytest.approx(one[name], rel=1e-5), name
    w1, w2 = safetensors_dir(layout.weight_version(2)), safetensors_dir(other.weight_version(2))
    assert w1 and w1.keys() == w2.keys()
    for key in w1:
        torch.testing.assert_close(w2[key].float(), w1[key].float(), rtol=1e-4, atol=1e-5, msg=key)
