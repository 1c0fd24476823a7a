"""RLOO, REINFORCE++, GSPO, sequence-level truncated IS, the new loss aggregations and the adaptive KL coefficient in
the real trainer on synthetic shards: each trains, and a resumed trainer continues the KL coefficient where the
checkpoint left it rather than from its configured start."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._trainer_helpers import command, make_run, metrics, run_ok, synth, trainer_args, trainer_state


@pytest.mark.slow
def test_reinforce_pp_with_gspo_and_adaptive_kl_resumes_the_coefficient(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    # KL in the reward (token rewards of REINFORCE++), two updates per step (so the decoupled objective has a
    # proximal policy of its own), sequence-level ratio and importance weight, Dr.GRPO's constant normaliser.
    layout = make_run(
        tmp_path / "run",
        tiny_model_tied,
        algorithm__name="reinforce_pp",
        algorithm__policy_loss="gspo",
        algorithm__off_policy="decoupled",
        algorithm__off_policy_level="sequence",
        algorithm__loss_agg="seq-mean-token-sum-norm",
        algorithm__kl_coef="0.5",
        algorithm__kl_mode="reward",
        algorithm__kl_target="100",  # far above any KL the run reaches: the coefficient shrinks each step
        algorithm__kl_horizon="64",
        trainer__updates_per_step="2",
        trainer__save_every=1,
    )
    synth(layout, shards=3, samples=32)
    run_ok(command(1, *trainer_args(layout, "--max-steps", 2)), tmp_path / "first.log")
    run_ok(command(1, *trainer_args(layout, "--max-steps", 1)), tmp_path / "second.log")

    recs = metrics(layout)
    assert [(r["step"], r["resumed_from"]) for r in recs] == [(1, 0), (2, 0), (3, 2)]
    assert all(r["grad_norm"] > 0 and r["skipped_updates"] == 0 for r in recs)
    # The penalty is taken on the policy before each step: still the reference at step 1, then moving away.
    assert recs[0]["kl_ref"] == 0 and recs[1]["kl_ref"] > 0 and recs[2]["kl_ref"] > 0
    assert all("is_weight" in r and "approx_kl" in r and "returns_mean" in r for r in recs)
    # KL below target: error clipped at -0.2, 32 samples per step over a 64-sample horizon -> x0.9 per step, and
    # the resumed incarnation continues from the saved value (0.405), not from kl_coef (0.5).
    assert [r["kl_coef"] for r in recs] == pytest.approx([0.5, 0.45, 0.405], rel=1e-9)
    saved = trainer_state(layout, 3)["extra"]["kl_controller"]["value"]
    assert saved == pytest.approx(0.3645, rel=1e-9)


@pytest.mark.slow
def test_rloo_with_sequence_level_tis_and_token_sum(tmp_path: Path, tiny_model_tied: Path) -> None:
    layout = make_run(
        tmp_path / "run",
        tiny_model_tied,
        algorithm__name="rloo",
        algorithm__off_policy="tis",
        algorithm__off_policy_level="sequence",
        algorithm__loss_agg="token-sum",
        algorithm__kl_coef="0.1",
    )
    synth(layout, shards=2, samples=32)
    run_ok(command(1, *trainer_args(layout, "--max-steps", 2)), tmp_path / "trainer.log")
    recs = metrics(layout)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["grad_norm"] > 0 and r["kl_coef"] == 0.1 and 0 < r["is_weight"] <= 2.0 for r in recs)
    assert "clip_frac_low" not in recs[0]  # truncated IS has no ratio to clip
