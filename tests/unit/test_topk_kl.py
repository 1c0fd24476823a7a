"""The KL to the reference over its top-k tokens (``algorithm.kl_estimator = "topk"``), on CPU in fp32.

Against a naive computation from both models' full softmaxes: the value per position, its bounds (exact with one token
left in the rest's bin, never above the exact KL, never below 0), the same numbers padded and packed, and gradients
that reach the actor only.  And why it exists: a learnt format whose margin erodes (the runner-up token gains
probability while the chosen one still holds almost all of it) is seen by it, and barely by k3 on the sampled token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from buffer.config import ConfigError, ShardRLConfig, validate
from tests.unit.test_packing import _samples
from trainer import ppo
from trainer.batching import collate
from trainer.logprobs import TopK, topk_kl
from trainer.model import Actor, batch_logprobs, load_causal_lm

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _exact(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (lp.exp() * (lp - ref)).sum(-1)


def _top(ref: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    top = ref.topk(k, dim=-1)
    rest = torch.logsumexp(ref.scatter(1, top.indices, float("-inf")), dim=1)
    return top.indices, top.values, rest


def test_topk_kl_is_exact_with_one_token_left_and_a_lower_bound_below() -> None:
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(3 * torch.randn(6, 50, generator=g), -1)
    ref = torch.log_softmax(3 * torch.randn(6, 50, generator=g), -1)
    exact = _exact(lp, ref)
    torch.testing.assert_close(topk_kl(lp, *_top(ref, 49)), exact, **TOL)
    for k in (1, 5, 20):
        got = topk_kl(lp, *_top(ref, k))
        assert (got >= -1e-6).all() and (got <= exact + 1e-5).all(), (k, got, exact)
    assert topk_kl(ref, *_top(ref, 5)).abs().max() < 1e-6  # a distribution against itself


def test_an_eroding_margin_shows_in_topk_and_hardly_in_k3() -> None:
    # The reference's chosen token with a margin of 9 over the runner-up; the policy's margin eroded to 3.
    ref = torch.log_softmax(torch.tensor([[9.0, 0.0] + [-4.0] * 30]), -1)
    pol = torch.log_softmax(torch.tensor([[3.0, 0.0] + [-4.0] * 30]), -1)
    sampled = torch.tensor([[0]])  # at temperature 1 the chosen token is drawn 95% of the time
    k3 = ppo.kl_estimate(pol.gather(1, sampled), ref.gather(1, sampled), "k3")
    topk = topk_kl(pol, *_top(ref, 8))
    assert float(k3) < 5e-3 and float(topk) > 0.15, (float(k3), float(topk))


@pytest.fixture
def actor_and_reference(tiny_model_untied: Path) -> tuple[Actor, Actor]:
    actor, reference = Actor(load_causal_lm(tiny_model_untied)), Actor(load_causal_lm(tiny_model_untied))
    with torch.no_grad():  # the actor one step away from the reference
        g = torch.Generator().manual_seed(3)
        for p in actor.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return actor, reference


@pytest.mark.parametrize("packed", [False, True])
def test_the_actors_pass_gives_the_topk_kl_of_each_response_token(
    actor_and_reference: tuple[Actor, Actor], packed: bool
) -> None:
    actor, reference = actor_and_reference
    samples = _samples(actor.config.vocab_size, shapes=[(4, 6), (3, 9), (0, 5)])
    batch = collate(samples, 0, packed=packed)
    naive_batch = collate(samples, 0)
    top = TopK(8)
    with torch.no_grad():
        batch_logprobs(reference, batch, chunk=5, temperature=0.7, with_entropy=False, topk=top)
    assert top.index is not None and top.index.shape[1] == 8
    batch_logprobs(actor, batch, chunk=5, temperature=0.7, with_entropy=False, topk=top)
    assert top.kl is not None and top.kl.requires_grad

    # naive: both models' full softmaxes over the padded batch, the KL over the reference's top 8 per position
    ids, attn, mask = (
        naive_batch["input_ids"],
        naive_batch["attention_mask"],
        naive_batch["response_mask"].bool(),
    )
    with torch.no_grad():
        lp = torch.log_softmax(actor.lm(input_ids=ids, attention_mask=attn).logits.float() / 0.7, -1)
        rl = torch.log_softmax(reference.lm(input_ids=ids, attention_mask=attn).logits.float() / 0.7, -1)
    want = mask.clone()
    want[:, 0] = False
    src = torch.zeros_like(want)
    src[:, :-1] = want[:, 1:]
    naive = torch.zeros(want.shape)
    naive[want] = topk_kl(lp[src], *_top(rl[src], 8))
    torch.testing.assert_close(top.kl.detach(), naive, **TOL)
    assert float(naive.sum()) > 1e-3  # the actor moved: something to compare

    top.kl.sum().backward()
    assert all(p.grad is not None for p in actor.parameters() if p.requires_grad)
    assert all(p.grad is None for p in reference.parameters())


def test_a_reference_pass_of_another_batch_is_refused(actor_and_reference: tuple[Actor, Actor]) -> None:
    actor, reference = actor_and_reference
    samples = _samples(actor.config.vocab_size, shapes=[(4, 6), (3, 9)])
    top = TopK(4)
    with torch.no_grad():
        batch_logprobs(reference, collate(samples[:1], 0), topk=top)
    with pytest.raises(ValueError, match="same batch"):
        batch_logprobs(actor, collate(samples, 0), topk=top)


def test_topk_is_a_loss_term_only() -> None:
    algorithm = {"name": "reinforce_pp", "kl_coef": 0.1, "kl_mode": "reward", "kl_estimator": "topk"}
    with pytest.raises(ConfigError, match=r"kl_estimator = 'topk' needs algorithm\.kl_mode = 'loss'"):
        validate({"reward": {"function": "max_digit"}, "algorithm": algorithm}, "run.toml")
    validate({"reward": {"function": "max_digit"}, "algorithm": {**algorithm, "kl_mode": "loss"}}, "run.toml")


def test_a_train_step_with_topk_reports_the_exact_kl_with_k_one_below_the_vocabulary(
    tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train_step`` with kl_estimator = "topk": the reference's pass in ``prepare``, the actor's in the loss; with
    one token in the rest's bin its ``kl_ref`` is the exact KL, token-mean over the response tokens."""
    from tests.unit.test_packing import _models
    from trainer import dist as tdist
    from trainer.step import Models, train_step

    monkeypatch.setattr(tdist, "_device", torch.device("cpu"))
    vocab = load_causal_lm(tiny_model_untied).config.vocab_size
    cfg = ShardRLConfig.model_validate(
        {
            "reward": {"function": "max_digit"},
            "algorithm": {"name": "grpo", "kl_coef": 0.1, "kl_estimator": "topk", "kl_top_k": vocab - 1},
            "trainer": {"max_tokens_per_microbatch": 4096},
        }
    )
    with_critic = _models(tiny_model_untied, cfg)
    models = Models(with_critic.actor, with_critic.optimizer, with_critic.scheduler, with_critic.reference)
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for p in models.reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    samples = _samples(vocab, seed=2, shapes=[(4, 6), (3, 9), (2, 5), (5, 4)])
    batch = collate(samples, 0)
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["response_mask"].bool()
    with torch.no_grad():
        lp = torch.log_softmax(models.actor.lm(input_ids=ids, attention_mask=attn).logits.float(), -1)
        rl = torch.log_softmax(models.reference.lm(input_ids=ids, attention_mask=attn).logits.float(), -1)
    want = mask.clone()
    want[:, 0] = False
    src = torch.zeros_like(want)
    src[:, :-1] = want[:, 1:]
    exact = _exact(lp[src], rl[src]).mean()

    grads: list[bool] = []
    m = train_step(
        cfg,
        models,
        samples,
        pad_id=0,
        grad_hook=lambda ms: grads.append(all(p.grad is not None for p in ms.actor.parameters())),
    )
    assert m["kl_ref"] == pytest.approx(float(exact), rel=1e-4) and float(exact) > 1e-3
    assert grads == [True]
