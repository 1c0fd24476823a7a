"""Packed micro-batches against padded ones, on CPU in fp32 with the built-in tiny model (tied and untied).

The packed path (one row, positions restarting per sequence, attention cut at sequence boundaries) must give the same
per-token logprobs, entropies and critic values as the right-padded path, and ``train_step`` the same metrics and
gradients.  Tolerances: both paths run the same fp32 matmuls on the same tokens, only grouped into different rows and
attention calls, so they differ by float32 reassociation: at most ~4e-6 on logprobs of magnitude ~8 here, under
1e-5.  A sequence attending to the ones before it instead moves logprobs by ~1 on average (the tiny model's weights are
drawn wide, so its next-token distributions depend strongly on the context); a test below checks that.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from buffer.config import ShardRLConfig
from trainer import dist as tdist
from trainer.batching import collate
from trainer.data import Sample
from trainer.model import (
    PACKED_ATTENTION,
    Actor,
    Critic,
    PackedRow,
    batch_logprobs,
    batch_values,
    build_optimizer,
    build_scheduler,
    load_causal_lm,
    pack,
    token_logprobs_and_entropy,
    unpack,
)
from trainer.step import Models, train_step

ATOL = 1e-5  # fp32 reassociation (see the module docstring); leakage across sequences is ~1e5 times larger
TOL = {"rtol": 1e-5, "atol": ATOL}  # values reach ~10, where 1e-5 is a few float32 ulps

# (prompt, response) lengths from 1 to 330 tokens; one sample without a prompt (its first token has no logprob).
SHAPES = [(4, 2), (30, 300), (3, 1), (0, 6), (12, 45), (1, 120), (25, 8)]


def _samples(vocab: int, seed: int = 0, shapes: list[tuple[int, int]] = SHAPES) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i, (p, r) in enumerate(shapes):
        out.append(
            Sample(
                sample_id=f"s{i}",
                group_id=f"g{i % 2}",
                prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                response_ids=[rng.randrange(vocab) for _ in range(r)],
                response_logprobs=[-rng.uniform(0.5, 6.0) for _ in range(r)],
                reward=float(i % 3 == 0),
                policy_version=0,
            )
        )
    return out


@pytest.fixture(params=["untied", "tied"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(f"tiny_model_{request.param}"))


def _actor(path: Path) -> Actor:
    actor = Actor(load_causal_lm(path))
    assert actor.config._attn_implementation == PACKED_ATTENTION
    return actor


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name, g in want.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        # summed over ~500 tokens in another order: relative to the tensor's largest entry
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=ATOL * scale, msg=name)


def test_collate_packs_real_tokens_and_unpacks_them_in_place() -> None:
    a = Sample("a", "g", [1, 2, 3], [11, 12], [-0.1, -0.2], 1.0, 0)
    b = Sample("b", "g", [4], [21, 22, 23], [-1.0, -2.0, -3.0], 0.0, 0)
    c = Sample("c", "g", [5, 6], [31], [-0.5], 0.0, 0)
    t = collate([a, b, c], pad_id=0, packed=True)
    assert t["input_ids"].tolist() == [[1, 2, 3, 11, 12], [4, 21, 22, 23, 0], [5, 6, 31, 0, 0]]
    assert t["packed_ids"].tolist() == [[1, 2, 3, 11, 12, 4, 21, 22, 23, 5, 6, 31]]
    assert t["packed_positions"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    assert t["packed_index"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12]
    assert t["packed_lens"].tolist() == [5, 4, 3]
    assert t["packed_cu_seqlens"].tolist() == [0, 5, 9, 12] and t["packed_cu_seqlens"].dtype == torch.int32
    packed_mask = pack(t["response_mask"], t)
    assert packed_mask.tolist() == [[0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1]]
    back = unpack(t["packed_ids"].float(), t)
    assert back.tolist() == (t["input_ids"] * t["attention_mask"]).float().tolist()
    assert "packed_ids" not in collate([a, b], pad_id=0)  # the padded layout alone


def _logprobs_both_ways(actor: Actor, samples: list[Sample]) -> tuple[Any, ...]:
    padded, packed = collate(samples, 0), collate(samples, 0, packed=True)
    out = []
    for batch in (padded, packed):
        actor.zero_grad(set_to_none=True)
        logp, ent = batch_logprobs(actor, batch, chunk=64, temperature=0.8)
        g = torch.Generator().manual_seed(3)
        w1, w2 = torch.randn(logp.shape, generator=g), torch.randn(ent.shape, generator=g)
        ((logp * w1).sum() + (ent * w2).sum()).backward()
        out.append((logp.detach(), ent.detach(), _grads(actor)))
    return padded, out[0], out[1]


def test_packed_logprobs_entropy_and_gradients_equal_padded(model_dir: Path) -> None:
    actor = _actor(model_dir)
    samples = _samples(actor.config.vocab_size)
    padded, (lp, ent, g), (lp_p, ent_p, g_p) = _logprobs_both_ways(actor, samples)
    mask = padded["response_mask"].bool()
    assert lp.shape == lp_p.shape == mask.shape
    torch.testing.assert_close(lp_p, lp, **TOL)
    torch.testing.assert_close(ent_p, ent, **TOL)
    mask[:, 0] = False  # the prompt-less sample's first token has no logprob in either layout
    assert (lp[mask] < -0.5).all() and (ent[mask] > 0.1).all()  # not a comparison of zeros
    assert (lp_p[~mask] == 0).all() and (ent_p[~mask] == 0).all()
    _assert_grads_close(g_p, g)


def test_sequences_of_one_length_equal_padded(tiny_model_tied: Path) -> None:
    """Equal lengths take another route (one SDPA call over the sequences as rows); it must agree all the same."""
    actor = _actor(tiny_model_tied)
    samples = _samples(actor.config.vocab_size, shapes=[(9, 31), (20, 20), (1, 39)])
    padded, (lp, ent, g), (lp_p, ent_p, g_p) = _logprobs_both_ways(actor, samples)
    assert padded["attention_mask"].all()  # no padding at all: the two layouts hold the same tokens
    torch.testing.assert_close(lp_p, lp, **TOL)
    torch.testing.assert_close(ent_p, ent, **TOL)
    assert (lp[padded["response_mask"].bool()] < -0.5).all()
    _assert_grads_close(g_p, g)


def test_packed_critic_values_and_gradients_equal_padded(model_dir: Path) -> None:
    lm = load_causal_lm(model_dir)
    critic = Critic(lm.base_model, int(lm.config.hidden_size))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    samples = _samples(lm.config.vocab_size, seed=1)
    padded, packed = collate(samples, 0), collate(samples, 0, packed=True)
    real = padded["attention_mask"].bool()
    results = []
    for batch in (padded, packed):
        critic.zero_grad(set_to_none=True)
        v = batch_values(critic, batch)
        (v * real * torch.linspace(-1, 1, v.shape[1])).sum().backward()
        results.append((v.detach(), _grads(critic)))
    (v, g), (v_p, g_p) = results
    torch.testing.assert_close(v_p[real], v[real], **TOL)
    assert (v_p[~real] == 0).all() and (v_p[:, 0] == 0).all()
    assert v[real][1:].abs().mean() > 0.1
    _assert_grads_close(g_p, g)
    with torch.no_grad():
        torch.testing.assert_close(batch_values(critic, packed)[real], v[real], **TOL)


def _models(path: Path, cfg: ShardRLConfig) -> Models:
    torch.manual_seed(0)  # the same value head in both runs
    actor = _actor(path)
    opt = build_optimizer(actor, lr=1e-5)
    lm = load_causal_lm(path)
    critic = Critic(lm.base_model, int(lm.config.hidden_size))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    reference = _actor(path).requires_grad_(False).eval()
    sched = build_scheduler(opt, warmup_steps=0, schedule="constant", total_steps=1)
    c_opt = build_optimizer(critic, lr=1e-5)
    c_sched = build_scheduler(c_opt, warmup_steps=0, schedule="constant", total_steps=1)
    return Models(actor, opt, sched, reference, critic, c_opt, c_sched)


@pytest.mark.parametrize(("tie", "loss_agg"), [("untied", "token-mean"), ("tied", "seq-mean-token-mean")])
def test_train_step_packed_equals_padded(
    tie: str, loss_agg: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PPO with critic, entropy bonus and KL loss: the step's metrics and every gradient, before the update."""
    monkeypatch.setattr(tdist, "_device", torch.device("cpu"))  # the step's tensors go where the models are
    model_dir = Path(request.getfixturevalue(f"tiny_model_{tie}"))
    grads: list[dict[str, torch.Tensor]] = []
    metrics = []
    for packing in (False, True):
        cfg = ShardRLConfig.model_validate(
            {
                "reward": {"function": "max_digit"},
                "algorithm": {
                    "name": "ppo",
                    "entropy_coef": 0.01,
                    "kl_coef": 0.05,
                    "loss_agg": loss_agg,
                    "off_policy": "none",
                },
                "trainer": {"packing": packing, "max_tokens_per_microbatch": 4096},
            }
        )
        models = _models(model_dir, cfg)
        samples = _samples(models.actor.config.vocab_size, seed=2)

        def hook(m: Models) -> None:
            grads.append({f"actor/{k}": v for k, v in _grads(m.actor).items()})
            grads[-1].update({f"critic/{k}": v for k, v in _grads(m.critic).items()})

        metrics.append(train_step(cfg, models, samples, pad_id=0, grad_hook=hook))
    padded, packed = metrics
    assert padded.keys() == packed.keys()
    for k in padded:
        assert packed[k] == pytest.approx(padded[k], rel=1e-4, abs=ATOL), k
    assert padded["entropy"] > 0.1 and padded["value_mse"] > 1e-3 and padded["kl_ref"] >= 0
    _assert_grads_close(grads[1], grads[0])


@pytest.mark.parametrize("packed", [False, True])
def test_empty_microbatch_backward_reaches_every_parameter(tiny_model_untied: Path, packed: bool) -> None:
    """A rank with fewer micro-batches runs masked-out ones; their backward must give every parameter a (zero)
    gradient, as the other ranks' does, or FSDP reduces different sets of gradients on different ranks."""
    actor = _actor(tiny_model_untied)
    batch = collate(_samples(actor.config.vocab_size)[:2], 0, packed=packed)
    batch["response_mask"].zero_()
    logp, ent = batch_logprobs(actor, batch)
    assert logp.requires_grad and (logp == 0).all() and (ent == 0).all()
    (logp.sum() + ent.sum()).backward()
    grads = dict(actor.named_parameters())
    assert all(p.grad is not None and (p.grad == 0).all() for p in grads.values()), (
        "a parameter got no gradient"
    )


def test_attention_across_sequences_would_show(tiny_model_untied: Path) -> None:
    """The comparisons above can fail: one causal attention over the whole packed row (positions still restarting)
    moves the later sequences' logprobs far beyond the tolerance."""
    actor = _actor(tiny_model_untied)
    samples = _samples(actor.config.vocab_size)
    t = collate(samples, 0, packed=True)
    want = pack(t["response_mask"], t)
    with torch.no_grad():
        lp, _ = batch_logprobs(actor, t)
        n = t["packed_ids"].shape[1]
        one = PackedRow([n], torch.tensor([0, n], dtype=torch.int32))
        leaky, _ = token_logprobs_and_entropy(
            actor, t["packed_ids"], None, t["packed_positions"], want, packed=one
        )
    diff = (unpack(leaky, t) - lp).abs()
    assert diff[0].max() < ATOL  # the first sequence has nothing before it
    assert diff[1:].max() > 1e3 * ATOL


def test_transformers_packing_detection_agrees_for_other_attention(tiny_model_tied: Path) -> None:
    """A model on eager attention keeps it and gets transformers' own packing (a mask built from position_ids)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(
        tiny_model_tied, dtype=torch.float32, attn_implementation="eager"
    )
    actor = Actor(lm)
    assert actor.config._attn_implementation == "eager"
    samples = _samples(actor.config.vocab_size)
    with torch.no_grad():
        lp, ent = batch_logprobs(actor, collate(samples, 0))
        lp_p, ent_p = batch_logprobs(actor, collate(samples, 0, packed=True))
    torch.testing.assert_close(lp_p, lp, **TOL)
    torch.testing.assert_close(ent_p, ent, **TOL)


@pytest.mark.gpu
def test_varlen_kernel_equals_causal_sdpa_per_sequence() -> None:
    """On CUDA in bf16 a packed row's attention is one varlen flash call (``_causal_varlen``): outputs and gradients
    match causal SDPA on each sequence (the CPU path), up to bf16 rounding; attention over the whole row does not."""
    from torch import nn

    from trainer.attention import _causal_per_sequence, _causal_varlen

    heads, kv_heads, dim, lens = 12, 2, 128, [300, 7, 1, 2048, 513, 96]
    module = nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]
    g = torch.Generator(device="cuda").manual_seed(0)

    def qkv() -> list[torch.Tensor]:
        return [
            torch.randn(
                1, h, sum(lens), dim, device="cuda", generator=g, dtype=torch.bfloat16
            ).requires_grad_()
            for h in (heads, kv_heads, kv_heads)
        ]

    row = PackedRow(lens, torch.tensor([0, *lens], device="cuda").cumsum(0).int())
    inputs = qkv()
    results = []
    for fn in (
        lambda q, k, v: _causal_varlen(q, k, v, row, dim**-0.5),
        lambda q, k, v: _causal_per_sequence(module, q, k, v, lens, 0.0, dim**-0.5),
        lambda q, k, v: _causal_per_sequence(module, q, k, v, [sum(lens)], 0.0, dim**-0.5),
    ):
        out = fn(*inputs)
        assert out is not None and out.shape == (1, sum(lens), heads, dim)
        grads = torch.autograd.grad(out.float().square().sum(), inputs)
        results.append((out.float(), [x.float() for x in grads]))
    (out, grads), (ref, ref_grads), (leaky, _) = results
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for x, y in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(x, y, rtol=5e-2, atol=5e-2 * y.abs().max().item())
    assert (leaky - ref).abs().max() > 0.1
