"""The chunked logprob/entropy head against a naive full-softmax computation: values and gradients, on CPU."""

from __future__ import annotations

import pytest
import torch

from trainer.model import Critic, token_logprobs_and_entropy


def _tiny_lm(tied: bool):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=300,
        tie_word_embeddings=tied,
        initializer_range=0.2,  # far from uniform next-token distributions, so a misaligned position shows
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 300, (3, 11), generator=g)
    attention_mask = torch.ones(3, 11, dtype=torch.long)
    attention_mask[1, 8:] = 0  # right padding
    attention_mask[2, 5:] = 0
    response_mask = attention_mask.bool().clone()
    response_mask[:, :4] = False  # a 4-token prompt
    return input_ids, attention_mask, response_mask


def _naive(lm, input_ids, attention_mask, response_mask, temperature):
    logits = lm(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logprobs.exp() * logprobs).sum(-1)
    zero = torch.zeros(input_ids.shape[0], 1)
    mask = response_mask.float()
    mask[:, 0] = 0
    return torch.cat([zero, logp], 1) * mask, torch.cat([zero, ent], 1) * mask


def _grads(lm, fn):
    lm.zero_grad(set_to_none=True)
    logp, ent = fn()
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(logp.shape, generator=g), torch.randn(ent.shape, generator=g)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("chunk", "temperature"), [(1, 1.0), (7, 0.7), (4096, 1.0)])
def test_chunked_equals_full_softmax(tied: bool, chunk: int, temperature: float) -> None:
    lm = _tiny_lm(tied)
    ids, am, rm = _batch()
    lp_ref, ent_ref, g_ref = _grads(lm, lambda: _naive(lm, ids, am, rm, temperature))
    lp, ent, g = _grads(
        lm,
        lambda: token_logprobs_and_entropy(
            lm, ids, attention_mask=am, response_mask=rm, chunk=chunk, temperature=temperature
        ),
    )
    assert lp.dtype == ent.dtype == torch.float32
    assert lp.shape == ent.shape == ids.shape
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    assert (lp[~rm] == 0).all() and (lp[:, 0] == 0).all()
    assert (lp[rm] < 0).all() and (ent[rm] > 0.1).all()  # the check above was not a comparison of zeros
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        scale = (
            g_ref[name].abs().max().item()
        )  # fp32 sums in another order: compare relative to the largest entry
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5 * scale)
        assert scale > 0, name


def test_default_masks_and_no_grad() -> None:
    lm = _tiny_lm(False)
    ids, am, _ = _batch()
    with torch.no_grad():
        lp_ref, ent_ref = _naive(lm, ids, am, am.bool(), 1.0)
        lp, ent = token_logprobs_and_entropy(lm, ids, attention_mask=am, chunk=5)
        lp_nomask, _ = token_logprobs_and_entropy(lm, ids[:1], chunk=5)
        lp_one, _ = token_logprobs_and_entropy(lm, ids[:1], chunk=5, with_entropy=False)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp_nomask, lp_ref[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp_one, lp_ref[:1], rtol=1e-5, atol=1e-5)
    assert not lp.requires_grad


def test_critic_values_are_aligned_with_logprobs() -> None:
    lm = _tiny_lm(False)
    critic = Critic(lm.base_model, 128)
    torch.nn.init.normal_(critic.value_head.weight)
    ids, am, _ = _batch()
    v = critic.values(ids, attention_mask=am)
    h = lm.base_model(input_ids=ids, attention_mask=am).last_hidden_state
    expected = critic.value_head(h).squeeze(-1)
    assert v.shape == ids.shape and (v[:, 0] == 0).all()
    torch.testing.assert_close(v[:, 1:], expected[:, :-1])
