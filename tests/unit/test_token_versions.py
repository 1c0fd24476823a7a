"""Per-token policy versions (sample columns version 3): read into ``Sample.token_versions`` (trainer/data.py),
staleness still judged by ``policy_version`` (the oldest token), the per-token staleness metrics of a step
(trainer/loop.py), and the off-policy correction taken token by token from the behaviour logprobs (trainer/ppo.py),
so a response generated across a weight update needs no loss of its own."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from buffer import shards
from trainer import ppo
from trainer.batching import collate
from trainer.data import Sample, _samples, select_step
from trainer.feed import StepBatch
from trainer.loop import step_metrics, token_staleness


def _row(i: int, **kw: Any) -> dict[str, Any]:
    n = len(kw.get("response_ids", [5, 6, 7]))
    return {
        "sample_id": f"s{i}",
        "group_id": "g",
        "prompt_ids": [1, 2],
        "response_ids": [5, 6, 7],
        "response_logprobs": [-0.5] * n,
        "reward": 1.0,
        "policy_version": 2,
        "finish_reason": "stop",
        **kw,
    }


def test_token_versions_are_read_when_the_column_exists() -> None:
    rows = [
        _row(0, token_versions=[2, 2, 3]),
        _row(1),  # every token is policy_version
        _row(
            2,
            response_ids=[5, 8, 9, 6],
            response_logprobs=[-0.1, 0.0, 0.0, -0.2],
            loss_mask=[1, 0, 0, 1],
            turn_lengths=[1, 2, 1],
            turn_versions=[2, -1, 4],
            token_versions=[2, -1, -1, 4],
        ),
    ]
    table = shards.build_table(rows, "run", "w0", 0)
    assert shards._value_problem(table, None) is None
    samples = _samples(table)
    assert [s.token_versions for s in samples] == [[2, 2, 3], None, [2, -1, -1, 4]]
    assert [s.model_versions() for s in samples] == [[2, 2, 3], [2, 2, 2], [2, 4]]
    before = table.drop_columns(["token_versions"])  # sample columns version 2
    assert [s.token_versions for s in _samples(before)] == [None, None, None]


def _sample(sid: str, version: int, token_versions: list[int] | None = None, **kw: Any) -> Sample:
    n = len(token_versions) if token_versions is not None else 4
    return Sample(sid, sid, [1], [2] * n, [-0.5] * n, 1.0, version, token_versions=token_versions, **kw)


def test_staleness_is_judged_by_the_oldest_token() -> None:
    # mostly fresh tokens, but the oldest is 3 versions behind: too stale for max_staleness 2
    mixed = _sample("mixed", 1, [1, 4, 4, 4])
    fresh = _sample("fresh", 3)
    sel = select_step([("mixed", [mixed], ["a"]), ("fresh", [fresh], ["b"])], 1, 4, 2, drop_stale=True)
    assert sel is not None
    assert [s.sample_id for s in sel.samples] == ["fresh"]
    assert [s.sample_id for s in sel.dropped] == ["mixed"]


def test_per_token_staleness_metrics_by_hand() -> None:
    env = [1, 0, 0, 1, 1]  # a multi-turn sample: its environment tokens are no loss tokens
    samples = [
        _sample("a", 3),  # 4 tokens, 2 behind
        _sample("b", 4, [4, 5, 5, 5]),  # 1, 0, 0, 0 behind
        _sample("c", 3, [3, -1, -1, 5, 5], loss_mask=env),  # model tokens 2, 0, 0 behind
        _sample("d", 5, [5, 5, 5, 5]),  # one version throughout: not mixed
    ]
    m = token_staleness(samples, 5)
    assert m["token_staleness_mean"] == pytest.approx((2 * 4 + 1 + 2) / (4 + 4 + 3 + 4))
    assert m["mixed_version_samples"] == 2
    # the step's record carries them next to the per-sample staleness (the oldest token's)
    out = step_metrics(StepBatch(samples, 0, False), {}, 5, {"compute": 1.0})
    assert out["staleness_mean"] == pytest.approx((2 + 1 + 2 + 0) / 4)
    assert out["token_staleness_mean"] == m["token_staleness_mean"]
    assert out["mixed_version_samples"] == 2


def test_without_token_versions_token_staleness_is_token_weighted_sample_staleness() -> None:
    samples = [_sample("a", 3), Sample("b", "b", [1], [2] * 8, [-0.5] * 8, 0.0, 1)]
    m = token_staleness(samples, 4)
    assert m == {"token_staleness_mean": pytest.approx((1 * 4 + 3 * 8) / 12), "mixed_version_samples": 0}


# ------------------------------------------------------------------------------- the correction is per token

# A response of 6 tokens sampled across a weight update: the first K = 2 by version 1, the rest by version 2, the
# policy being trained now.  Its behaviour logprobs are each token's under the weights that drew it.
K = 2
CURRENT = [-0.3, -1.2, -0.7, -2.0, -0.1, -0.9]
OLD_POLICY = [-0.8, -2.2]  # version 1's logprobs of the first two tokens
BEHAVIOUR = OLD_POLICY + CURRENT[K:]
# their truncated weights min(exp(current - old), cap 2): e^0.5, and e^1 capped; the current version's tokens: 1
WEIGHTS = [math.exp(0.5), 2.0] + [1.0] * (len(CURRENT) - K)


def _batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    s = Sample("s", "g", [1, 2, 3], [4, 5, 6, 7, 8, 9], BEHAVIOUR, 1.0, 1, advantage=0.5)
    s.token_versions = [1, 1, 2, 2, 2, 2]
    b = collate([s], pad_id=0)
    current = torch.zeros_like(b["behaviour_logp"])
    current[0, 3:] = torch.tensor(CURRENT)
    return b, current


def test_truncated_is_weight_is_taken_token_by_token() -> None:
    b, current = _batch()
    mask = b["response_mask"]
    w = ppo.truncated_is_weight(current, b["behaviour_logp"], cap=2.0, mask=mask, level="token")[0, 3:]
    assert w[:K].tolist() == pytest.approx(WEIGHTS[:K])
    assert all(x != 1.0 for x in w[:K].tolist())
    assert w[K:].tolist() == [1.0] * (len(CURRENT) - K)  # exactly
    # a sequence-level weight would instead put the old tokens' product on every token: e^1.5, capped
    seq = ppo.truncated_is_weight(current, b["behaviour_logp"], cap=2.0, mask=mask, level="sequence")[0, 3:]
    assert seq.tolist() == pytest.approx([2.0] * len(CURRENT))


def test_tis_gradient_weighs_each_token_by_its_own_ratio() -> None:
    # off_policy = "tis": loss_t = -w_t * A * logp_t, token-mean over the response, so d loss / d logp_t = -w_t A / n
    b, current = _batch()
    mask = b["response_mask"]
    logp = current.clone().requires_grad_(True)
    w = ppo.truncated_is_weight(logp.detach(), b["behaviour_logp"], 2.0, mask, "token")
    loss = ppo.aggregate(-w * b["advantages"] * logp, mask, "token-mean")
    loss.backward()
    assert logp.grad is not None
    n, adv = len(CURRENT), 0.5
    assert logp.grad[0, 3:].tolist() == pytest.approx([-w * adv / n for w in WEIGHTS])


def test_decoupled_behaviour_weight_is_per_token_and_the_ratio_is_against_the_proximal_policy() -> None:
    # off_policy = "decoupled" with one update: the proximal policy is the current one, the ratio is 1 on every
    # token and the loss is -A times the per-token proximal/behaviour weight
    b, current = _batch()
    mask = b["response_mask"]
    weight = ppo.truncated_is_weight(current, b["behaviour_logp"], 2.0, mask, "token")
    loss, m = ppo.policy_loss(
        current,
        current,
        b["advantages"],
        mask,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        agg_mode="token-sum",
        is_weight=weight,
    )
    assert float(loss) == pytest.approx(-0.5 * sum(WEIGHTS))
    assert float(m["clip_frac_low"]) == float(m["clip_frac_high"]) == 0.0
