"""``trainer.compile_head``: the fused head's per-chunk softmax work as two compiled kernels.

What must hold, on CPU (inductor's C++ backend): the compiled chunk gives the eager chunk's logprobs, entropies and
gradients (fp32 within rounding, with a temperature, a bias, with and without the entropy; bf16 within bf16 rounding);
a micro-batch's last, shorter chunk reuses the full chunks' kernels (two graphs in all, not two per chunk length);
and a training step with it gives the step without it.  What it buys is measured by ``bench/head.py`` (the
``compiled`` line) and on a GPU by ``bash bench/run_gpu.sh OUT fusedhead``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo

from tests.unit.test_fused_head import _cfg, _per_token_loss
from tests.unit.test_packing import _assert_grads_close, _grads, _models, _samples
from trainer import dist as tdist
from trainer import fused_head as fh
from trainer.step import train_step


def _run(
    compiled: bool, dtype: torch.dtype, temperature: float, with_entropy: bool, with_bias: bool
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n, hidden, vocab = 150, 32, 700  # chunks of 64: two full ones and a shorter last one
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / 4).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g) / 4).to(dtype).requires_grad_() if with_bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    old, adv = -torch.rand(n, generator=g) * 4, torch.randn(n, generator=g)

    def loss_of(lp: torch.Tensor, en: torch.Tensor) -> torch.Tensor:
        return _per_token_loss(lp, en, old, adv)

    lp, ent, carrier = fh.fused_head(h, w, b, y, temperature, with_entropy, 64, loss_of, compiled)
    carrier.backward()
    grads = [t.grad for t in (h, w, b) if t is not None]
    assert all(gr is not None and gr.dtype == dtype for gr in grads)
    return [lp, ent, *grads]  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("temperature", "with_entropy", "with_bias"), [(0.7, True, True), (1.0, False, False)]
)
def test_the_compiled_chunk_gives_the_eager_chunks_values_and_gradients(
    temperature: float, with_entropy: bool, with_bias: bool
) -> None:
    torch._dynamo.reset()
    fh._KERNELS = None
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = _run(True, torch.float32, temperature, with_entropy, with_bias)
    # one graph for each of the two functions, whatever the chunk's rows (150 = 64 + 64 + 22)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
    want = _run(False, torch.float32, temperature, with_entropy, with_bias)
    assert float(want[-1].abs().max()) > 1e-4  # a gradient that is not nothing
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()) + 1e-12)


def test_in_bf16_the_compiled_chunk_matches_the_eager_one_within_bf16_rounding() -> None:
    got = _run(True, torch.bfloat16, 1.0, True, False)
    want = _run(False, torch.bfloat16, 1.0, True, False)
    for a, b in zip(got[:2], want[:2], strict=True):  # logprobs and entropies: fp32 from the same bf16 logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(got[2:], want[2:], strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2


def test_a_step_with_the_compiled_head_equals_one_without(
    tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tdist, "_device", torch.device("cpu"))
    algorithm = {
        "name": "grpo",
        "entropy_coef": 0.02,
        "kl_coef": 0.1,
        "kl_estimator": "k3",
        "off_policy": "none",
    }
    metrics, grads = [], []
    for compiled in (False, True):
        cfg = _cfg(True, True, algorithm).model_copy(deep=True)
        cfg.trainer.compile_head = compiled
        models = _models(tiny_model_untied, cfg)
        models.critic = models.critic_optimizer = models.critic_scheduler = None
        samples = _samples(models.actor.config.vocab_size, seed=4)
        out: list[dict[str, torch.Tensor]] = []
        metrics.append(
            train_step(cfg, models, samples, pad_id=0, grad_hook=lambda m, o=out: o.append(_grads(m.actor)))
        )
        grads.append(out[0])
    plain, compiled_m = metrics
    assert plain.keys() == compiled_m.keys() and plain["grad_norm"] > 1e-3
    for k in plain:
        assert compiled_m[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-6), k
    _assert_grads_close(grads[1], grads[0])
