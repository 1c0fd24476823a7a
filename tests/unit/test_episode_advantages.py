"""The samples of one split episode share one advantage (trainer/step.py ``group_sample_advantages``): group
statistics over episodes, read from the ``episode`` record's ``episode_id`` (trainer/data.py), with single-turn and
unsplit data giving exactly the per-sample advantages; and what the token-level estimators and loss aggregation do
with a split episode."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from buffer import shards
from buffer.config import ShardRLConfig, validate
from trainer import ppo, step
from trainer.data import Sample, _samples


def _cfg(**algorithm: object) -> ShardRLConfig:
    return validate(
        {
            "reward": {"function": "max_digit"},
            "algorithm": algorithm,
            "rollout": {"sampling": {"n": 2, "max_response_length": 8}},
            "trainer": {"samples_per_step": 4},
        },
        "test",
    )


GROUP_ALGORITHMS = [
    {"name": "grpo"},
    {"name": "grpo", "norm_adv_by_std": False},
    {"name": "rloo"},
]


def _sample(sid: str, group: str, reward: float, episode: str | None = None) -> Sample:
    return Sample(sid, group, [1], [2, 3], [-0.5, -0.5], reward, 0, episode_key=episode)


def _per_sample(cfg: ShardRLConfig, samples: list[Sample]) -> list[float]:
    """The advantages as computed before episodes: over samples, one entry each."""
    groups: dict[str, int] = {}
    index = torch.tensor([groups.setdefault(s.group_id, len(groups)) for s in samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    a = cfg.algorithm
    if a.name == "grpo":
        return ppo.grpo_advantages(rewards, index, a.norm_adv_by_std).tolist()
    return ppo.rloo_advantages(rewards, index).tolist()


@pytest.mark.parametrize("algorithm", GROUP_ALGORITHMS)
@pytest.mark.parametrize("keys", ["none", "one per sample"])
def test_unsplit_data_gets_exactly_the_per_sample_advantages(algorithm: dict, keys: str) -> None:
    # single-turn rows carry no key; an agent episode that did not split carries one of its own
    rng = random.Random(7)
    samples = []
    for i in range(40):
        group = f"g{rng.randrange(6)}"
        episode = None if keys == "none" else f"e{i}"
        samples.append(_sample(f"s{i}", group, rng.choice([0.0, 0.1, 0.5, 1.0, rng.random()]), episode))
    cfg = _cfg(**algorithm)
    expected = _per_sample(cfg, samples)
    step.group_sample_advantages(cfg, samples)
    assert [s.advantage for s in samples] == expected  # bit for bit, not approximately


@pytest.mark.parametrize(
    ("algorithm", "a", "others"),
    [
        # episodes of group g: A = 1 (split in three samples), B = 0, C = 0: mean 1/3, population std sqrt(2)/3
        ({"name": "grpo"}, (2 / 3) / (2**0.5 / 3 + 1e-6), (-1 / 3) / (2**0.5 / 3 + 1e-6)),
        ({"name": "grpo", "norm_adv_by_std": False}, 2 / 3, -1 / 3),
        # leave one episode out: A = 1 - (0 + 0) / 2, B = 0 - (1 + 0) / 2
        ({"name": "rloo"}, 1.0, -0.5),
    ],
)
def test_a_split_episode_counts_once_in_its_group(algorithm: dict, a: float, others: float) -> None:
    samples = [
        _sample("a0", "g", 1.0, "A"),
        _sample("b", "g", 0.0, "B"),
        _sample("a1", "g", 1.0, "A"),
        _sample("c", "g", 0.0),  # single sample, no key
        _sample("a2", "g", 1.0, "A"),
    ]
    step.group_sample_advantages(_cfg(**algorithm), samples)
    got = {s.sample_id: s.advantage for s in samples}
    assert [got["a0"], got["a1"], got["a2"]] == pytest.approx([a] * 3, abs=1e-12)
    assert [got["b"], got["c"]] == pytest.approx([others] * 2, abs=1e-12)
    # per sample, A would have counted three times: GRPO mean 0.6 instead of 1/3
    per_sample = _per_sample(_cfg(**algorithm), samples)
    assert per_sample[0] != pytest.approx(a)


def test_episode_keys_are_scoped_to_their_group_and_never_meet_sample_ids() -> None:
    samples = [
        _sample("x", "g1", 1.0, "E"),
        _sample("y", "g1", 0.0, "x"),  # a key spelled like another sample's id: still another episode
        _sample("z", "g2", 0.0, "E"),  # the same key in another group: another episode
        _sample("w", "g2", 1.0),
    ]
    of_sample, rewards, group = step.episodes(samples)
    assert of_sample.tolist() == [0, 1, 2, 3]
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert group.tolist() == [0, 0, 1, 1]
    step.group_sample_advantages(_cfg(name="grpo", norm_adv_by_std=False), samples)
    assert [s.advantage for s in samples] == [0.5, -0.5, -0.5, 0.5]


def test_an_episode_reward_is_its_samples_reward_and_a_flat_group_stays_flat() -> None:
    # 0.1 three times: a mean of the copies would be off by an ulp and make the group look not flat
    flat = [_sample(f"a{i}", "g", 0.1, "A") for i in range(3)] + [_sample("b", "g", 0.1, "B")]
    step.group_sample_advantages(_cfg(name="grpo"), flat)
    assert [s.advantage for s in flat] == [0.0] * 4
    # samples of one episode that disagree (workers never write that) are taken at their mean
    odd = [_sample("a0", "g", 1.0, "A"), _sample("a1", "g", 0.0, "A"), _sample("b", "g", 0.0, "B")]
    _, rewards, _ = step.episodes(odd)
    assert rewards.tolist() == [0.5, 0.0]


@pytest.mark.parametrize("name", ["reinforce_pp", "ppo"])
def test_token_level_algorithms_take_no_sample_advantage(name: str) -> None:
    samples = [_sample("a0", "g", 1.0, "A"), _sample("a1", "g", 1.0, "A"), _sample("b", "g", 0.0)]
    step.group_sample_advantages(_cfg(name=name), samples)
    assert [s.advantage for s in samples] == [0.0] * 3  # computed per token in ``prepare``


def _padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    x = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = 1.0
    return x, mask


def test_reinforce_pp_weighs_a_split_episode_like_the_whole() -> None:
    # episode A (reward 1) of 5 model tokens, whole or split 2 + 3; episode B (reward 0) of 4 tokens
    def advantages(lengths: list[int], rewards: list[float]) -> list[float]:
        _, mask = _padded([[0.0] * n for n in lengths])
        tok = ppo.scalar_reward_to_tokens(torch.tensor(rewards, dtype=torch.float64), mask)
        adv = ppo.reinforce_pp_advantages(tok, mask)
        return sorted(adv[mask.bool()].tolist())

    whole = advantages([5, 4], [1.0, 0.0])
    split = advantages([2, 3, 4], [1.0, 1.0, 0.0])
    assert split == pytest.approx(whole, abs=1e-12)


@pytest.mark.parametrize(
    ("mode", "same"),
    [
        ("token-mean", True),
        ("token-sum", True),
        ("seq-mean-token-sum-norm", False),  # each token weighs the same; only the sequence count scales it
        ("seq-mean-token-sum", False),
        ("seq-mean-token-mean", False),
    ],
)
def test_loss_aggregation_of_a_split_episode(mode: Any, same: bool) -> None:
    # per-token losses of episode A (5 tokens) and B (4 tokens); A as one sample or as two (2 + 3)
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [-1.0, 0.5, 0.5, 2.0]
    whole, wm = _padded([a, b])
    split, sm = _padded([a[:2], a[2:], b])
    lw = ppo.aggregate(whole, wm, mode, 9.0, 2.0, 8.0)
    ls = ppo.aggregate(split, sm, mode, 9.0, 3.0, 8.0)
    if same:
        assert float(ls) == pytest.approx(float(lw))
    elif mode == "seq-mean-token-mean":
        # each sample is a sequence: A weighs twice as much as B once split
        assert float(ls) == pytest.approx((1.5 + 4.0 + 0.5) / 3)
        assert float(lw) == pytest.approx((3.0 + 0.5) / 2)
    else:
        # every token weighs the same; a split adds a sequence to the count, which scales the whole loss
        assert float(ls) * 3.0 == pytest.approx(float(lw) * 2.0)


def _row(i: int, episode: str | None) -> dict[str, Any]:
    return {
        "sample_id": f"s{i}",
        "group_id": "g",
        "prompt_ids": [1, 2],
        "response_ids": [3],
        "response_logprobs": [-0.5],
        "reward": 1.0,
        "policy_version": 0,
        "finish_reason": "stop",
        "episode": episode,
    }


def test_episode_keys_are_read_from_the_episode_record() -> None:
    records = [
        json.dumps({"agent": "a", "episode_id": "e7", "split": 1, "splits": 2}),
        json.dumps({"episode_id": 12}),  # any JSON value names the episode, as a string
        json.dumps({"ended": True, "turns": 3}),  # a multi-turn record without an id
        json.dumps({"episode_id": None}),
        "not json episode_id",
        json.dumps(["episode_id"]),
        None,  # single-turn
    ]
    table = shards.build_table([_row(i, r) for i, r in enumerate(records)], "run", "w0", 0)
    assert [s.episode_key for s in _samples(table)] == ["e7", "12", None, None, None, None, None]
    old = table.drop_columns(["episode"])  # a shard written before the column
    assert [s.episode_key for s in _samples(old)] == [None] * len(records)


def test_step_metrics_weigh_micro_batches_by_the_tokens_the_loss_counts() -> None:
    """Each micro-batch's share of a step's metrics is its part of the loss-masked tokens, so the shares sum to 1
    and a metric that is 1.0 on every token (the importance weight of on-policy data) reads 1.0 for multi-turn
    samples too, whose environment tokens are masked out (the shares once counted every response token: 76/63)."""
    cfg = validate(
        {
            "reward": {"function": "max_digit"},
            "rollout": {"sampling": {"n": 2, "max_response_length": 8}},
            "trainer": {"samples_per_step": 4, "max_tokens_per_microbatch": 16},
        },
        "test",
    )
    samples = [
        Sample(f"s{i}", "g", [1], [2, 3, 4, 5, 6], [-0.5] * 5, 1.0, 0, loss_mask=[1, 1, 0, 0, 1])
        for i in range(4)
    ]
    (mini,) = step.minibatches(cfg, samples, pad_id=0)
    assert len(mini.batches) > 1  # the point: several micro-batches
    assert sum(mini.share(i, 1) for i in range(len(mini.batches))) == pytest.approx(1.0)
