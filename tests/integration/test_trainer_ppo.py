"""PPO (critic + GAE) in the real trainer on synthetic shards: actor and critic both learn, and a resumed trainer
continues both from the checkpoint (parameters and optimizer state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._trainer_helpers import (
    adam_steps,
    checkpoint_tensors,
    command,
    make_run,
    metrics,
    run_ok,
    safetensors_dir,
    synth,
    trainer_args,
    trainer_state,
)


@pytest.mark.slow
def test_ppo_trains_actor_and_critic_and_resumes(tmp_path: Path, tiny_model_tied: Path) -> None:
    layout = make_run(
        tmp_path / "run",
        tiny_model_tied,
        algorithm__name="ppo",
        algorithm__whiten_advantages="true",
        algorithm__kl_coef="0.05",
        algorithm__kl_mode="reward",
        trainer__critic_lr="1e-3",
        trainer__save_every=1,
    )
    synth(layout, shards=3, samples=32)
    run_ok(command(1, *trainer_args(layout, "--max-steps", 2)), tmp_path / "first.log")
    run_ok(command(1, *trainer_args(layout, "--max-steps", 1)), tmp_path / "second.log")

    recs = metrics(layout)
    assert [(r["step"], r["resumed_from"]) for r in recs] == [(1, 0), (2, 0), (3, 2)]
    assert all(r["value_mse"] > 0 and r["critic_grad_norm"] > 0 and r["skipped_updates"] == 0 for r in recs)
    assert recs[0]["old_value_mean"] == 0  # a zero-initialised value head; later steps see a trained one
    assert recs[2]["old_value_mean"] != 0
    assert trainer_state(layout, 3)["parts"] == ["actor", "critic"]

    ckpt = checkpoint_tensors(layout, 3, tmp_path)
    # One optimizer step per training step for both parts: the resumed trainer continued the saved optimizers.
    assert adam_steps(ckpt, "actor") == adam_steps(ckpt, "critic") == {3}
    base = safetensors_dir(tiny_model_tied)
    assert ckpt["critic.model.value_head.weight"].abs().sum() > 0
    prefix = "critic.model.base."
    layers = {k.removeprefix(prefix): v for k, v in ckpt.items() if k.startswith(prefix + "layers.")}
    assert layers and all(not torch.equal(v, base[f"model.{k}"]) for k, v in layers.items())
    actor = safetensors_dir(layout.weight_version(3))
    assert all(not torch.equal(actor[k], base[k]) for k in base if k.startswith("model.layers."))
