"""trainer/data.py: step selection (whole groups, oldest first, stale drop/keep), planning through the consumption
log, the split onto ranks and micro-batches, and the alignment of collated tensors with the model's logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from buffer import plans, shards
from buffer.shards import ShardWriter
from trainer.batching import assign_to_ranks, collate, microbatches, split_updates
from trainer.data import Limits, Planner, Sample, ShardCache, group_candidates, select_step

from .buffer_helpers import make_layout, plan_sample_ids, sample


def _s(sid: str, group: str, version: int = 0, prompt: int = 3, resp: int = 2, reward: float = 0.0) -> Sample:
    return Sample(sid, group, list(range(1, prompt + 1)), [7] * resp, [-0.5] * resp, reward, version)


def _groups(spec: list[tuple[str, int, int]]) -> list[tuple[str, list[Sample], list[str]]]:
    """[(group id, size, version)] -> candidates as group_candidates returns them (one shard per group)."""
    return [(g, [_s(f"{g}.{i}", g, v) for i in range(n)], [f"shard-{g}"]) for g, n, v in spec]


def test_select_step_takes_whole_groups_or_nothing() -> None:
    cands = _groups([("a", 3, 0), ("b", 3, 0), ("c", 3, 0)])
    sel = select_step(cands, samples_per_step=4, current_version=0, max_staleness=0, drop_stale=True)
    assert sel is not None
    assert [s.sample_id for s in sel.samples] == ["a.0", "a.1", "a.2", "b.0", "b.1", "b.2"]  # b is not split
    assert sel.dropped == [] and sel.shards == ["shard-a", "shard-b"]
    assert select_step(cands, 10, 0, 0, True) is None  # 9 samples cannot fill a step of 10


def _shard_of(layout, worker: str, rows: list[tuple[str, str, int]]) -> str:
    """A shard of [(sample id, group id, policy version)]; its name."""
    w = ShardWriter(layout, "run", worker)
    for i, (sid, group, version) in enumerate(rows):
        w.add(sample(i, group=group, version=version) | {"sample_id": sid})
    path = w.flush()
    assert path is not None
    return path.name


def test_group_candidates_oldest_version_first_and_skips_consumed(tmp_path) -> None:
    layout = make_layout(tmp_path)
    s1 = _shard_of(layout, "wa", [("x.0", "x", 5), ("x.1", "x", 5), ("y.0", "y", 2)])
    s2 = _shard_of(layout, "wb", [("y.1", "y", 3), ("z.0", "z", 4)])
    plans.PlanLog.claim(layout).write_plan(1, [s2], [(s2, 1)])  # z.0 is consumed
    cache = ShardCache(layout, Limits(), shards.BucketLister(layout, shards.first_bucket(layout)))
    assert cache.refresh(plans.Consumption.load(layout)) == 2
    cands = group_candidates(cache)
    assert [(g, [r.sample_id for r in rows], names) for g, rows, names in cands] == [
        (
            "y",
            ["y.0", "y.1"],
            sorted([s1, s2]),
        ),  # a group spread over two shards, judged by its oldest sample
        ("x", ["x.0", "x.1"], [s1]),
    ]


def test_stale_groups_are_dropped_or_kept() -> None:
    cands = _groups([("old", 2, 1), ("mid", 2, 3), ("new", 2, 5)])
    sel = select_step(cands, samples_per_step=2, current_version=5, max_staleness=2, drop_stale=True)
    assert sel is not None
    assert [s.group_id for s in sel.samples] == ["mid", "mid"]  # staleness 2 is within the bound
    assert [s.sample_id for s in sel.dropped] == ["old.0", "old.1"]
    assert sel.shards == ["shard-mid", "shard-old"]  # the dropped group's shard is consumed too
    kept = select_step(cands, 2, 5, 2, drop_stale=False)
    assert kept is not None and [s.group_id for s in kept.samples] == ["old", "old"] and kept.dropped == []
    # Only stale samples: nothing to train on, so no plan (and no drop) yet.
    assert select_step(_groups([("old", 4, 0)]), 2, 5, 2, True) is None


def test_planner_records_drops_and_never_plans_a_sample_twice(tmp_path) -> None:
    layout = make_layout(tmp_path)
    w = ShardWriter(layout, "run", "w0")
    for i in range(4):
        w.add(sample(i, group="old", version=0))
    w.flush()
    for i in range(8):
        w.add(sample(i, group=f"new{i // 4}", version=6))
    w.flush()
    planner = Planner(layout, plans.PlanLog.claim(layout), Limits())
    plan, rows = planner.try_plan(1, 4, current_version=6, max_staleness=2, drop_stale=True) or (None, [])
    assert plan is not None and plan.dropped == 4 and plan.samples == 4
    assert len(plan_sample_ids(layout, plan, "drops")) == 4 and len(plan_sample_ids(layout, plan)) == 4
    assert {r.group_id for r in rows} == {"new0"} and planner.dropped_total == 4
    assert plan_sample_ids(layout, plan) == [r.sample_id for r in rows]  # the plan records the rows trained
    plan2, _ = planner.try_plan(2, 4, 6, 2, True) or (None, [])
    assert plan2 is not None and plan2.drops == [] and plan2.dropped == 0
    assert planner.try_plan(3, 4, 6, 2, True) is None  # everything consumed
    valid = plans.valid_plans(layout)
    ids = [s for p in valid.values() for w in ("takes", "drops") for s in plan_sample_ids(layout, p, w)]
    assert len(ids) == len(set(ids)) == 12
    # A restarted planner replays a recorded plan with the same rows, in the same order.
    again = Planner(layout, plans.PlanLog.claim(layout), Limits())
    assert [r.sample_id for r in again.replay(valid[2]).samples] == plan_sample_ids(layout, valid[2])
    assert again.try_plan(3, 4, 6, 2, True) is None


def test_split_updates_interleaves_and_never_makes_empty_minibatches() -> None:
    samples = [_s(str(i), "g") for i in range(5)]
    assert [[s.sample_id for s in m] for m in split_updates(samples, 2)] == [["0", "2", "4"], ["1", "3"]]
    assert len(split_updates(samples, 9)) == 5
    assert split_updates(samples, 1) == [samples]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_assign_to_ranks_balances_tokens(world: int) -> None:
    rng = random.Random(world)
    samples = [_s(f"s{i}", "g", prompt=rng.randint(1, 40), resp=rng.randint(1, 60)) for i in range(37)]
    parts = assign_to_ranks(samples, world)
    assert sorted(s.sample_id for p in parts for s in p) == sorted(s.sample_id for s in samples)
    loads = [sum(s.length for s in p) for p in parts]
    assert max(loads) - min(loads) <= max(s.length for s in samples)  # greedy longest-first bound
    assert parts == assign_to_ranks(list(reversed(samples)), world)  # deterministic, order-independent


def _varied(seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = [_s(f"s{i}", "g", prompt=rng.randint(1, 20), resp=rng.randint(1, 30)) for i in range(50)]
    samples.append(_s("huge", "g", prompt=80, resp=40))  # longer than the budget: alone in its micro-batch
    return samples


def test_microbatches_respect_the_padded_token_budget() -> None:
    samples = _varied(0)
    mbs = microbatches(samples, max_tokens=100, packed=False)
    assert sorted(s.sample_id for mb in mbs for s in mb) == sorted(s.sample_id for s in samples)
    for mb in mbs:
        assert len(mb) * max(s.length for s in mb) <= 100 or len(mb) == 1
    assert [s.sample_id for s in mbs[-1]] == ["huge"]


def test_packed_microbatches_count_real_tokens_only() -> None:
    samples = _varied(1)
    mbs = microbatches(samples, max_tokens=100)
    assert sorted(s.sample_id for mb in mbs for s in mb) == sorted(s.sample_id for s in samples)
    assert [s.sample_id for s in mbs[0]] == ["huge"]  # longest first, alone
    assert all(sum(s.length for s in mb) <= 100 for mb in mbs[1:])
    real = sum(s.length for s in samples[:-1])
    assert len(mbs) - 1 == -(-real // 100)  # here first-fit decreasing reaches the fewest possible
    assert len(mbs) < len(microbatches(samples, max_tokens=100, packed=False))
    assert mbs == microbatches(list(reversed(samples)), max_tokens=100)  # deterministic, order-independent


def test_packed_microbatches_fill_first_fit_not_in_length_order() -> None:
    # In increasing length order 40+40 would close a micro-batch and leave each 60 alone: three instead of two.
    samples = [_s("a", "g", prompt=30, resp=30), _s("b", "g", prompt=30, resp=30)]
    samples += [_s("c", "g", prompt=20, resp=20), _s("d", "g", prompt=20, resp=20)]
    mbs = microbatches(samples, max_tokens=100)
    assert [[s.sample_id for s in mb] for mb in mbs] == [["a", "c"], ["b", "d"]]


def test_collate_aligns_response_tokens_logprobs_and_advantages() -> None:
    a = _s("a", "g", prompt=3, resp=2)
    a.response_ids, a.response_logprobs, a.advantage, a.reward = [11, 12], [-0.1, -0.2], 0.5, 1.0
    b = _s("b", "g", prompt=1, resp=3)
    b.response_ids, b.response_logprobs, b.advantage = [21, 22, 23], [-1.0, -2.0, -3.0], -1.5
    t = collate([a, b], pad_id=0)
    assert t["input_ids"].tolist() == [[1, 2, 3, 11, 12], [1, 21, 22, 23, 0]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert t["response_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]]
    # position t holds what belongs to input_ids[t]: its behaviour logprob and its sample's advantage
    assert t["behaviour_logp"][0, 3:].tolist() == pytest.approx([-0.1, -0.2])
    assert t["behaviour_logp"][1, 1:4].tolist() == pytest.approx([-1.0, -2.0, -3.0])
    assert t["advantages"].tolist() == [[0, 0, 0, 0.5, 0.5], [0, -1.5, -1.5, -1.5, 0]]
    assert t["rewards"].tolist() == [1.0, 0.0]


def test_collated_positions_match_the_models_logprob_of_that_token() -> None:
    """The trainer's logprob at position t is log p(input_ids[t] | input_ids[:t]), on the collated layout."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.model import token_logprobs_and_entropy

    cfg = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=50,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg).float().eval()
    a = Sample("a", "g", [3, 4, 5], [6, 7], [0.0, 0.0], 0.0, 0)
    b = Sample("b", "g", [8], [9, 10, 11], [0.0] * 3, 0.0, 0)
    t = collate([a, b], pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(
            lm, t["input_ids"], t["attention_mask"], None, t["response_mask"], chunk=2
        )
        for row, s in enumerate([a, b]):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            full = torch.log_softmax(lm(input_ids=ids).logits.float()[0], dim=-1)
            p = len(s.prompt_ids)
            for j, tok in enumerate(s.response_ids):
                assert logp[row, p + j].item() == pytest.approx(full[p + j - 1, tok].item(), abs=1e-5)
    assert (logp[t["response_mask"] == 0] == 0).all()
