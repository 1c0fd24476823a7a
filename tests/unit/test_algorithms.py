"""RLOO, REINFORCE++, GSPO, sequence-level truncated IS and the adaptive KL coefficient (trainer/ppo.py), and how
trainer/step.py applies them, against numbers computed by hand in plain Python."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch

from buffer.config import ShardRLConfig, validate
from trainer import ppo, step
from trainer.data import Sample

F64 = torch.float64


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def close(a: torch.Tensor, b: object, atol: float = 1e-9) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------------------------- RLOO


def test_rloo_leave_one_out_by_hand() -> None:
    # Group 4: rewards 1, 0, 0.5 -> 1 - (0 + 0.5)/2 = 0.75, 0 - (1 + 0.5)/2 = -0.75, 0.5 - (1 + 0)/2 = 0
    # Group 9: rewards 2, 4      -> 2 - 4 = -2, 4 - 2 = 2
    # Group 2: reward 7 alone     -> 0 (nobody to compare against)
    # Group 6: 0.1, 0.1, 0.1      -> exactly 0 (in float64 (0.1 + 0.1) / 2 is 0.1, but the sum route is not exact)
    ids = torch.tensor([4, 9, 4, 2, 4, 9, 6, 6, 6])
    rewards = t([1.0, 2.0, 0.0, 7.0, 0.5, 4.0, 0.1, 0.1, 0.1])
    adv = ppo.rloo_advantages(rewards, ids)
    close(adv, [0.75, -2.0, -0.75, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0])
    assert adv[6:].tolist() == [0.0, 0.0, 0.0]
    ints = ppo.rloo_advantages(torch.tensor([1, 0]), torch.tensor([3, 3]))
    assert ints.dtype == torch.float32 and ints.tolist() == [1.0, -1.0]
    assert ppo.rloo_advantages(t([]), torch.tensor([], dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match=r"\[N\]"):
        ppo.rloo_advantages(t([[1.0]]), torch.tensor([[0]]))


def test_rloo_matches_reference_loop_and_is_grpo_scaled_by_g_over_g_minus_1() -> None:
    rng = random.Random(3)
    ids = [rng.randrange(5) for _ in range(30)]
    rewards = [float(rng.randrange(4)) for _ in ids]
    got = ppo.rloo_advantages(t(rewards), torch.tensor(ids)).tolist()
    centred = ppo.grpo_advantages(t(rewards), torch.tensor(ids), norm_by_std=False).tolist()
    for i, (g, r) in enumerate(zip(ids, rewards, strict=True)):
        others = [rr for j, (gg, rr) in enumerate(zip(ids, rewards, strict=True)) if gg == g and j != i]
        expected = r - statistics.mean(others) if others else 0.0
        assert got[i] == pytest.approx(expected, abs=1e-12)
        n = len(others) + 1
        if n > 1:
            assert got[i] == pytest.approx(centred[i] * n / (n - 1), abs=1e-12)


# -------------------------------------------------------------------------------------------------------- REINFORCE++


MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_reinforce_pp_returns_and_advantages_with_kl_in_reward_by_hand() -> None:
    # Rewards 1 and -1 on the last tokens; KL penalty 0.5 * kl per token, kl = [[0.1, 0.2, 0.3], [0.5, 0.4, junk]]:
    #   row 0 token rewards [-0.05, -0.1, 1 - 0.15] -> returns to go [0.70, 0.75, 0.85]
    #   row 1 token rewards [-0.25, -1 - 0.2]       -> returns to go [-1.45, -1.2]
    kl = t([[0.1, 0.2, 0.3], [0.5, 0.4, 99.0]]) * MASK
    rewards_tok = ppo.scalar_reward_to_tokens(t([1.0, -1.0]), MASK) - 0.5 * kl
    returns = ppo.reinforce_pp_returns(rewards_tok, MASK)
    close(returns, [[0.70, 0.75, 0.85], [-1.45, -1.2, 0.0]], atol=1e-12)
    # Whitened over the 5 tokens of the batch with the population std.
    flat = [0.70, 0.75, 0.85, -1.45, -1.2]
    mean, var = sum(flat) / 5, sum((x - sum(flat) / 5) ** 2 for x in flat) / 5
    w = [(x - mean) / math.sqrt(var + 1e-8) for x in flat]
    close(ppo.reinforce_pp_advantages(rewards_tok, MASK), [w[:3], [*w[3:], 0.0]], atol=1e-12)


def test_reinforce_pp_without_kl_gives_every_token_its_sequence_reward() -> None:
    returns = ppo.reinforce_pp_returns(ppo.scalar_reward_to_tokens(t([2.0, 0.5]), MASK), MASK)
    close(returns, [[2.0, 2.0, 2.0], [0.5, 0.5, 0.0]])


def _cfg(**algorithm: object) -> ShardRLConfig:
    return validate(
        {
            "reward": {"function": "max_digit"},
            "algorithm": algorithm,
            "rollout": {"sampling": {"n": 2, "max_response_length": 3}},
            "trainer": {"samples_per_step": 4},
        },
        "test",
    )


def _batch(rewards: list[float], lengths: list[int]) -> step.Batch:
    T = max(lengths)
    return {
        "response_mask": torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths]),
        "rewards": torch.tensor(rewards),
    }


def test_reinforce_pp_step_whitens_over_the_whole_step_not_per_micro_batch() -> None:
    # Two updates of one micro-batch each: rewards [1, 0] with 2 + 1 tokens, and [3] with 2 tokens.  The returns
    # are the rewards on every token: [1, 1, 0] and [3, 3]; one whitening over all 5 tokens.
    cfg = _cfg(name="reinforce_pp", off_policy="none")  # no proximal logprobs: no model needed
    minis = [
        step.MiniBatch([], [_batch([1.0, 0.0], [2, 1])], [3], (3.0, 2.0)),
        step.MiniBatch([], [_batch([3.0], [2])], [2], (2.0, 1.0)),
    ]
    metrics = step._Metrics()
    step.prepare(cfg, step.Models(None, None, None), minis, metrics)  # type: ignore[arg-type]
    flat = [1.0, 1.0, 0.0, 3.0, 3.0]
    mean = sum(flat) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in flat) / 5 + 1e-8)
    w = [(x - mean) / sd for x in flat]
    close(minis[0].batches[0]["advantages"], [[w[0], w[1]], [w[2], 0.0]], atol=1e-6)
    close(minis[1].batches[0]["advantages"], [[w[3], w[4]]], atol=1e-6)
    # returns_mean: each micro-batch's token mean weighted by its share of its update's tokens, / 2 updates
    assert metrics.reduced()["returns_mean"] == pytest.approx((2 / 3 + 3.0) / 2)


# --------------------------------------------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_clips_whole_sequences_by_hand() -> None:
    # log-ratios per row, clip range [0.8, 1.2]:
    #   row 0: [0.1, 0.3]        mean 0.2  -> s = e^0.2 = 1.2214 > 1.2, A = +1: every token -1.2 (clipped)
    #   row 1: [-0.5, -0.1, -0.3] mean -0.3 -> s = e^-0.3 = 0.7408 < 0.8, A = -1: every token 0.8 (clipped)
    #   row 2: [0.05, -0.05]     mean 0    -> s = 1, A = +2: every token -2
    # token-mean over 7 tokens: (2 * -1.2 + 3 * 0.8 + 2 * -2) / 7
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    log_ratio = t([[0.1, 0.3, 9.0], [-0.5, -0.1, -0.3], [0.05, -0.05, 9.0]])
    adv = t([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [2.0, 2.0, 0.0]])
    logp = log_ratio.clone().requires_grad_()
    loss, m = ppo.policy_loss(
        logp,
        torch.zeros_like(logp),
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        agg_mode="token-mean",
        ratio_level="sequence",
    )
    close(loss, (2 * -1.2 + 3 * 0.8 + 2 * -2.0) / 7)
    close(m["clip_frac_high"], 2 / 7, atol=1e-6)
    close(m["clip_frac_low"], 3 / 7, atol=1e-6)
    # approx_kl stays the token-level k3 of KL(old || current): mean of e^x - 1 - x over the 7 tokens
    toks = [0.1, 0.3, -0.5, -0.1, -0.3, 0.05, -0.05]
    close(m["approx_kl"], sum(math.exp(x) - 1 - x for x in toks) / 7)
    loss.backward()
    # Clipped rows get no gradient; row 2's tokens get -A * s / 7 = -2/7 each.
    assert logp.grad is not None
    close(logp.grad, [[0, 0, 0], [0, 0, 0], [-2 / 7, -2 / 7, 0]])
    # Token-level PPO on the same input clips only row 0's second token (e^0.3 = 1.35) and row 1's first and
    # third (e^-0.5 = 0.61, e^-0.3 = 0.74; e^-0.1 = 0.90 is inside): 3 of 7 tokens, where the sequence ratio cut 5.
    _, tok = ppo.policy_loss(
        logp.detach(),
        torch.zeros_like(logp),
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        agg_mode="token-mean",
    )
    close(tok["clip_frac_high"] + tok["clip_frac_low"], 3 / 7, atol=1e-6)


def test_gspo_gradient_is_the_gradient_of_the_sequence_ratio() -> None:
    # With one advantage per sequence and seq-mean-token-mean, the GSPO loss is mean over sequences of -A * s_i with
    # s_i = exp(mean_t(logp - old)): compare autograd of that direct formula with policy_loss (clips wide open).
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    old = torch.randn(3, 4, dtype=F64) * 0.3 - 1.0
    adv_seq = t([0.7, -1.3, 2.0])
    logp = (old + torch.randn(3, 4, dtype=F64) * 0.1).requires_grad_()
    loss, _ = ppo.policy_loss(
        logp,
        old,
        adv_seq[:, None].expand(3, 4),
        mask,
        clip_low=10.0,
        clip_high=10.0,
        dual_clip=None,
        agg_mode="seq-mean-token-mean",
        ratio_level="sequence",
    )
    loss.backward()
    assert logp.grad is not None
    got = logp.grad.clone()
    x = logp.detach().clone().requires_grad_()
    m = mask.to(F64)
    s = torch.exp(((x - old) * m).sum(1) / m.sum(1))
    (-(adv_seq * s)).mean().backward()
    assert x.grad is not None
    close(got, x.grad, atol=1e-12)
    close(loss, (-(adv_seq * s.detach())).mean().item(), atol=1e-12)


def test_sequence_log_ratio_value_is_the_row_mean() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    got = ppo.sequence_log_ratio(t([[0.2, 0.6, 50.0], [1.0, 2.0, 3.0]]), torch.zeros(2, 3, dtype=F64), mask)
    close(got, [[0.4, 0.4, 0.4], [0.0, 0.0, 0.0]])  # a row without tokens has ratio 1


# ----------------------------------------------------------------------------------------- sequence-level truncated IS


def test_sequence_level_truncated_is_weight_by_hand() -> None:
    # log(prox / behaviour) per token; cap 2:
    #   row 0: 0.2 + 0.3 = 0.5         -> e^0.5 = 1.6487 on every position of the row
    #   row 1: 0.5 + 0.4 + 0.3 = 1.2   -> e^1.2 = 3.32 -> capped at 2 (token level: e^0.5, e^0.4, e^0.3, all < 2)
    #   row 2: 0.1 (masked junk 9.0)   -> e^0.1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    prox = t([[0.2, 0.3, 0.0], [0.5, 0.4, 0.3], [0.1, 9.0, 9.0]])
    behaviour = torch.zeros(3, 3, dtype=F64)
    w = ppo.truncated_is_weight(prox, behaviour, 2.0, mask, "sequence")
    close(w, [[math.exp(0.5)] * 3, [2.0] * 3, [math.exp(0.1)] * 3], atol=1e-12)
    tok = ppo.truncated_is_weight(prox, behaviour, 2.0, mask, "token")
    close(tok[1], [math.exp(0.5), math.exp(0.4), math.exp(0.3)], atol=1e-12)
    with pytest.raises(ValueError, match="mask"):
        ppo.truncated_is_weight(prox, behaviour, 2.0, level="sequence")


# ------------------------------------------------------------------------------------------------------ adaptive KL


def test_adaptive_kl_controller_by_hand() -> None:
    # value 0.1, target 0.05, horizon 1000 samples, 100 samples per step:
    #   kl 0.1:   error clip(0.1/0.05 - 1) = clip(1.0) = 0.2   -> 0.1 * (1 + 0.2 * 0.1)   = 0.102
    #   kl 0.05:  error 0                                       -> 0.102
    #   kl 0.045: error -0.1                                    -> 0.102 * (1 - 0.01)      = 0.10098
    #   kl 0.0:   error clip(-1) = -0.2                         -> 0.10098 * (1 - 0.02)    = 0.0989604
    #   kl nan:   unchanged (a broken step must not poison the coefficient)
    ctl = ppo.KLController(0.1, target=0.05, horizon=1000.0)
    expected = [0.102, 0.102, 0.102 * 0.99, 0.102 * 0.99 * 0.98, 0.102 * 0.99 * 0.98]
    for kl, want in zip([0.1, 0.05, 0.045, 0.0, float("nan")], expected, strict=True):
        ctl.update(kl, 100)
        assert ctl.value == pytest.approx(want, rel=1e-12)
    fixed = ppo.KLController(0.1)
    fixed.update(10.0, 100)
    assert fixed.value == 0.1


def test_kl_controller_state_survives_a_json_round_trip_through_models() -> None:
    cfg = _cfg(name="grpo", kl_coef=0.2, kl_target=0.01, kl_horizon=8.0)
    models = step.Models(None, None, None, kl=step.kl_controller(cfg))  # type: ignore[arg-type]
    assert models.kl is not None and models.kl.value == 0.2
    models.kl.update(1.0, 4)  # error +0.2 -> 0.2 * (1 + 0.2 * 4 / 8) = 0.22
    saved = json.loads(json.dumps(models.state()))
    fresh = step.Models(None, None, None, kl=step.kl_controller(cfg))  # type: ignore[arg-type]
    fresh.load_state(saved)
    assert fresh.kl is not None and fresh.kl.value == pytest.approx(0.22, rel=1e-15)
    fresh.load_state({})  # a checkpoint from before the controller: keeps the configured start
    assert fresh.kl.value == pytest.approx(0.22, rel=1e-15)
    assert step.kl_controller(_cfg(name="grpo")) is None
    assert step.Models(None, None, None).state() == {}  # type: ignore[arg-type]


def test_step_logs_the_coefficient_it_used_then_adapts() -> None:
    cfg = _cfg(name="ppo", kl_coef=0.5, kl_target=0.1, kl_horizon=10.0)
    models = step.Models(None, None, None, kl=step.kl_controller(cfg))  # type: ignore[arg-type]
    out = {"kl_ref": 0.3}
    step._adapt_kl(cfg, models, out, 5)
    # kl 0.3 vs target 0.1: error clip(2) = 0.2 -> 0.5 * (1 + 0.2 * 5 / 10) = 0.55
    assert out["kl_coef"] == 0.5
    assert models.kl is not None and models.kl.value == pytest.approx(0.55)


# ------------------------------------------------------------------------------------------------ per-sample groups


def _sample(group: str, reward: float) -> Sample:
    return Sample(f"{group}-{reward}", group, [1], [2], [-0.5], reward, 0)


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        # group a: 1, 0, 0.5 (mean 0.5); group b: 3, 1
        ({"name": "rloo"}, [0.75, -0.75, 0.0, 2.0, -2.0]),
        ({"name": "grpo", "norm_adv_by_std": False}, [0.5, -0.5, 0.0, 1.0, -1.0]),
        ({"name": "reinforce_pp"}, [0.0] * 5),  # per token, computed later in prepare
    ],
)
def test_group_sample_advantages_follow_the_algorithm(algorithm: dict, expected: list[float]) -> None:
    samples = [_sample("a", 1.0), _sample("a", 0.0), _sample("a", 0.5), _sample("b", 3.0), _sample("b", 1.0)]
    step.group_sample_advantages(_cfg(**algorithm), samples)
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-12)
