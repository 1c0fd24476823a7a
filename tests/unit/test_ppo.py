"""trainer/ppo.py against hand-computed values and plain-Python reference loops."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from trainer import ppo

F64 = torch.float64


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def close(a: torch.Tensor, b: object, atol: float = 1e-9) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------------------------- GAE


def test_gae_two_sequences_of_different_lengths_by_hand() -> None:
    # gamma 0.9, lam 0.8 -> gamma * lam = 0.72.  Row 0 has 3 tokens, row 1 has 2 (its third value is padding junk).
    # Row 0, V = [0.5, 0.4, 0.3], reward 1 on t=2:
    #   t=2: d = 1 - 0.3 = 0.7                      A = 0.7
    #   t=1: d = 0.9*0.3 - 0.4 = -0.13              A = -0.13 + 0.72*0.7   = 0.374
    #   t=0: d = 0.9*0.4 - 0.5 = -0.14              A = -0.14 + 0.72*0.374 = 0.12928
    #   returns = A + V = [0.62928, 0.774, 1.0]
    # Row 1, V = [0.2, 0.6], reward -1 on t=1:
    #   t=1: d = -1 - 0.6 = -1.6                    A = -1.6
    #   t=0: d = 0.9*0.6 - 0.2 = 0.34               A = 0.34 + 0.72*(-1.6) = -0.812
    #   returns = [-0.612, -1.0, 0]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = ppo.scalar_reward_to_tokens(t([1.0, -1.0]), mask)
    close(rewards, [[0, 0, 1.0], [0, -1.0, 0]])
    values = t([[0.5, 0.4, 0.3], [0.2, 0.6, 9.0]])
    adv, ret = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.12928, 0.374, 0.7], [-0.812, -1.6, 0.0]])
    close(ret, [[0.62928, 0.774, 1.0], [-0.612, -1.0, 0.0]])


def _gae_reference(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    n = len(rewards)
    adv = [0.0] * n
    for i in reversed(range(n)):
        next_v = values[i + 1] if i + 1 < n else 0.0
        next_a = adv[i + 1] if i + 1 < n else 0.0
        adv[i] = rewards[i] + gamma * next_v - values[i] + gamma * lam * next_a
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def test_gae_matches_reference_loop_on_random_right_padded_batch() -> None:
    rng = random.Random(0)
    lengths = [7, 1, 0, 4, 5]
    T = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    values = t([[rng.uniform(-1, 1) for _ in range(T)] for _ in lengths])
    reward = t([rng.uniform(-1, 1) for _ in lengths])
    rewards_tok = ppo.scalar_reward_to_tokens(reward, mask)
    adv, ret = ppo.gae(rewards_tok, values, mask, gamma=0.95, lam=0.7)
    for b, n in enumerate(lengths):
        r = [0.0] * n
        if n:
            r[-1] = float(reward[b])
        ref_adv, ref_ret = _gae_reference(r, values[b, :n].tolist(), 0.95, 0.7)
        close(adv[b], ref_adv + [0.0] * (T - n))
        close(ret[b], ref_ret + [0.0] * (T - n))


def test_scalar_reward_to_tokens_last_valid_token_and_empty_row() -> None:
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    close(ppo.scalar_reward_to_tokens(t([1.0, -2.0, 5.0]), mask), [[0, 0, 1.0], [0, -2.0, 0], [0, 0, 0]])


def test_whiten_masked_by_hand() -> None:
    # Valid entries 1, 2, 3, 5: mean 2.75; deviations -1.75, -0.75, 0.25, 2.25;
    # population var = (3.0625 + 0.5625 + 0.0625 + 5.0625) / 4 = 2.1875.
    x = t([[1.0, 2.0, 3.0], [5.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    s = math.sqrt(2.1875 + 1e-8)
    close(ppo.whiten(x, mask), [[-1.75 / s, -0.75 / s, 0.25 / s], [2.25 / s, 0, 0]])
    close(
        ppo.whiten(x, mask, shift_mean=False),
        [[-1.75 / s + 2.75, -0.75 / s + 2.75, 0.25 / s + 2.75], [2.25 / s + 2.75, 0, 0]],
    )


# --------------------------------------------------------------------------------------------------------------- GRPO


def test_grpo_groups_with_std_without_std_size_one_and_all_equal() -> None:
    # Groups (ids deliberately non-contiguous and interleaved):
    #   7: rewards 1, 0, 1, 0  -> mean 0.5, centred +-0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6)
    #   3: reward 0.5 alone     -> 0
    #   5: rewards 2, 2, 2      -> 0
    #   9: rewards 3, 1         -> mean 2, centred +-1, std 1 -> +-1 / (1 + 1e-6)
    ids = torch.tensor([7, 3, 7, 5, 9, 7, 5, 9, 7, 5])
    rewards = t([1.0, 0.5, 0.0, 2.0, 3.0, 1.0, 2.0, 1.0, 0.0, 2.0])
    a = 0.5 / (0.5 + 1e-6)
    b = 1.0 / (1.0 + 1e-6)
    close(ppo.grpo_advantages(rewards, ids, norm_by_std=True), [a, 0, -a, 0, b, a, 0, -b, -a, 0])
    # Dr.GRPO: centring only.
    close(ppo.grpo_advantages(rewards, ids, norm_by_std=False), [0.5, 0, -0.5, 0, 1.0, 0.5, 0, -1.0, -0.5, 0])


def test_grpo_all_equal_rewards_are_exactly_zero_not_rounding_over_eps() -> None:
    # In float64, (0.1 + 0.1 + 0.1) / 3 - 0.1 = 1.4e-17, not 0; without the explicit zeroing that residue over
    # (its own std + eps) would come out as ~1.4e-11.
    adv = ppo.grpo_advantages(t([0.1, 0.1, 0.1, 0.7]), torch.tensor([0, 0, 0, 1]), norm_by_std=True)
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    adv32 = ppo.grpo_advantages(torch.tensor([1, 0, 1, 1]), torch.tensor([2, 2, 5, 5]), norm_by_std=False)
    assert adv32.dtype == torch.float32
    assert adv32.tolist() == [0.5, -0.5, 0.0, 0.0]


def test_grpo_matches_reference_loop() -> None:
    rng = random.Random(1)
    ids = [rng.randrange(6) for _ in range(40)]
    rewards = [float(rng.randrange(3)) for _ in ids]
    for norm in (True, False):
        got = ppo.grpo_advantages(t(rewards), torch.tensor(ids), norm_by_std=norm).tolist()
        for i, (g, r) in enumerate(zip(ids, rewards, strict=True)):
            group = [rr for gg, rr in zip(ids, rewards, strict=True) if gg == g]
            if len(set(group)) == 1:
                expected = 0.0
            else:
                expected = r - statistics.mean(group)
                if norm:
                    expected /= statistics.pstdev(group) + 1e-6
            assert got[i] == pytest.approx(expected, abs=1e-9)


# ----------------------------------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand() -> None:
    # d = logp - ref = [0.5, -1.0]
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    close(ppo.kl_estimate(logp, ref, "k1"), [0.5, -1.0])
    close(ppo.kl_estimate(logp, ref, "k2"), [0.125, 0.5])  # d^2 / 2
    # k3 = exp(ref - logp) - (ref - logp) - 1: exp(-0.5) + 0.5 - 1, exp(1) - 1 - 1
    close(ppo.kl_estimate(logp, ref, "k3"), [0.10653065971263342, 0.7182818284590451])
    with pytest.raises(ValueError, match="k1, k2, k3"):
        ppo.kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_k3_is_finite_for_a_wild_token() -> None:
    assert torch.isfinite(ppo.kl_estimate(t([-200.0]), t([-1.0]), "k3")).all()


def test_k3_is_clamped_to_ten_and_carries_no_gradient_beyond() -> None:
    # d = logp - ref = [-5, 3, 0.5].  k3 = exp(-d) + d - 1:
    #   d = -5:  exp(5) - 6 = 142.41...  -> clamped to 10 (the unclamped estimator returned 142.41)
    #   d = 3:   exp(-3) + 2 = 2.0498...    (inside the range: unchanged)
    #   d = 0.5: exp(-0.5) - 0.5 = 0.1065...
    logp = t([[-6.0, -1.0, -1.0]]).requires_grad_()
    ref = t([[-1.0, -4.0, -1.5]])
    unclamped = [math.exp(5) - 6, math.exp(-3) + 2, math.exp(-0.5) - 0.5]
    assert unclamped[0] > 142
    close(ppo.kl_estimate(logp, ref, "k3"), [[10.0, unclamped[1], unclamped[2]]])
    # d k3 / d logp = 1 - exp(-d): 0 on the clamped token, 1 - exp(-3) and 1 - exp(-0.5) elsewhere (sum-aggregated)
    ppo.kl_estimate(logp, ref, "k3").sum().backward()
    assert logp.grad is not None
    close(logp.grad, [[0.0, 1 - math.exp(-3), 1 - math.exp(-0.5)]])


def test_mismatch_kl_is_masked_k3_of_behaviour_vs_train() -> None:
    # Token 0: train - behaviour = log 2 -> r = 2: 2 - 1 - log 2 = 0.30685281944;  token 1: equal -> 0;
    # token 2 masked out.  Mean over 2 tokens = 0.15342640972.
    behaviour = t([[-1.0, -2.0, -3.0]])
    train = behaviour + t([[math.log(2.0), 0.0, 5.0]])
    got = ppo.mismatch_kl(train, behaviour, torch.tensor([[1, 1, 0]]))
    close(got, (1.0 - math.log(2.0)) / 2)


# -------------------------------------------------------------------------------------------------------- aggregation


LOSS = t([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "local", "with_global"),
    [
        # (1+2+3+4) / 4 tokens = 2.5;              with global_tokens 10: 10 / 10 = 1.0
        ("token-mean", 2.5, 1.0),
        # (mean(1,2,3) + mean(4)) / 2 seqs = 3;    with global_seqs 4: 6 / 4 = 1.5
        ("seq-mean-token-mean", 3.0, 1.5),
        # (6 + 4) / 2 seqs = 5;                    with global_seqs 4: 10 / 4 = 2.5
        ("seq-mean-token-sum", 5.0, 2.5),
        # (6/3 + 4/3) / 2 seqs, T = 3 columns;     with global_seqs 4, norm_length 5: (6/5 + 4/5) / 4 = 0.5
        ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2, 0.5),
        # 1+2+3+4 = 10, whatever the counts
        ("token-sum", 10.0, 10.0),
    ],
)
def test_aggregate_modes_by_hand(mode: ppo.AggMode, local: float, with_global: float) -> None:
    close(ppo.aggregate(LOSS, MASK, mode), local)
    close(ppo.aggregate(LOSS, MASK, mode, global_tokens=10.0, global_seqs=4.0, norm_length=5.0), with_global)


def test_aggregate_empty_rows_do_not_count_as_sequences() -> None:
    loss = torch.cat([LOSS, t([[7.0, 7.0, 7.0]])])
    mask = torch.cat([MASK, torch.tensor([[0, 0, 0]])])
    close(ppo.aggregate(loss, mask, "seq-mean-token-sum"), 5.0)
    close(ppo.aggregate(t([[1.0]]), torch.tensor([[0]]), "token-mean"), 0.0)


@pytest.mark.parametrize("mode", ppo.AGG_MODES)
def test_aggregate_split_batch_with_global_counts_equals_whole(mode: ppo.AggMode) -> None:
    # Lengths 5, 1, 3, 2 -> 11 tokens, 4 seqs; row sums 2.9, 4.0, 1.25, -1.0 (total 7.15).  Split 1 + 3 rows
    # (5 + 6 tokens): averaging the parts' local means differs from the whole; global counts make the parts add up.
    # The second part is cut to its own padded width (3 columns), as collate pads each micro-batch: the constant
    # norm_length (7, the run's maximum response length) keeps seq-mean-token-sum-norm independent of that width.
    loss = t([[0.3, -1.2, 2.0, 0.7, 1.1], [4.0, 9, 9, 9, 9], [-0.5, 0.25, 1.5, 9, 9], [2.0, -3.0, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    whole = ppo.aggregate(loss, mask, mode, norm_length=7.0)
    parts = [(loss[:1], mask[:1]), (loss[1:, :3], mask[1:, :3])]
    halves = [
        ppo.aggregate(x, m, mode, global_tokens=11.0, global_seqs=4.0, norm_length=7.0) for x, m in parts
    ]
    close(halves[0] + halves[1], whole.item(), atol=1e-12)
    local_avg = sum(ppo.aggregate(x, m, mode, norm_length=7.0) for x, m in parts) / 2
    assert abs(local_avg.item() - whole.item()) > 1e-3
    expected = {
        "token-mean": 7.15 / 11,
        "seq-mean-token-mean": (2.9 / 5 + 4.0 / 1 + 1.25 / 3 - 1.0 / 2) / 4,
        "seq-mean-token-sum": 7.15 / 4,
        "seq-mean-token-sum-norm": 7.15 / 7 / 4,
        "token-sum": 7.15,
    }
    close(whole, expected[mode], atol=1e-12)


def test_sum_norm_without_the_constant_depends_on_the_padded_width() -> None:
    # The same two sequences (sums 6 and 4) padded to 3 or to 8 columns: the fallback normaliser is the width, so
    # the loss changes with padding alone; the constant norm_length does not.
    narrow = (LOSS, MASK)
    wide = (
        torch.cat([LOSS, torch.zeros(2, 5, dtype=F64)], 1),
        torch.cat([MASK, torch.zeros(2, 5, dtype=MASK.dtype)], 1),
    )
    agg = "seq-mean-token-sum-norm"
    close(ppo.aggregate(*narrow, agg), 10 / 3 / 2)
    close(ppo.aggregate(*wide, agg), 10 / 8 / 2)
    close(ppo.aggregate(*narrow, agg, norm_length=4.0), ppo.aggregate(*wide, agg, norm_length=4.0).item())
    with pytest.raises(ValueError, match="norm_length"):
        ppo.aggregate(*narrow, agg, norm_length=0.0)
    with pytest.raises(ValueError, match="token-sum"):
        ppo.aggregate(*narrow, "seq-sum")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------------ policy


def _policy(
    log_ratio: list[float], adv: list[float], mask: list[int] | None = None, **kw: object
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logp = t([log_ratio]).requires_grad_()
    m = torch.tensor([mask if mask is not None else [1] * len(adv)])
    args: dict[str, object] = {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip": None,
        "agg_mode": "token-mean",
    } | kw
    return ppo.policy_loss(logp, torch.zeros_like(logp), t([adv]), m, **args)  # type: ignore[arg-type]


def test_policy_loss_ratio_clipping_and_fractions_by_hand() -> None:
    # clip range [0.8, 1.28].  Per token max(-A*r, -A*clip(r)):
    #   r 0.5, A -1: max(0.5, 0.8)    = 0.8    low clip active
    #   r 0.9, A -1: max(0.9, 0.9)    = 0.9
    #   r 1.0, A +1: max(-1, -1)      = -1.0
    #   r 1.5, A +1: max(-1.5, -1.28) = -1.28  high clip active
    #   r 1.5, A -1: max(1.5, 1.28)   = 1.5    (not clipped: moving away makes the loss worse)
    #   r 0.5, A +1: max(-0.5, -0.8)  = -0.5
    #   r 0.1, A -1: masked out
    # sum = 0.8 + 0.9 - 1 - 1.28 + 1.5 - 0.5 = 0.42 over 6 tokens = 0.07
    ratios = [0.5, 0.9, 1.0, 1.5, 1.5, 0.5, 0.1]
    loss, m = _policy([math.log(r) for r in ratios], [-1, -1, 1, 1, -1, 1, -1], [1, 1, 1, 1, 1, 1, 0])
    close(loss, 0.07)
    close(m["clip_frac_low"], 1 / 6)
    close(m["clip_frac_high"], 1 / 6)
    close(m["dual_clip_frac"], 0.0)
    # approx_kl = mean of r - 1 - log r over the 6 valid tokens
    kl = sum(r - 1 - math.log(r) for r in ratios[:6]) / 6
    close(m["approx_kl"], kl)
    assert all(not v.requires_grad for v in m.values())


def test_dual_clip_bounds_negative_advantage_with_huge_ratio() -> None:
    # r = 10, A = -1: the ordinary clipped surrogate is max(10, 1.28) = 10; the dual clip c = 3 caps it at 3,
    # and the token then carries no gradient.
    loss, m = _policy([math.log(10.0)], [-1.0])
    close(loss, 10.0)
    loss, m = _policy([math.log(10.0)], [-1.0], dual_clip=3.0)
    close(loss, 3.0)
    close(m["dual_clip_frac"], 1.0)
    logp = t([[math.log(10.0)]]).requires_grad_()
    ppo.policy_loss(
        logp,
        t([[0.0]]),
        t([[-2.0]]),
        torch.tensor([[1]]),
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        agg_mode="token-mean",
    )[0].backward()
    assert logp.grad is not None and logp.grad.item() == 0.0
    # Positive advantages are not touched by the dual clip: r = 10, A = 1 -> -1.28.
    loss, m = _policy([math.log(10.0)], [1.0], dual_clip=3.0)
    close(loss, -1.28)
    close(m["dual_clip_frac"], 0.0)
    with pytest.raises(ValueError, match="dual_clip"):
        _policy([0.0], [1.0], dual_clip=1.0)


def test_policy_loss_without_metrics_is_the_same_loss_and_gradient() -> None:
    # the fused head evaluates the loss once per chunk for its gradient alone: metrics=False must change nothing else
    g = torch.Generator().manual_seed(0)
    old, adv = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).long()
    args: dict = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg_mode="seq-mean-token-mean")
    out = []
    for metrics in (True, False):
        logp = (old + 0.5 * torch.randn(3, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, m = ppo.policy_loss(logp, old, adv, mask, metrics=metrics, **args)
        loss.backward()
        out.append((loss.detach(), logp.grad, m))
    (l1, g1, m1), (l2, g2, m2) = out
    assert torch.equal(l1, l2) and g1 is not None and torch.equal(g1, g2)
    assert set(m1) == {"clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl"} and m2 == {}


def test_policy_loss_divides_by_the_normalisers_it_is_given() -> None:
    # r = 1, A = [2, -1]: per-token losses [-2, 1], sum -1.  token-mean over 4 tokens of the whole step: -0.25;
    # seq-mean-token-sum over 2 sequences: -0.5; seq-mean-token-sum-norm over 2 sequences of length 4: -0.125.
    close(_policy([0.0, 0.0], [2.0, -1.0], norms=ppo.Normalisers(tokens=4.0))[0], -0.25)
    close(
        _policy([0.0, 0.0], [2.0, -1.0], agg_mode="seq-mean-token-sum", norms=ppo.Normalisers(seqs=2.0))[0],
        -0.5,
    )
    norm = ppo.Normalisers(tokens=9.0, seqs=2.0, length=4.0)
    close(_policy([0.0, 0.0], [2.0, -1.0], agg_mode="seq-mean-token-sum-norm", norms=norm)[0], -0.125)
    close(_policy([0.0, 0.0], [2.0, -1.0])[0], -0.5)  # no normalisers: the local token count, 2


def test_policy_loss_settings_are_keyword_only() -> None:
    logp = t([[0.0]])
    with pytest.raises(TypeError):
        ppo.policy_loss(logp, logp, logp, torch.ones(1, 1), 0.2, 0.28, None, "token-mean")  # type: ignore[misc]


def test_importance_weight_multiplies_per_token_loss() -> None:
    # r = 1 on both tokens: per-token losses -A = [-2, 1]; weights [0.5, 2] -> [-1, 2]; token-mean 0.5.
    loss, _ = _policy([0.0, 0.0], [2.0, -1.0], is_weight=t([[0.5, 2.0]]))
    close(loss, 0.5)


def test_positive_advantage_raises_logp_after_one_sgd_step() -> None:
    # Two one-token sequences over a 3-token vocabulary; row 0 gets A = +1, row 1 A = -1, same token 0.
    torch.manual_seed(0)
    logits = torch.randn(2, 1, 3, dtype=F64, requires_grad=True)
    tokens = torch.tensor([[0], [0]])

    def logp_of(lg: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(lg, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)

    logp = logp_of(logits)
    before = logp.detach().clone()
    loss, _ = ppo.policy_loss(
        logp,
        before,
        t([[1.0], [-1.0]]),
        torch.ones(2, 1),
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        agg_mode="token-mean",
    )
    # At r = 1, d loss / d logp = -A * r / 2 tokens = [-0.5, +0.5].
    logp.retain_grad()
    loss.backward()
    assert logp.grad is not None
    close(logp.grad, [[-0.5], [0.5]])
    assert logits.grad is not None
    with torch.no_grad():
        after = logp_of(logits - 0.5 * logits.grad)
    assert after[0, 0] > before[0, 0]
    assert after[1, 0] < before[1, 0]


def test_truncated_is_weight_is_capped_and_detached() -> None:
    # exp([0, log 3, log 0.5] - 0) = [1, 3, 0.5], cap 2 -> [1, 2, 0.5]; a huge log-ratio must not overflow.
    current = t([[0.0, math.log(3.0), math.log(0.5), 1000.0]]).requires_grad_()
    w = ppo.truncated_is_weight(current, torch.zeros(1, 4, dtype=F64), cap=2.0)
    close(w, [[1.0, 2.0, 0.5, 2.0]], atol=1e-12)
    assert not w.requires_grad


# ------------------------------------------------------------------------------------------------------------- value


def test_value_loss_clipping_by_hand() -> None:
    # clip 0.2, V_clip = V_old + clip(V - V_old, -0.2, 0.2); per token 0.5 * max((V-R)^2, (V_clip-R)^2):
    #   V 1.0, old 0.5, R 2.0: V_clip 0.7; max(1, 1.69)   -> 0.845  clipped (gradient cut)
    #   V 0.5, old 0.5, R 0.0: V_clip 0.5; max(0.25, 0.25) -> 0.125
    #   V 0.0, old 0.5, R 0.0: V_clip 0.3; max(0, 0.09)    -> 0.045  clipped
    #   V 1.0, old 0.5, R 0.0: V_clip 0.7; max(1, 0.49)    -> 0.5    (moved away from R: not clipped)
    # token-mean = 1.515 / 4 = 0.37875; clip fraction 2/4; unclipped mse (1 + 0.25 + 0 + 1) / 4 = 0.5625.
    values = t([[1.0, 0.5, 0.0, 1.0]]).requires_grad_()
    loss, m = ppo.value_loss(
        values, t([[0.5, 0.5, 0.5, 0.5]]), t([[2.0, 0.0, 0.0, 0.0]]), torch.ones(1, 4), 0.2, "token-mean"
    )
    close(loss, 0.37875)
    close(m["value_clip_frac"], 0.5)
    close(m["value_mse"], 0.5625)
    loss.backward()
    # Gradient (V - R) / 4 where unclipped, 0 where the clipped error won.
    assert values.grad is not None
    close(values.grad, [[0.0, 0.125, 0.0, 0.25]])


def test_value_clip_frac_counts_only_tokens_where_the_clip_binds() -> None:
    # float32, clip 1.0.  Token 0: V 0.1, V_old 0.7, R 0: |V - V_old| = 0.6 < 1, the clip does not bind.  The old
    # V_old + clamp(V - V_old) gives 0.7 + (-0.6 rounded) = 0.10000002 in float32, one ulp above V, so the
    # "clipped" error came out larger and the token counted as clipped.  Token 1: V 3.0, V_old 0.5, R 0: V_clip 1.5,
    # errors 9 vs 2.25 -> the unclipped one is larger, not clipped.  Token 2: V 0.0, V_old 2.0, R 0: V_clip 1.0,
    # errors 0 vs 1 -> clipped.  Fraction 1/3.  Loss 0.5 * (0.01 + 9 + 1) / 3.
    f32 = torch.float32
    v, old, ret = [0.1, 3.0, 0.0], [0.7, 0.5, 2.0], [0.0, 0.0, 0.0]
    assert abs(v[0] - old[0]) < 1.0
    values = torch.tensor([v], dtype=f32)
    old_t = torch.tensor([old], dtype=f32)
    assert (old_t + (values - old_t).clamp(-1.0, 1.0))[0, 0].item() != values[
        0, 0
    ].item()  # the old round trip
    loss, m = ppo.value_loss(
        values, old_t, torch.tensor([ret], dtype=f32), torch.ones(1, 3), 1.0, "token-mean"
    )
    close(m["value_clip_frac"], 1 / 3)
    close(loss, 0.5 * (0.1**2 + 9.0 + 1.0) / 3, atol=1e-6)


def test_entropy_bonus_and_kl_loss_signs() -> None:
    # entropy mean over the mask (1 + 3) / 2 = 2 -> loss -0.1 * 2
    loss, m = ppo.entropy_bonus(t([[1.0, 3.0, 50.0]]), torch.tensor([[1, 1, 0]]), 0.1, "token-mean")
    close(loss, -0.2)
    close(m["entropy"], 2.0)
    # k1 with d = [0.5, -1.0] -> mean -0.25, coef 2 -> -0.5
    loss, m = ppo.kl_loss(t([[-1.0, -2.0]]), t([[-1.5, -1.0]]), torch.ones(1, 2), 2.0, "k1", "token-mean")
    close(loss, -0.5)
    close(m["kl_ref"], -0.25)
