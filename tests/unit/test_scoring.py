"""Scoring a batch into rows: whole groups kept or dropped, counts, logprobs, the reward model's share."""

from __future__ import annotations

import json
import math

import pytest

from buffer.config import RewardConfig
from rollout_worker.engines.base import Completion
from rollout_worker.prompts import EncodedPrompt, Prompt
from rollout_worker.rewards import GroupRewards, make_scorer
from rollout_worker.scoring import score_batch


def _prompt(i: int, answer: str = "9") -> EncodedPrompt:
    return EncodedPrompt(Prompt(i, f"max digit of {i}9?", answer), [10 + i, 11, 12])


def _out(text: str, logprobs: list[float], finish: str = "stop") -> Completion:
    return Completion([1], [20 + k for k in range(len(logprobs))], logprobs, finish, text)


def _score(prompts, outputs, rewards, **kw):
    return score_batch(prompts, outputs, rewards, group_prefix="w3.abc.7", policy_version=5, epoch=2, **kw)


def test_kept_groups_become_rows_with_ids_versions_and_clamped_logprobs():
    prompts = [_prompt(0), _prompt(1)]
    outputs = [
        [_out("9", [-0.5, -0.25]), _out("8", [-1.0, 5e-5])],  # +5e-5: float rounding, kept as 0
        [_out("9", [-0.1]), _out("1", [-2.0, -3.0, -0.5])],
    ]
    rewards = [GroupRewards([1.0, 0.1]), GroupRewards([1.0, 0.0])]
    out = _score(prompts, outputs, rewards)
    assert [[r["group_id"] for r in g] for g in out.groups] == [["w3.abc.7.0"] * 2, ["w3.abc.7.1"] * 2]
    first = out.groups[0][1]
    assert first["response_logprobs"] == [-1.0, 0.0]
    assert first["reward"] == 0.1 and first["policy_version"] == 5 and first["answer"] == "9"
    assert first["prompt_ids"] == [10, 11, 12] and first["response_ids"] == [20, 21]
    assert json.loads(first["extra"]) == {"prompt_index": 0, "epoch": 2}
    assert (out.samples, out.tokens) == (4, 2 + 2 + 1 + 3)
    assert out.reward_mean() == pytest.approx((1.0 + 0.1 + 1.0 + 0.0) / 4)
    assert out.dropped_reward_groups == out.dropped_bad_logprob_groups == 0 and out.errors == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.01])
def test_a_bad_logprob_drops_its_whole_group_only(bad):
    prompts = [_prompt(0), _prompt(1)]
    outputs = [[_out("9", [-0.5]), _out("8", [-0.5, bad])], [_out("9", [-0.1]), _out("9", [-0.2])]]
    out = _score(prompts, outputs, [GroupRewards([1.0, 0.1]), GroupRewards([1.0, 1.0])])
    assert [g[0]["group_id"] for g in out.groups] == ["w3.abc.7.1"]
    assert out.dropped_bad_logprob_groups == 1 and out.dropped_reward_groups == 0


def test_a_failed_reward_drops_its_group_and_is_counted_with_its_error():
    prompts = [_prompt(0), _prompt(1), _prompt(2)]
    outputs = [[_out("9", [-0.5])] * 3 for _ in prompts]
    rewards = [
        GroupRewards(None, "reward function raised ValueError: no"),
        GroupRewards([1, 1, 1]),
        GroupRewards(None),
    ]
    out = _score(prompts, outputs, rewards)
    assert [g[0]["group_id"] for g in out.groups] == ["w3.abc.7.1"]
    assert (out.dropped_reward_groups, out.dropped_reward_samples) == (2, 6)
    assert out.errors == ["reward function raised ValueError: no", "reward function failed"]


def test_the_reward_model_adds_its_weighted_score_and_scores_only_surviving_groups():
    prompts = [_prompt(0), _prompt(1), _prompt(2)]
    outputs = [
        [_out("9", [-0.5]), _out("7", [-0.5])],
        [_out("9", [math.nan]), _out("9", [-0.5])],  # dropped before the model is asked
        [_out("5", [-0.5]), _out("9", [-0.5])],
    ]
    calls: list[tuple[list[str], list[str]]] = []

    def model(ps: list[str], rs: list[str]) -> list[float]:
        calls.append((ps, rs))
        return [2.0, -1.0, 0.5, math.nan]  # group 2's second score is not finite: group 2 goes too

    rewards = [GroupRewards([1.0, 0.0]), GroupRewards([1.0, 1.0]), GroupRewards([0.0, 1.0])]
    out = _score(prompts, outputs, rewards, model_scorer=model, model_weight=0.5)
    assert calls == [([prompts[0].prompt.text] * 2 + [prompts[2].prompt.text] * 2, ["9", "7", "5", "9"])]
    assert len(out.groups) == 1
    assert [r["reward"] for r in out.groups[0]] == [1.0 + 0.5 * 2.0, 0.0 + 0.5 * -1.0]
    assert json.loads(out.groups[0][0]["extra"]) == {
        "prompt_index": 0,
        "epoch": 2,
        "reward_function": 1.0,
        "reward_model": 2.0,
    }
    assert out.dropped_bad_logprob_groups == 1
    assert out.errors == ["reward model returned a non-finite score"] and out.dropped_reward_samples == 2


def test_with_the_workers_scorer_on_the_digit_task():
    scorer = make_scorer(RewardConfig(function="max_digit"))
    prompts = [_prompt(0, answer="9"), _prompt(1, answer="4")]
    outputs = [[_out("9", [-0.1]), _out("3", [-0.1])], [_out("x", [-0.1]), _out("4", [-0.1])]]
    out = _score(prompts, outputs, scorer.score_batch(prompts, outputs))
    assert [[r["reward"] for r in g] for g in out.groups] == [[1.0, 0.1], [0.0, 1.0]]  # 0.1: a wrong digit
