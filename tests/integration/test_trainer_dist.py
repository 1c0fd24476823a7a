"""The trainer on 2 torchrun ranks (CPU, gloo) on synthetic shards: it trains (parameters change, one metrics record
and one plan per step), and the gradient of a step on 2 ranks equals the gradient of the same step in one process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from buffer.plans import valid_plans
from buffer.weights import latest_version, verify_version

from ._trainer_helpers import command, make_run, metrics, run_ok, safetensors_dir, synth

GRAD_SCRIPT = Path(__file__).with_name("_trainer_grad.py")


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "cpu-offload"])
def test_two_ranks_train_on_synth_shards(tmp_path: Path, tiny_model_tied: Path, offload: bool) -> None:
    # with trainer.cpu_offload the shards live in host memory: publishing and checkpointing read them from there
    layout = make_run(
        tmp_path / "run", tiny_model_tied, trainer__save_every=2, trainer__cpu_offload=str(offload).lower()
    )
    synth(layout, shards=3, samples=32)
    cmd = command(2, "-m", "trainer", "--run-dir", layout.root, "--max-steps", 2)
    run_ok(cmd, tmp_path / "trainer.log")

    assert sorted(valid_plans(layout)) == [1, 2]
    recs = metrics(layout)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["samples"] == 32 and r["grad_norm"] > 0 for r in recs)
    assert latest_version(layout) == 2 and verify_version(layout, 2, checksums=True).step == 2
    base = safetensors_dir(tiny_model_tied)
    trained = safetensors_dir(layout.weight_version(2))
    assert trained.keys() == base.keys()
    changed = [k for k in base if not torch.equal(base[k].float(), trained[k].float())]
    assert len(changed) == len(base), f"unchanged: {sorted(set(base) - set(changed))}"
    assert all(torch.isfinite(t).all() for t in trained.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo",
    [
        {},
        # PPO with the whole-step whitening over ranks, the KL penalty in the reward and two updates per step;
        # checkpointed layers whose all-gathers run two layers ahead (their recompute in backward included), one
        # layer left out of checkpointing, and the LM head taking its gradient in forward (FSDP2 must reduce the
        # gradient it hands back in backward like any other)
        {
            "algorithm__name": "ppo",
            "algorithm__off_policy": "decoupled",
            "algorithm__whiten_advantages": "true",
            "algorithm__kl_coef": "0.1",
            "algorithm__kl_mode": "reward",
            "algorithm__gamma": "0.9",
            "algorithm__lam": "0.8",
            "trainer__updates_per_step": "2",
            "trainer__activation_checkpointing": "true",
            "trainer__fsdp_prefetch": "2",
            "trainer__activation_checkpointing_skip": "1",
            "trainer__fused_head": "true",
        },
        # parameters, gradients and optimizer state in host memory (FSDP2 CPU offload), two updates: the second
        # sees the weights the offloaded optimizer moved
        {"trainer__cpu_offload": "true", "trainer__updates_per_step": "2"},
    ],
    ids=["grpo", "ppo", "grpo-cpu-offload"],
)
def test_gradient_on_two_ranks_equals_one_process(tmp_path: Path, tiny_model_tied: Path, algo: dict) -> None:
    # Micro-batches of a few samples, so each rank runs several and the ranks differ in how many they need.
    layout = make_run(tmp_path / "one", tiny_model_tied, trainer__max_tokens_per_microbatch=64, **algo)
    synth(layout, shards=1, samples=32)
    shutil.copytree(layout.root, tmp_path / "two")  # the same shards, the same plan for step 1
    grads = {}
    for nproc, name in ((1, "one"), (2, "two")):
        out = tmp_path / f"grad-{name}.safetensors"
        run_ok(command(nproc, GRAD_SCRIPT, tmp_path / name, out), tmp_path / f"{name}.log")
        grads[name] = _load(out)
    one, two = grads["one"], grads["two"]
    assert one.keys() == two.keys()
    parts = {k.split("/")[0] for k in one if not k.startswith("param/")}
    assert parts == ({"actor", "critic"} if algo.get("algorithm__name") == "ppo" else {"actor"})
    for k in one:
        if k.startswith("param/"):
            assert torch.equal(one[k], two[k]), k
            continue
        scale = one[k].abs().max().item()
        assert scale > 0, f"{k}: zero gradient"
        # fp32 summation order differs between 1 and 2 ranks (~1e-7 relative), and after a first Adam update
        # near-zero gradients move weights by ~lr each, which leaves ~1e-6 of the largest gradient; a
        # normalisation or whitening error shows as 1e-2 and more.
        torch.testing.assert_close(
            two[k], one[k], rtol=1e-4, atol=2e-5 * scale, msg=lambda m, k=k: f"{k}: {m}"
        )


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.slow
def test_the_fused_head_on_two_ranks_gives_the_recomputing_heads_gradient(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    """``trainer.fused_head`` under FSDP2: the head's weight (tied to the embedding here) gets the gradient the head
    computed in forward, reduced over ranks like the others, and equal to that of the head recomputing its logits."""
    grads = {}
    for fused in ("false", "true"):
        layout = make_run(
            tmp_path / fused,
            tiny_model_tied,
            trainer__max_tokens_per_microbatch=64,
            trainer__logprob_chunk=7,
            trainer__activation_checkpointing="true",
            trainer__fused_head=fused,
            algorithm__kl_coef="0.1",
            algorithm__kl_mode="loss",
        )
        synth(layout, shards=1, samples=32)
        out = tmp_path / f"grad-{fused}.safetensors"
        run_ok(command(2, GRAD_SCRIPT, layout.root, out), tmp_path / f"{fused}.log")
        grads[fused] = _load(out)
    plain, fused_grads = grads["false"], grads["true"]
    assert plain.keys() == fused_grads.keys()
    assert any("embed_tokens" in k for k in plain if k.startswith("actor/"))
    for k in plain:
        scale = plain[k].abs().max().item()
        assert k.startswith("param/") or scale > 0, f"{k}: zero gradient"
        # the same fp32 products summed in another order
        torch.testing.assert_close(
            fused_grads[k], plain[k], rtol=1e-4, atol=1e-5 * scale, msg=lambda m, k=k: f"{k}: {m}"
        )
