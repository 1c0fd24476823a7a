"""``trainer.fused_head``: the LM head takes its gradient in forward from a loss of per-token terms.

What must hold, on CPU in fp32: the head's logprobs, entropies and gradients are those of autograd through the whole
[N, V] logits, at any chunk size, temperature and bias, with a frozen weight too (a LoRA actor); a training step with
it on gives the metrics and gradients of the recomputing head, padded and packed, with a critic, an entropy bonus, a
KL loss and each loss aggregation; it runs one logits product per chunk, where the recomputing head runs two; and the
losses that couple a sequence's tokens keep the recomputing head.  What it buys on a GPU is measured by
``bash bench/run_gpu.sh OUT fusedhead``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from buffer.config import ShardRLConfig
from tests.unit.test_packing import _assert_grads_close, _grads, _models, _samples
from trainer import dist as tdist
from trainer import fused_head as fh
from trainer.step import Models, fused_head_applies, head_compiled, train_step


def _per_token_loss(
    logp: torch.Tensor, ent: torch.Tensor, old: torch.Tensor, adv: torch.Tensor
) -> torch.Tensor:
    """A clipped ratio, a k3 KL and an entropy bonus, summed over tokens: the shape of the actor's loss."""
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    kl = torch.exp(old - logp) - (old - logp) - 1
    return (pg + 0.05 * kl - 0.01 * ent).sum() / 7.0


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums over the vocabulary in another order: within a few ulps of the tensor's largest entry
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def _reference(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h, w, b).float() / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    return logsm.gather(-1, y.unsqueeze(-1)).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize(
    ("chunk", "temperature", "with_bias", "frozen"),
    [(4, 1.0, False, False), (5, 0.7, True, False), (64, 1.3, False, True), (1, 1.0, True, False)],
)
def test_the_fused_head_gives_the_gradients_of_autograd_through_the_whole_logits(
    chunk: int, temperature: float, with_bias: bool, frozen: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 23, 16, 40
    h0 = torch.randn(n, hidden, generator=g)
    w0 = torch.randn(vocab, hidden, generator=g) / 2
    b0 = torch.randn(vocab, generator=g) if with_bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    old = -torch.rand(n, generator=g) * 4
    adv = torch.randn(n, generator=g)

    def leaves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        b = None if b0 is None else b0.clone().requires_grad_()
        return h0.clone().requires_grad_(), w0.clone().requires_grad_(not frozen), b

    h, w, b = leaves()
    logp, ent = _reference(h, w, b, y, temperature)
    (
        2.0 * _per_token_loss(logp, ent, old, adv)
    ).backward()  # 2: a loss scaled after the head (the world size)

    hf, wf, bf = leaves()
    lp_f, ent_f, carrier = fh.fused_head(
        hf, wf, bf, y, temperature, True, chunk, lambda lp, en: _per_token_loss(lp, en, old, adv)
    )
    assert not lp_f.requires_grad and not ent_f.requires_grad and carrier.item() == 0.0
    (_per_token_loss(lp_f, ent_f, old, adv) * 2.0 + 2.0 * carrier).backward()  # the first term has no grad
    torch.testing.assert_close(lp_f, logp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_f, ent.detach(), rtol=1e-5, atol=1e-6)
    for got, want in ((hf, h), (wf, w), (bf, b)):
        if want is None or not want.requires_grad:
            assert got is None or got.grad is None
            continue
        assert want.grad is not None and got.grad is not None and want.grad.abs().max() > 0
        _close(got.grad, want.grad)


def test_without_entropy_the_head_returns_zeros_and_takes_the_logprob_terms_only() -> None:
    g = torch.Generator().manual_seed(1)
    h0, w0 = torch.randn(9, 8, generator=g), torch.randn(30, 8, generator=g)
    y = torch.randint(0, 30, (9,), generator=g)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    logp, _ = _reference(h, w, None, y, 1.0)
    (logp**2).sum().backward()
    hf, wf = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    _lp, ent, carrier = fh.fused_head(hf, wf, None, y, 1.0, False, 4, lambda lp, _en: (lp**2).sum())
    carrier.backward()
    assert (ent == 0).all()
    assert hf.grad is not None and wf.grad is not None and h.grad is not None and w.grad is not None
    _close(hf.grad, h.grad)
    _close(wf.grad, w.grad)


def _cfg(fused: bool, packing: bool, algorithm: dict[str, Any]) -> ShardRLConfig:
    algorithm = dict(algorithm)
    temperature = algorithm.pop("temperature", 1.0)  # the sampling's, which the head divides the logits by
    return ShardRLConfig.model_validate(
        {
            "reward": {"function": "max_digit"},
            "algorithm": algorithm,
            "rollout": {"sampling": {"temperature": temperature}},
            "trainer": {
                "packing": packing,
                "max_tokens_per_microbatch": 256,
                "logprob_chunk": 37,
                "fused_head": fused,
            },
        }
    )


PPO = {"name": "ppo", "entropy_coef": 0.01, "kl_coef": 0.05, "loss_agg": "seq-mean-token-mean"}
GRPO = {"name": "grpo", "entropy_coef": 0.02, "kl_coef": 0.1, "kl_estimator": "k3", "off_policy": "none"}
TIS = {"name": "grpo", "off_policy": "tis", "temperature": 0.8, "loss_agg": "seq-mean-token-sum-norm"}
SUM = {"name": "grpo", "entropy_coef": 0.01, "loss_agg": "token-sum"}
RLOO = {"name": "rloo", "loss_agg": "seq-mean-token-sum", "kl_coef": 0.05, "kl_estimator": "k2"}


@pytest.mark.parametrize(
    ("tie", "packing", "algorithm"),
    [
        ("untied", False, PPO),
        ("tied", True, PPO),
        ("untied", True, GRPO),
        ("tied", False, TIS),
        ("untied", True, SUM),
        ("tied", True, RLOO),
    ],
    ids=["ppo-padded", "ppo-packed-tied", "grpo-k3-packed", "tis-tied", "token-sum", "rloo-k2"],
)
def test_a_step_with_the_fused_head_equals_one_with_the_recomputing_head(
    tie: str,
    packing: bool,
    algorithm: dict[str, Any],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tdist, "_device", torch.device("cpu"))
    model_dir = Path(request.getfixturevalue(f"tiny_model_{tie}"))
    grads: list[dict[str, torch.Tensor]] = []
    metrics = []
    for fused in (False, True):
        cfg = _cfg(fused, packing, algorithm)
        assert fused_head_applies(cfg) == fused
        models = _models(model_dir, cfg)
        if cfg.algorithm.name != "ppo":
            models.critic = models.critic_optimizer = models.critic_scheduler = None

        def hook(m: Models) -> None:
            grads.append({f"actor/{k}": v for k, v in _grads(m.actor).items()})
            if m.critic is not None:
                grads[-1].update({f"critic/{k}": v for k, v in _grads(m.critic).items()})

        samples = _samples(models.actor.config.vocab_size, seed=4)
        metrics.append(train_step(cfg, models, samples, pad_id=0, grad_hook=hook))
    plain, fused_m = metrics
    assert plain.keys() == fused_m.keys()
    for k in plain:
        assert fused_m[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-6), k
    assert plain["grad_norm"] > 1e-3
    _assert_grads_close(grads[1], grads[0])


def test_the_fused_head_runs_one_logits_product_per_chunk(
    tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The point of it: the recomputing head runs each chunk's logits twice (forward, then again in backward)."""
    monkeypatch.setattr(tdist, "_device", torch.device("cpu"))
    counts = {}
    real_linear = F.linear
    for fused in (False, True):
        cfg = _cfg(fused, True, {"name": "grpo", "off_policy": "none"})
        models = _models(tiny_model_untied, cfg)
        models.critic = models.critic_optimizer = models.critic_scheduler = None
        head_weight = models.actor.lm.get_output_embeddings().weight
        calls = [0]

        def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls[0] += args[1] is head_weight  # noqa: B023 (read while this iteration's step runs)
            return real_linear(*args, **kwargs)

        monkeypatch.setattr(F, "linear", counting)
        train_step(cfg, models, _samples(models.actor.config.vocab_size, seed=4), pad_id=0)
        monkeypatch.setattr(F, "linear", real_linear)
        counts[fused] = calls[0]
    assert counts[True] > 0 and counts[False] == 2 * counts[True], counts


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "grpo", "policy_loss": "gspo"},
        {"name": "grpo", "off_policy": "tis", "off_policy_level": "sequence"},
        {"name": "grpo", "kl_coef": 0.1, "kl_estimator": "topk"},
    ],
    ids=["gspo", "tis-sequence", "topk-kl"],
)
def test_losses_that_couple_tokens_keep_the_recomputing_head(algorithm: dict[str, Any]) -> None:
    assert not fused_head_applies(_cfg(True, True, algorithm))
    assert fused_head_applies(_cfg(True, True, {"name": "grpo"}))
    assert not fused_head_applies(_cfg(False, True, {"name": "grpo"}))


def test_in_bf16_the_gradients_match_the_recomputing_heads_within_bf16_rounding() -> None:
    """The GPU's dtype: bf16 products, fp32 logits and softmax, as the recomputing head runs them."""
    g = torch.Generator().manual_seed(2)
    n, hidden, vocab = 300, 64, 500
    h0 = (torch.randn(n, hidden, generator=g)).bfloat16()
    w0 = (torch.randn(vocab, hidden, generator=g) / 8).bfloat16()
    y = torch.randint(0, vocab, (n,), generator=g)
    old, adv = -torch.rand(n, generator=g) * 4, torch.randn(n, generator=g)

    def loss_of(lp: torch.Tensor, en: torch.Tensor) -> torch.Tensor:
        return _per_token_loss(lp, en, old, adv)

    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lps, ents = [], []
    for s in range(0, n, 64):  # the recomputing head's chunks, each checkpointed
        lp, en = torch.utils.checkpoint.checkpoint(
            _reference, h[s : s + 64], w, None, y[s : s + 64], 1.0, use_reentrant=False
        )
        lps.append(lp)
        ents.append(en)
    loss = loss_of(torch.cat(lps), torch.cat(ents))
    loss.backward()
    hf, wf = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lp_f, ent_f, carrier = fh.fused_head(hf, wf, None, y, 1.0, True, 64, loss_of)
    (loss_of(lp_f, ent_f) + carrier).backward()
    assert loss_of(lp_f, ent_f).item() == pytest.approx(loss.item(), rel=1e-2)
    for got, want in ((hf.grad, h.grad), (wf.grad, w.grad)):
        assert got is not None and want is not None and got.dtype == torch.bfloat16
        # the input's gradient comes out the same; the weight's differs by the order of its bf16 sums (~4e-3 here)
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


def test_compile_head_unset_follows_where_the_layers_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # null: compiled exactly where trainer.kernels compiles the decoder layers; true / false stand on any device
    head_compiled.cache_clear()
    assert not head_compiled(None, "auto", "cpu") and not head_compiled(None, "eager", "cuda")
    assert head_compiled(None, "compile", "cpu") and head_compiled(None, "auto", "cuda")
    assert head_compiled(True, "eager", "cpu") and not head_compiled(False, "compile", "cuda")
    # no C compiler: auto stays eager for the layers, and so does the head
    import trainer.sharding as sharding

    head_compiled.cache_clear()
    monkeypatch.setattr(sharding.shutil, "which", lambda _name: None)
    assert not head_compiled(None, "auto", "cuda")
    head_compiled.cache_clear()
